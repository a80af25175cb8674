"""The planner against published training runs: each run's published step and MFU beside the prediction.

The runs are data, a TOML file a source table (tests/plan/published/, or `--data DIR`): its citation,
FLOP convention, system (as `--system` names it, and where the run differs), hardware, assumptions, and a
line a run with the source's figure. Three sets: the MegaScale papers' (`hardware.GEMM_EFFICIENCY` is
fitted on two of their tables), the validation set and the hold-out tables, which fit nothing. A run's
predicted MFU is its source's FLOPs over the predicted step, so errors are in the source's own points.
`python -m megascale.plan.validation` prints the tables of docs/planning.md (a test checks they agree).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megascale.config import AttentionConfig, ModelConfig, MoEConfig
from megascale.errors import ConfigError
from megascale.models.flops import attention_flops_per_token, flops_per_token, num_params
from megascale.plan.hardware import PROFILES, HardwareProfile
from megascale.plan.job import MIXED_BF16, Cluster, Features, Job, Layout
from megascale.plan.search import NoLayoutFits, Plan, fastest_per_split, search
from megascale.plan.step import StepEstimate, estimate_step
from megascale.plan.systems import SYSTEMS

DATA = Path(__file__).resolve().parents[2] / "tests" / "plan" / "published"
SETS = ("paper", "validation", "holdout")
FIGURES = ("step_s", "mfu", "tflops_per_gpu", "tokens_per_s_per_gpu", "tokens_per_s")
ROW_KEYS = {"label", "model", "seq_len", "batch", "layout", "system", "hardware", "features", "params"}
RUN_KEYS = {"dropout": False, "grad_bytes": MIXED_BF16.grad_bytes, "fp8": False, "fp8_all_gather": False}


def _megatron(model: ModelConfig, seq_len: int, gemms: int) -> float:
    """Megatron's FLOPs of a GPT with a 4h GeLU MLP, each block GEMM run `gemms` times (3: forward and
    backward; 4: and the recomputed forward), attention unhalved, the logit layer 3 times."""
    h, layers, vocab = model.dim, model.n_layers, model.vocab_size
    return 24 * gemms * layers * h * h * (1 + seq_len / (6 * h) + vocab / (4 * gemms * layers * h))


# FLOPs a token by a table's `flops` convention, from (model, sequence, parameters as its source counts):
# SC'21's hardware FLOPs (arXiv:2104.04473 Eq. 3), Korthikanti et al.'s model FLOPs (arXiv:2205.05198
# Appendix A), PaLM's 6N + 12 L h s (arXiv:2204.02311 Appendix B), and NVIDIA's: 6 x the parameters a
# token uses with causal attention at half the square.
FLOPS: dict[str, Callable[[ModelConfig, int, float], float]] = {
    "megatron-hardware": lambda model, seq_len, params: _megatron(model, seq_len, 4),
    "megatron-model": lambda model, seq_len, params: _megatron(model, seq_len, 3),
    "palm": lambda model, seq_len, params: 6 * params + 12 * model.n_layers * model.dim * seq_len,
    "causal": lambda model, seq_len, params: (
        flops_per_token(model, seq_len) - attention_flops_per_token(model, seq_len) / 2
    ),
}


@dataclass(frozen=True)
class Source:
    """One published table: its name, set and file, where it comes from, how it counts, what we assumed."""

    name: str
    set: str
    file: str
    where: str
    convention: str
    assumed: str


@dataclass(frozen=True)
class Published:
    """One published run: its job and layout, the system and hardware it ran on, its published figures."""

    source: Source
    label: str
    job: Job
    layout: Layout
    system: str
    features: Features
    profile: HardwareProfile
    cluster: Cluster
    flops_per_step: float  # in the source's convention
    step_s: float  # as published, or as its published throughput implies
    mfu: float  # as published, or as its published step time implies
    mfu_peak_flops: float  # the per-device peak the source's MFU divides by

    @property
    def gpus(self) -> int:
        return self.layout.devices

    @functools.cached_property
    def predicted(self) -> StepEstimate:
        return estimate_step(self.job, self.layout, self.features, self.profile, self.cluster)

    @property
    def predicted_mfu(self) -> float:
        """The MFU the prediction implies, in the source's convention."""
        return self.flops_per_step / (self.predicted.step_s * self.gpus * self.mfu_peak_flops)

    @property
    def error_points(self) -> float:
        return 100 * (self.predicted_mfu - self.mfu)

    def searched_plans(self) -> list[Plan]:
        """`megascale plan`'s search for this run's job and devices, over what its system can run (searched
        once a row: the tables and the agreement both read it)."""
        if isinstance(found := self._searched, NoLayoutFits):
            raise found
        return found

    @functools.cached_property
    def _searched(self) -> list[Plan] | NoLayoutFits:
        skip_selective = self.features.fused_kernels
        try:
            return search(self.job, self.cluster, self.profile, self.features, skip_selective=skip_selective)
        except NoLayoutFits as err:
            return err

    def search_agrees(self) -> bool:
        """Whether the search ranks the published split among its first five (as `megascale plan` lists them)
        or predicts it within 3 points of its own pick; not where no layout fits."""
        try:
            plans = self.searched_plans()
        except NoLayoutFits:
            return False
        layout = self.layout
        top = [(p.layout.tp, p.layout.pp, p.layout.dp, p.layout.cp) for p in fastest_per_split(plans)[:5]]
        pick_mfu = self.predicted_mfu * self.predicted.step_s / plans[0].estimate.step_s
        return (layout.tp, layout.pp, layout.dp, layout.cp) in top or 100 * (
            pick_mfu - self.predicted_mfu
        ) <= 3


@dataclass(frozen=True)
class Table:
    source: Source
    system: str  # the system most of its rows name
    rows: list[Published]


def _model(spec: dict[str, Any], seq_len: int) -> ModelConfig:
    spec = dict(spec)
    attention = AttentionConfig(**spec.pop("attention", {}))
    moe = MoEConfig(**spec.pop("moe", {}))
    return ModelConfig(**spec, attention=attention, moe=moe, max_seq_len=seq_len)


def _features(features: Features, changes: dict[str, Any]) -> Features:
    tuples: dict[str, Any] = {key: tuple(v) if isinstance(v, list) else v for key, v in changes.items()}
    return dataclasses.replace(features, **tuples)


def _profile(name: str, changes: dict[str, Any]) -> HardwareProfile:
    profile = PROFILES[name]
    peaks = {**profile.peak_tflops, **changes.get("peak_tflops", {})}
    return dataclasses.replace(profile, **{**changes, "peak_tflops": peaks})


def _row(table: dict[str, Any], source: Source, row: dict[str, Any]) -> Published:
    unknown = set(row) - ROW_KEYS - set(RUN_KEYS) - set(FIGURES)
    if unknown or len(set(row) & set(FIGURES) - {"mfu"}) > 1:
        raise ConfigError(f"validation: {source.file}, {row.get('label')!r}: unknown keys or figures {row}")
    run = {key: row.get(key, table.get(key, default)) for key, default in RUN_KEYS.items()}
    model = _model(table["models"][row["model"]], row["seq_len"])
    precision = dataclasses.replace(MIXED_BF16, grad_bytes=run["grad_bytes"])
    if run["fp8_all_gather"]:
        precision = dataclasses.replace(precision, gathered_block_bytes=1)
    job = Job(
        model,
        row["seq_len"],
        row["batch"],
        precision=precision,
        **{k: run[k] for k in RUN_KEYS if k != "grad_bytes"},
    )
    layout = Layout(**row["layout"])
    system = row.get("system", table["system"])
    features = _features(_features(SYSTEMS[system], table.get("features", {})), row.get("features", {}))
    profile = _profile(row.get("hardware", table["hardware"]), table.get("hardware_changes", {}))
    params = row.get("params", table.get("params", num_params(model)))
    flops = job.tokens_per_step * FLOPS[table["flops"]](model, job.seq_len, params)
    peak = table["mfu_peak_tflops"] * 1e12 if "mfu_peak_tflops" in table else profile.peak_flops("bfloat16")
    gpus = layout.devices
    step_s = row.get("step_s")
    if "tflops_per_gpu" in row:
        step_s = flops / (gpus * row["tflops_per_gpu"] * 1e12)
    elif "tokens_per_s" in row:
        step_s = job.tokens_per_step / row["tokens_per_s"]
    elif "tokens_per_s_per_gpu" in row:
        step_s = job.tokens_per_step / (gpus * row["tokens_per_s_per_gpu"])
    elif step_s is None:
        step_s = flops / (gpus * peak * row["mfu"])
    mfu = row.get("mfu", flops / (step_s * gpus * peak))
    cluster = Cluster(gpus, **table.get("cluster", {}))
    return Published(
        source, row["label"], job, layout, system, features, profile, cluster, flops, step_s, mfu, peak
    )


def load_table(path: Path) -> Table:
    """One data file's table, every row ready to predict."""
    table = tomllib.loads(path.read_text())
    fields = ("name", "set", "where", "convention", "assumed")
    source = Source(**{key: table[key] for key in fields}, file=path.name)
    if source.set not in SETS:
        raise ConfigError(f"validation: {path}: set {source.set!r} is not one of {', '.join(SETS)}")
    return Table(source, table["system"], [_row(table, source, row) for row in table["rows"]])


def load_tables(data: Path = DATA) -> list[Table]:
    """Every table in `data`, the papers' first, then the validation set's and the hold-out tables."""
    if not data.is_dir():
        raise ConfigError(f"validation: no folder of published tables at {data}; give one with --data DIR")
    tables = [load_table(path) for path in sorted(data.glob("*.toml"))]
    return sorted(tables, key=lambda table: SETS.index(table.source.set))


def error_summary(rows: Sequence[Published]) -> tuple[float, float, float]:
    """The rows' mean absolute error, mean signed error and worst error, in points."""
    errors = [row.error_points for row in rows]
    return sum(map(abs, errors)) / len(errors), sum(errors) / len(errors), max(errors, key=abs)


def summary_markdown(tables: Sequence[Table], searched: bool = True) -> str:
    """One line a table: its rows' errors and, with `searched`, the search's agreement."""
    lines = [
        "| set | table | system | rows | mean absolute error | mean signed error | worst | search agrees |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for table in tables:
        mean_abs, mean, worst = error_summary(table.rows)
        agrees = str(sum(row.search_agrees() for row in table.rows)) if searched else "-"
        lines.append(
            f"| {table.source.set} | {table.source.name} | {table.system} | {len(table.rows)} | "
            f"{mean_abs:.1f} | {mean:+.1f} | {worst:+.1f} | {agrees} |"
        )
    return "\n".join(lines) + "\n"


def rows_markdown(table: Table) -> str:
    """Every row of one table: published and predicted step time and MFU, in its source's convention."""
    lines = [
        f"#### {table.source.name}",
        "",
        "| run | published step (s) | predicted step (s) | published MFU | predicted MFU | error (points) |",
        "|---|---|---|---|---|---|",
    ]
    for row in table.rows:
        lines.append(
            f"| {row.label} | {row.step_s:.2f} | {row.predicted.step_s:.2f} | {100 * row.mfu:.1f}% | "
            f"{100 * row.predicted_mfu:.1f}% | {row.error_points:+.1f} |"
        )
    return "\n".join(lines) + "\n"


def render_markdown(
    tables: Sequence[Table], row_sets: Sequence[str] = SETS[:2], searched: bool = True
) -> str:
    """The summary of every table, then the rows of the tables in `row_sets` (docs/planning.md)."""
    parts = [summary_markdown(tables, searched)]
    parts += [rows_markdown(table) for table in tables if table.source.set in row_sets]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megascale.plan.validation", description=__doc__)
    parser.add_argument(
        "--data", type=Path, default=DATA, help=f"Folder of published tables (default {DATA})."
    )
    parser.add_argument(
        "--rows",
        nargs="*",
        choices=SETS,
        default=list(SETS[:2]),
        help="Sets whose tables are printed row by row after the summary (default: paper validation).",
    )
    parser.add_argument("--table", help="Only the tables whose name or file contains this text.")
    parser.add_argument(
        "--no-search", action="store_true", help="Leave out the search's agreement (the slow part)."
    )
    args = parser.parse_args(argv)
    tables = load_tables(args.data)
    if args.table:
        tables = [t for t in tables if args.table in t.source.name or args.table in t.source.file]
    sys.stdout.write(render_markdown(tables, args.rows, searched=not args.no_search))
    return 0


if __name__ == "__main__":
    sys.exit(main())
