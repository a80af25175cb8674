"""The config-space parity matrix: each combination of a covering set of knob values
(tests/parallel/config_space.py) trains under its layout and is compared with one process on the same tokens;
each combination megascale cannot support must be refused by its validation, before any process exists.

A combination runs 10 steps on its own processes (forked from this one, as tests/parallel/multiprocess.py
does), saving checkpoints at steps 5 and 10 and validating at step 10. It matches when, against one process
training the same model with the same sequences per step (one micro-batch, no parallelism, no overlap, no
activation checkpointing, no compilation), every step's loss is within the tolerance, every step's
gradient norm within it relatively, and its validation loss within it. After the first combination
of each layout (pipeline, data-parallel and tensor-parallel degrees), and after its first one with a
Llama model:
- its step-5 checkpoint, resumed on one process, trains steps 6-10 within the tolerance of the reference;
- its step-10 checkpoint exported to Hugging Face (`megascale convert --to hf`) gives the logits of the same
  checkpoint loaded into one megascale process, within 1e-5, in transformers' LlamaForCausalLM (or
  MixtralForCausalLM); a model with no Llama or Mixtral equivalent must be refused by the export instead,
  naming the field.

    python -m tests.parallel.parity_matrix                # every pair of knob values (CI runs this set)
    python -m tests.parallel.parity_matrix --strength 3   # every triple: the full matrix, before a release

Each writes a Markdown table (docs/parity/) and the same results as JSON beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import shutil
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch._inductor.compile_fx  # noqa: F401 (imported before the ranks are forked: no rank imports them
import transformers  # again, which costs seconds each)

from megascale.checkpoint.checkpointer import load_model_weights
from megascale.config import JobConfig, load_config
from megascale.convert import export_hf, resolve_checkpoint
from megascale.errors import ConfigError
from megascale.models.llama import Transformer
from megascale.observe.metrics import read_metrics
from megascale.parallel.dims import ParallelDims
from megascale.trainer import Trainer
from tests.parallel import config_space
from tests.parallel.config_space import Row
from tests.parallel.covering import Covering, activatable, covering_rows
from tests.parallel.multiprocess import run_ranks

STEPS, SAVE_AT, GLOBAL_BATCH = 10, 5, 8
EXPORT_ATOL = 1e-5
# 8 sequences per step, so that a step is whole micro-batches on up to 4 data-parallel ranks; 6
# validation sequences at the last step, which no layout of 4 data-parallel ranks divides evenly. Two
# layers (`layers`).
BASE = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.attention.n_heads=4",
    "--model.max_seq_len=32",
    "--data.seq_len=32",
    "--data.val_fraction=0.1",
    f"--training.global_batch_size={GLOBAL_BATCH}",
    f"--training.micro_batch_size={GLOBAL_BATCH}",  # the reference's: one micro-batch (rows set their own)
    "--parallel.overlap.tp_chunks=2",  # the fewest: tensor parallelism's small collectives cost most here
    f"--training.steps={STEPS}",
    f"--training.val_every={STEPS}",
    "--training.val_sequences=6",
    "--training.log_every=1",
    "--training.peak_tflops=0.1",
    "--optim.warmup_steps=2",
    f"--checkpoint.every={SAVE_AT}",
    "--checkpoint.keep=3",
    "--metrics.progress=false",
    "--metrics.tensorboard=false",
    "--training.threads=1",  # processes share the cores: one thread each
]
# For the one-process runs, which only need their losses: no checkpoints written, no timeline recorded.
QUIET = ("--checkpoint.enabled=false", "--metrics.timeline=false")
# The knobs that say *which* model is trained; every other knob only says how, and the reference leaves it
# at its default (one process, one micro-batch of the whole step).
MODEL_KNOBS = ("model.", "optim.", "training.dtype", "training.fp8")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    loss: float  # absolute, on every step's loss and on the validation losses
    grad_norm: float  # relative, on every step's gradient norm


# float32: a few ulps at a loss of about 5, after 10 steps. bfloat16 autocast: its 8-bit mantissa rounds
# each matmul's output, and layouts that split a sum differently (TP, the TP overlap's chunks, accumulated
# micro-batches) round differently; the bound is an order above the largest difference seen in the matrix.
# float8_e4m3fn (the expert-parallel payload): 3 mantissa bits per token slot's value; the stored pair set's
# 14 uncompiled ep rows with an fp8 payload differed by up to 1.4e-3 in loss and validation loss and 2.7e-3
# in gradient norm, and the bound is 7 and 11 times that. The same bound holds float8 linear layers
# (training.fp8): their tensorwise scales are the maxima over a micro-batch, which a layout splits
# otherwise than its one-micro-batch reference; float32 rows differed by up to 1.4e-3 in loss and 9.5e-3
# in gradient norm (rowwise scales are per token, and those rows differ as the compute precision does).
TOLERANCES = {
    "float32": Tolerance(1e-4, 1e-4),
    "bfloat16": Tolerance(5e-3, 1e-1),
    "float8_e4m3fn": Tolerance(1e-2, 3e-2),
}
# A routed model in a precision other than float32: rounding that a layout splits otherwise (TP's and EP's
# partial sums) can tip a token at a near-tie of its router to another expert, a discrete change of that
# token's loss, a step's mean moving by it over the step's tokens. The every-triple set's bfloat16 MoE rows
# with one expert a token differed by at most 6.1e-4 in loss but for two such jumps, 4.6e-3 and 1.2e-2 (the
# larger's row matches to 4.8e-7 in float32); the loss bound of such a row is twice the larger jump.
ROUTED_LOSS = 2.5e-2
# One process in float32, whatever its micro-batches: the step is the same sums in another order, a few
# ulps of a loss of about 5 (1e-6 relative) and of the gradient norm.
ONE_PROCESS_FLOAT32 = Tolerance(5e-6, 1e-6)

# The micro-batch alone, in one process: the step's 8 sequences in 1 or 2 (against the reference's 8) a
# micro-batch, in every precision, of a dense model and of an MoE model with a capacity (whose drops are
# per sequence), each against one micro-batch of the whole step. Tensorwise float8 scales each
# micro-batch's activations and output gradients by that micro-batch's maximum, so its rows differ by the
# rounding of other scales, within the float8 bound.
MICRO_BATCH_SIZES = (1, 2)
MICRO_BATCH_PRECISIONS = (
    {"training.dtype": "float32"},
    {"training.dtype": "bfloat16"},
    {"training.dtype": "bfloat16", "training.fp8": "tensorwise"},
    {"training.dtype": "bfloat16", "training.fp8": "rowwise"},
)
MICRO_BATCH_MODELS = ({}, {"model.moe.experts": 4, "model.moe.capacity_factor": 1.0})


def micro_batch_rows() -> list[Row]:
    """The one-process rows of micro-batch sizes x precisions x models (above)."""
    return [
        config_space.default_row() | precision | model | {"training.micro_batch_size": size}
        for precision in MICRO_BATCH_PRECISIONS
        for model in MICRO_BATCH_MODELS
        for size in MICRO_BATCH_SIZES
    ]


def layers(row: Row) -> int:
    """The model's depth for `row`: 2 layers, the least every layout needs, or one a pipeline stage when
    there are more stages (tensor parallelism's collectives, per layer, are most of a row's time); with
    activation offload one more, so that a stage holds a block that offloads (the last one keeps its
    tensors) and one ahead of it fetched."""
    stages = row["parallel.pp"] * row["parallel.pp_virtual_stages"]
    return max(3, stages + 1) if row["parallel.activation_offload"] else max(2, stages)


def arguments(row: Row, depth: int | None = None) -> list[str]:
    """`row` as --key=value overrides (an unset value as an empty one), and the model's depth: its own, or
    `depth` (a reference takes its row's)."""
    flags = [f"--{key}={'' if value is None else value}" for key, value in row.items()]
    return [*flags, f"--model.n_layers={depth or layers(row)}"]


def reference_row(row: Row) -> Row:
    """The one-process job `row` is compared with: its model knobs, every other knob at its default but
    the micro-batch, which is the whole step."""
    reference = config_space.default_row()
    reference.update({key: value for key, value in row.items() if key.startswith(MODEL_KNOBS)})
    reference["training.micro_batch_size"] = GLOBAL_BATCH
    return reference


@functools.cache
def _base_config() -> JobConfig:
    return load_config(None, BASE)


def _config_of(row: Row) -> JobConfig:
    """`BASE` with `row`'s values and depth, unchecked. One object, reused: every row sets every knob."""
    cfg = _base_config()
    for key, value in row.items():
        *path, name = key.split(".")
        setattr(functools.reduce(getattr, path, cfg), name, value)
    cfg.model.n_layers = layers(row)
    return cfg


def refusal(row: Row) -> str | None:
    """megascale's verdict on `row` before any process exists: None, or its one-line refusal (what
    `load_config` and the launcher's layout check say of `BASE` with `row`'s values)."""
    try:
        cfg = _config_of(row)
        cfg.check_rules()  # the knobs' values are in their fields' ranges (tests/test_config_space.py)
        ParallelDims.from_config(cfg, world_size=config_space.world_size(row))
    except ConfigError as err:
        return str(err)
    return None


def estimated_cost(row: Row) -> float:
    """Roughly the seconds a combination takes in the suite here (2 cores), fitted by least squares to the
    every-pair set's rows as the suite ran them: a fixed part, a part per process (starting it, its share
    of the cores), one per process, layer and forward-backward pass where tensor parallelism's many small
    collectives make each pass costly, and torch.compile's compilation in each process."""
    data_parallel = row["parallel.dp_replicate"] * row["parallel.dp_shard"]
    passes = max(1, GLOBAL_BATCH // data_parallel // row["training.micro_batch_size"])
    processes = config_space.world_size(row)
    tensor_parallel = 0.45 * processes * passes * layers(row) / 2 if row["parallel.tp"] > 1 else 0.0
    compiling = 3.7 * processes if row["training.compile"] else 0.0
    return 1 + 0.8 * processes + tensor_parallel + compiling


def layout(row: Row) -> tuple[int, ...]:
    return tuple(row[f"parallel.{name}"] for name in ("dp_replicate", "dp_shard", "tp", "pp", "ep"))


# The model knobs' values of a Hugging Face Llama, and with MoE layers those of a Mixtral (with QK-norm: of
# a Qwen3-MoE, which may keep dense first layers and unnormalised weights): the rows `megascale convert
# --to hf` must export (and every other must be refused by it; `compare` checks both).
LLAMA = {
    "model.block": "serial",
    "model.norm": "rmsnorm",
    "model.mlp": "swiglu",
    "model.position": "rope",
    "model.attention.window": None,
}
MIXTRAL = {
    "model.moe.score": "softmax",
    "model.moe.normalize_weights": True,
    "model.moe.shared_experts": 0,
    "model.moe.dense_layers": 0,
    "model.moe.bias_update_rate": 0.0,
    "model.moe.capacity_factor": None,
}


QWEN3_MOE = {
    key: value
    for key, value in MIXTRAL.items()
    if key not in ("model.moe.normalize_weights", "model.moe.dense_layers")
}


def exportable(row: Row) -> bool:
    moe = (QWEN3_MOE if row["model.attention.qk_norm"] else MIXTRAL) if row["model.moe.experts"] else {}
    return all(row[key] == value for key, value in {**LLAMA, **moe}.items())


def export_bonus(row: Row, taken: list[Row]) -> float:
    """Worth ten more pairs to the covering set: a Llama model in a layout no Llama row has yet, so that
    the export is checked after a run of every layout the set holds (rows are tried as Llamas too)."""
    exported = {layout(other) for other in taken if exportable(other)}
    return 10.0 if exportable(row) and layout(row) not in exported else 0.0


# The every-pair set the suite runs, generated once (`--new-set`) from many seeds, kept while it still
# covers today's knobs: generating one as cheap takes minutes.
STORED_PAIRS = Path(__file__).with_name("pairs_set.json")


@functools.cache
def covering(strength: int) -> Covering:
    """The covering set the matrix runs, a one-process row among it: for pairs the stored one while it
    covers today's knobs, else (and for triples) the cheapest of three greedy constructions."""
    stored = stored_pairs() if strength == 2 else None
    return stored or cheapest_covering(strength, seeds=3)


def cheapest_covering(strength: int, seeds: int) -> Covering:
    """The cheapest (`estimated_cost`) of `seeds` greedy constructions."""
    covers = [_covering(strength, seed) for seed in range(seeds)]
    return min(covers, key=lambda cover: sum(estimated_cost(row) for row in cover.accepted))


# One process is a layout too: gradient accumulation, activation checkpointing and tied weights, on it.
ONE_PROCESS = {
    "training.micro_batch_size": 2,
    "parallel.activation_checkpoint": "selective",
    "model.tie_embeddings": True,
}


def _covering(strength: int, seed: int) -> Covering:
    return covering_rows(
        refusal,
        strength=strength,
        required=(ONE_PROCESS,),
        cost=estimated_cost,
        bonus=export_bonus,
        variant=lambda row: LLAMA,
        seed=seed,
    )


def stored_pairs() -> Covering | None:
    """The set in STORED_PAIRS if it is still an every-pair set of today's knobs: each row sets every knob
    to one of its values and megascale accepts it, each refused row is refused with the same line, every
    pair of values that can be active together is held by a row or refused, and a row is of one process;
    else None."""
    if not STORED_PAIRS.is_file():
        return None
    stored = json.loads(STORED_PAIRS.read_text())
    values = {knob.key: knob.values for knob in config_space.KNOBS}

    def known(row: Row) -> bool:
        return row.keys() == values.keys() and all(row[key] in values[key] for key in row)

    accepted = stored["accepted"]
    refused = [(tuple(map(tuple, pair)), row, reason) for pair, row, reason in stored["refused"]]
    if not all(known(row) and refusal(row) is None for row in accepted):
        return None
    if not all(known(row) and refusal(row) == reason for _, row, reason in refused):
        return None
    held = {pair for pair, _, _ in refused}.union(*(config_space.tuples_of(row, 2) for row in accepted))
    one_process = any(config_space.world_size(row) == 1 for row in accepted)
    return Covering(accepted, refused, [], 2) if activatable(2) <= held and one_process else None


def store_pairs(cover: Covering) -> None:
    stored = {"accepted": cover.accepted, "refused": cover.refused}
    STORED_PAIRS.write_text(json.dumps(stored, indent=1) + "\n")


def describe(row: Row) -> str:
    """The knobs of `row` that are active and not at their default, as flags without the dashes."""
    defaults = config_space.default_row()
    changed = [f"{key}={value}" for key, value in config_space.active_values(row) if value != defaults[key]]
    return " ".join(changed) or "(all defaults)"


# -- what the processes run --------------------------------------------------------------------------------
def train(rank: int, world_size: int, args: list[str]) -> list[dict[str, Any]] | None:
    """Train the job of `args` to the end; rank 0 returns its metrics records."""
    cfg = load_config(None, args)
    Trainer(cfg).train()
    return read_metrics(cfg.training.run_dir) if rank == 0 else None


def resume_and_export(
    rank: int, world_size: int, args: list[str], saved: Path, work: Path, save_at: int = SAVE_AT
) -> dict[str, Any]:
    """On one process: resume the step-`save_at` checkpoint of `saved` to the end (the records of the steps
    it took), and export the newest checkpoint to Hugging Face (the largest logit difference, or the
    export's refusal)."""

    resumed_dir = work / "resumed"
    checkpoint = saved / "checkpoints" / f"step-{save_at:08d}"
    shutil.copytree(checkpoint, resumed_dir / "checkpoints" / checkpoint.name)
    cfg = load_config(None, [*args, *QUIET, f"--training.run_dir={resumed_dir}"])
    Trainer(cfg).train()
    outcome: dict[str, Any] = {"resumed": read_metrics(resumed_dir)}

    try:
        export_hf(saved, work / "hf")
    except ConfigError as err:
        outcome["export"] = str(err)
        return outcome
    newest = resolve_checkpoint(saved)
    model = Transformer(cfg.model)
    load_model_weights(newest, model)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(work / "hf", attn_implementation="eager")
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, cfg.data.seq_len), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), hf_model.eval()(tokens).logits
    outcome["export"] = float((ours - theirs).abs().max())
    return outcome


# -- comparing ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    row: Row
    processes: int
    status: str  # "matched", "MISMATCH", "CRASH" or "refused"
    loss: float = math.nan  # largest |loss - reference| over the steps
    grad_norm: float = math.nan  # largest |grad norm / reference - 1|
    val_loss: float = math.nan  # largest |validation loss - reference|
    resumed: float = math.nan  # largest |loss - reference| over the steps resumed on one process
    export: float | str = math.nan  # largest |logit difference| of the export, or its refusal
    dropped: float = math.nan  # with an MoE capacity: largest |dropped share - reference| over the steps
    seconds: float = 0.0
    message: str = ""  # the refusal, the crash, or what did not match


def _by_step(records: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {record["step"]: float(record[key]) for record in records if key in record}


def _largest(got: dict[int, float], want: dict[int, float], relative: bool = False) -> float:
    if sorted(got) != sorted(want):
        return math.inf
    deltas = [abs(got[s] / want[s] - 1) if relative else abs(got[s] - want[s]) for s in want]
    return max(deltas, default=0.0)


def compare(
    row: Row, got: list[dict], reference: list[dict], after: dict[str, Any] | None, save_at: int = SAVE_AT
) -> Result:
    """`row`'s run against its reference, and (`after`, when it was made) its step-`save_at` checkpoint
    resumed on one process and exported."""
    # The step's precisions (compute, the expert-parallel all-to-all's payload): the loosest bound of each.
    precisions = {
        row["training.dtype"],
        row["parallel.ep_comm_dtype"] if config_space.experts_split(row) else "float32",
        "float8_e4m3fn" if row["training.fp8"] != "none" else "float32",
    }
    bounds = [TOLERANCES[precision] for precision in precisions]
    tolerance = Tolerance(max(t.loss for t in bounds), max(t.grad_norm for t in bounds))
    if row["model.moe.experts"] and precisions != {"float32"}:
        tolerance = Tolerance(max(tolerance.loss, ROUTED_LOSS), tolerance.grad_norm)
    if precisions == {"float32"} and config_space.world_size(row) == 1:
        tolerance = ONE_PROCESS_FLOAT32
    result = Result(row, config_space.world_size(row), "matched")
    result.loss = _largest(_by_step(got, "loss"), _by_step(reference, "loss"))
    result.grad_norm = _largest(_by_step(got, "grad_norm"), _by_step(reference, "grad_norm"), relative=True)
    result.val_loss = _largest(_by_step(got, "val_loss"), _by_step(reference, "val_loss"))
    checks = [
        ("loss", result.loss, tolerance.loss),
        ("grad norm", result.grad_norm, tolerance.grad_norm),
        ("val loss", result.val_loss, tolerance.loss),
    ]
    failures = []
    if row["model.moe.experts"] and row["model.moe.capacity_factor"] is not None:
        result.dropped = _largest(
            _by_step(got, "moe_dropped_fraction"), _by_step(reference, "moe_dropped_fraction")
        )
        # The capacity is per sequence, so the same tokens are dropped in every layout; rounding other
        # than float32's can move a token at a near-tie of the router across the line.
        if precisions == {"float32"} and result.dropped != 0:
            failures.append(f"dropped share differs by {result.dropped:.2e}")
    if after is not None:
        later = {step: loss for step, loss in _by_step(reference, "loss").items() if step > save_at}
        result.resumed = _largest(_by_step(after["resumed"], "loss"), later)
        checks.append(("resumed loss", result.resumed, tolerance.loss))
        result.export = after["export"]
        if isinstance(result.export, float) and not result.export <= EXPORT_ATOL:
            failures.append(f"export logits {result.export:.2e} > {EXPORT_ATOL:.0e}")
        if isinstance(result.export, str) and exportable(row):
            failures.append(f"the export of a Llama model was refused: {result.export}")
        if isinstance(result.export, float) and not exportable(row):
            failures.append("a model with no Llama equivalent was exported")
        if isinstance(result.export, str) and "model." not in result.export:
            failures.append(f"export refused without naming a model field: {result.export}")
    failures += [f"{name} {value:.2e} > {bound:.0e}" for name, value, bound in checks if not value <= bound]
    if failures:
        result.status, result.message = "MISMATCH", "; ".join(failures)
    return result


class Matrix:
    """Runs rows against one-process references, each reference trained once per model, for `steps` steps
    (a checkpoint halfway). A layout's first row is also resumed on one process and exported, and so is
    its first Llama row."""

    def __init__(self, corpus: Path, work: Path, steps: int = STEPS):
        self.corpus, self.work = corpus, work
        self.steps, self.save_at = steps, steps // 2
        self.references: dict[tuple, list[dict]] = {}
        self.resumed: set[tuple] = set()  # layouts whose checkpoint was resumed on one process
        self.exported: set[tuple] = set()  # layouts whose Llama checkpoint was exported

    def job(self, run_dir: Path, row: Row, depth: int, *extra: str) -> list[str]:
        return [
            *BASE,
            *arguments(row, depth),
            f"--data.source={self.corpus}",
            f"--data.cache_dir={self.work / 'data'}",
            f"--training.run_dir={run_dir}",
            f"--training.steps={self.steps}",
            f"--training.val_every={self.steps}",
            f"--checkpoint.every={self.save_at}",
            *extra,
        ]

    def reference(self, row: Row) -> list[dict]:
        reference, depth = reference_row(row), layers(row)
        key = (*reference.items(), depth)
        if key not in self.references:
            run_dir = self.work / f"reference-{len(self.references)}"
            args = self.job(run_dir, reference, depth, *QUIET)
            self.references[key] = run_ranks(train, 1, args, timeout_s=300)[0]
        return self.references[key]

    def run(self, index: int, row: Row) -> Result:
        started = time.perf_counter()
        processes, place = config_space.world_size(row), layout(row)
        try:
            reference = self.reference(row)
            run_dir = self.work / f"row-{index}"
            got = run_ranks(train, processes, self.job(run_dir, row, layers(row)), timeout_s=500)[0]
            after = None
            if place not in self.resumed or (exportable(row) and place not in self.exported):
                one_process = self.job(run_dir, reference_row(row), layers(row))
                work = self.work / f"after-{index}"
                after = run_ranks(
                    resume_and_export, 1, one_process, run_dir, work, self.save_at, timeout_s=300
                )[0]
                self.resumed.add(place)
                self.exported |= {place} if exportable(row) else set()
            result = compare(row, got, reference, after, self.save_at)
        except AssertionError as err:  # a rank failed or hung: run_ranks says which, with its traceback
            result = Result(row, processes, "CRASH", message=_last_error(str(err)))
        result.seconds = time.perf_counter() - started
        return result


def _last_error(report: str) -> str:
    lines = [line for line in report.strip().splitlines() if line.strip()]
    return lines[-1] if lines else report


def refused_results(cover: Covering) -> list[Result]:
    return [
        Result(row, config_space.world_size(row), "refused", message=why) for _, row, why in cover.refused
    ]


# -- the table ------------------------------------------------------------------------------------------
def _figure(value: float | str) -> str:
    if isinstance(value, str):
        return "refused"
    return "-" if math.isnan(value) else f"{value:.1e}"


COLUMNS = ("#", "processes", "knobs (active, not default)", "result", "loss", "grad norm", "val loss")
COLUMNS += ("resumed", "export", "s")


def render(results: list[Result], cover: Covering, command: str, micro: Sequence[Result] = ()) -> str:
    """The Markdown table of a matrix run: what was compared, then every combination and every refusal."""
    ran = [r for r in results if r.status != "refused"]
    count = {status: sum(r.status == status for r in results) for status in ("matched", "MISMATCH", "CRASH")}
    bounds = "; ".join(
        f"{dtype}: {t.loss:.0e} on losses, {t.grad_norm:.0e} relative on the gradient norm"
        for dtype, t in TOLERANCES.items()
    )
    preamble = (
        f"Made by `{command}` (tests/parallel/parity_matrix.py) from the knobs and values of "
        "`tests/parallel/config_space.py`. Each accepted combination trained 10 steps under its layout and "
        "was "
        "compared with one process training the same model on the same sequences. Columns: the largest "
        "|loss delta| over the steps; the largest relative gradient-norm delta; the largest |validation "
        "loss delta| (step 10); the largest |loss delta| of its step-5 checkpoint resumed on one "
        "process (steps 6-10); the largest |logit delta| of its step-10 checkpoint exported to Hugging Face "
        "against the same checkpoint on one process (`refused`: the model has no Llama equivalent, and "
        f"the export said so, naming the field). Bounds: {bounds}; the export {EXPORT_ATOL:.0e}. With an "
        "MoE capacity, each step's share of dropped token slots must equal one process's in float32 "
        f"(`dropped` in pairs.json). An MoE model outside float32: {ROUTED_LOSS:.1e} on losses (a token at "
        "a near-tie of its router may take another expert where a layout rounds otherwise). "
        f"{len(ran)} combinations ran: {count['matched']} matched, {count['MISMATCH']} mismatched, "
        f"{count['CRASH']} crashed; {len(results) - len(ran)} were refused by validation. They took "
        f"{sum(r.seconds for r in ran) / 60:.0f} minutes on a 2-core CPU (gloo, torch 2.13.0+cpu)."
    )
    if len(ran) < len(cover.accepted):
        preamble += f" Incomplete: {len(cover.accepted) - len(ran)} combinations of the set have not run yet."
    title = f"# Parity matrix: every {'pair' if cover.strength == 2 else 'triple'} of knob values"
    lines = [title, "", textwrap.fill(preamble, 110), ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|---:|---:|---|---|" + "---:|" * 6]
    for index, r in enumerate(ran):
        status = r.status if r.status == "matched" else f"**{r.status}**: {r.message}"
        figures = [_figure(value) for value in (r.loss, r.grad_norm, r.val_loss, r.resumed, r.export)]
        cells = [str(index), str(r.processes), f"`{describe(r.row)}`", status, *figures, f"{r.seconds:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if micro:
        lines += ["", "## The micro-batch alone", ""]
        text = (
            "One process, the step's 8 sequences in micro-batches of 1 or 2, against one micro-batch of 8, "
            f"in each precision, dense and MoE with a capacity. Bounds as above; float32 in one process: "
            f"{ONE_PROCESS_FLOAT32.loss:.0e} on losses, {ONE_PROCESS_FLOAT32.grad_norm:.0e} relative on "
            "the gradient norm."
        )
        lines += [textwrap.fill(text, 110), ""]
        lines += ["| combination | status | loss | grad norm | val loss |", "|---|---|---:|---:|---:|"]
        for r in micro:
            status = r.status if r.status == "matched" else f"**{r.status}**: {r.message}"
            figures = [_figure(value) for value in (r.loss, r.grad_norm, r.val_loss)]
            lines.append(f"| `{describe(r.row)}` | {status} | " + " | ".join(figures) + " |")
    refused = [r for r in results if r.status == "refused"]
    lines += ["", "## Refused", ""]
    if cover.strength == 2:
        lines += ["| combination | processes | megascale's refusal |", "|---|---:|---|"]
        lines += [f"| `{describe(r.row)}` | {r.processes} | {r.message} |" for r in refused]
    else:  # thousands: each refusal once, with how many combinations drew it and the first of them
        lines += ["| megascale's refusal | combinations | the first |", "|---|---:|---|"]
        by_message: dict[str, list[Result]] = {}
        for r in refused:
            by_message.setdefault(r.message, []).append(r)
        for message, drew in sorted(by_message.items()):
            lines.append(f"| {message} | {len(drew)} | `{describe(drew[0].row)}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strength", type=int, default=2, choices=(2, 3), help="pairs (2) or triples (3)")
    parser.add_argument("--out", type=Path, help="the Markdown table (default docs/parity/strength-N.md)")
    parser.add_argument(
        "--new-set",
        action="store_true",
        help=f"generate the every-pair set anew (the cheapest of 30 constructions), store it in "
        f"{STORED_PAIRS.name} for the suite, and run it",
    )
    args = parser.parse_args(argv)
    if args.new_set:
        store_pairs(cheapest_covering(2, seeds=30))
        covering.cache_clear()
    out = args.out or Path("docs/parity") / f"{'pairs' if args.strength == 2 else 'triples'}.md"
    cover = covering(args.strength)
    print(f"{len(cover.accepted)} combinations to run, {len(cover.refused)} refused", flush=True)
    results = refused_results(cover)
    command = "python -m tests.parallel.parity_matrix" + (" --strength 3" if args.strength == 3 else "")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = _corpus(work / "corpus")
        matrix = Matrix(corpus, work)
        for index, row in enumerate(cover.accepted):
            result = matrix.run(index, row)
            results.append(result)
            print(
                f"{index:3d} {result.status:8s} {result.seconds:5.0f}s {describe(row)} {result.message}",
                flush=True,
            )
            _write(out, results, cover, command)  # after each: an interrupted run keeps what it ran
        micro = []
        for index, row in enumerate(micro_batch_rows() if args.strength == 2 else [], start=len(results)):
            micro.append(matrix.run(index, row))
            print(f"micro-batch {micro[-1].status:8s} {describe(row)} {micro[-1].message}", flush=True)
        _write(out, results, cover, command, micro)
        results += micro
    print(f"wrote {out}")
    return 0 if all(r.status in ("matched", "refused") for r in results) else 1


def _write(
    out: Path, results: list[Result], cover: Covering, command: str, micro: Sequence[Result] = ()
) -> None:
    """The table, and the results as JSON: for triples only the combinations that ran (their refusals,
    thousands, are in the table, each once)."""
    out.write_text(render(results, cover, command, micro))
    kept = [r for r in [*results, *micro] if cover.strength == 2 or r.status != "refused"]
    records = [{**dataclasses.asdict(r), "export": r.export} for r in kept]
    out.with_suffix(".json").write_text(json.dumps(records, indent=1, default=str))


def _corpus(root: Path) -> Path:
    from tests.conftest import write_tiny_corpus

    return write_tiny_corpus(root)


if __name__ == "__main__":
    sys.exit(main())
