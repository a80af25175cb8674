"""An MoE model's training step at tp 2 with parallel.moe_tp = "whole" against "ep", side by side in one
run: what a tp rank saves when it no longer repeats its peer's MoE work.

"whole" computes every MoE layer on both tp ranks over the whole sequence (the same routing and expert
GEMMs twice); "ep" makes the tp ranks expert-parallel ranks for the MoE layers (MegaScale-MoE): each routes
its own half of the sequence and holds half of the experts, token slots exchanged by all-to-all. Wall time
is no measure on a shared 2-core machine, so the figure is each rank's process CPU time (all its threads,
gloo's included) per step over the steps after warm-up, one torch thread per rank. A step is
`forward_backward` over the global batch's micro-batches; no optimizer (its work is the same in both
layouts). The MoE layers' own CPU time is taken by module hooks around their forward and backward (about:
"whole"'s input all-gather falls outside). The layouts run in turns, whole, ep, whole, ep, ..., each job
on fresh ranks forked after `import torch`, so drift weighs on both alike; a figure is the median over the
repeats of the two ranks' mean, and `ep_over_whole` the median of each ep job over the whole job before it.
`--set KEY=VALUE` overrides the config of both (e.g. parallel.overlap.ep=false: one exchange per layer, no
chunks). Prints one `name value` line per figure and writes them as JSON.

    python bench/moe_tp.py --out bench/results/moe_tp.json   # about 1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.record, run as a script

from bench.record import save_record  # noqa: E402
from megascale.config import load_config  # noqa: E402
from megascale.models.llama import Transformer  # noqa: E402
from megascale.models.moe import MoE  # noqa: E402
from megascale.parallel.dims import ParallelDims  # noqa: E402
from megascale.parallel.parallelize import parallelize  # noqa: E402
from megascale.trainer import next_token_loss  # noqa: E402
from tests.parallel.multiprocess import run_ranks  # noqa: E402

WORLD = 2
MODEL = [
    "--model.dim=256",
    "--model.n_layers=2",
    "--model.attention.n_heads=8",
    "--model.moe.experts=8",
    "--model.moe.top_k=2",
    "--model.moe.expert_dim=512",
    "--model.max_seq_len=256",
    "--data.seq_len=256",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=4",
    "--parallel.tp=2",
]
KINDS = ("whole", "ep")


class MoeClock:
    """CPU seconds spent inside the model's MoE layers, forward and backward, by module hooks."""

    def __init__(self, model: torch.nn.Module):
        self.seconds = 0.0
        self._started: dict[int, float] = {}
        for layer in model.modules():
            if isinstance(layer, MoE):
                layer.register_forward_pre_hook(self._start)
                layer.register_forward_hook(self._stop)
                layer.register_full_backward_pre_hook(self._start)
                layer.register_full_backward_hook(self._stop)

    def _start(self, layer: torch.nn.Module, *_: Any) -> None:
        self._started[id(layer)] = time.process_time()

    def _stop(self, layer: torch.nn.Module, *_: Any) -> None:
        self.seconds += time.process_time() - self._started.pop(id(layer))


def rank_job(kind: str, extra: list[str], warmup: int, steps: int) -> dict[str, float]:
    """This rank's CPU seconds per step (and in the MoE layers) of `steps` steps after `warmup`."""
    cfg = load_config(None, [*MODEL, *extra, f"--parallel.moe_tp={kind}"])
    torch.manual_seed(0)  # the same weights on both ranks
    model = Transformer(cfg.model)
    dims = ParallelDims.from_config(cfg, WORLD)
    dims.build_mesh("cpu")
    microbatches = cfg.training.global_batch_size // cfg.training.micro_batch_size
    stepped = parallelize(model, dims, cfg.parallel, device=torch.device("cpu"), microbatches=microbatches)
    clock = MoeClock(model)
    generator = torch.Generator().manual_seed(1)  # the same batch on both tp ranks
    tokens = torch.randint(
        cfg.model.vocab_size, (cfg.training.global_batch_size, cfg.data.seq_len + 1), generator=generator
    )
    batches = [(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.split(cfg.training.micro_batch_size)]
    for step in range(warmup + steps):
        if step == warmup:
            dist.barrier()
            started, clock.seconds = time.process_time(), 0.0
        model.zero_grad(set_to_none=True)
        stepped.forward_backward(batches, next_token_loss)
    total = time.process_time() - started
    return {"cpu_s_per_step": total / steps, "moe_cpu_s_per_step": clock.seconds / steps}


def run_job(kind: str, extra: list[str], warmup: int, steps: int, timeout_s: float) -> list[dict[str, float]]:
    """`rank_job` on WORLD ranks forked from this process (tests/parallel/multiprocess.py)."""
    return run_ranks(_rank_job, WORLD, kind, extra, warmup, steps, timeout_s=timeout_s)


def _rank_job(rank: int, world: int, *args: Any) -> dict[str, float]:
    return rank_job(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "moe_tp.json")
    parser.add_argument("--repeats", type=int, default=5, help="jobs of each layout, in turns (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each job")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each job")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one job may take")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for both layouts, e.g. parallel.overlap.ep=false (repeatable)",
    )
    args = parser.parse_args()
    extra = [f"--{override}" for override in args.set]
    torch.set_num_threads(1)  # inherited by the forked ranks: one thread each, one core per rank
    gc.collect()
    per_rank: dict[str, list[list[float]]] = {
        f"{kind}_{name}": [] for kind in KINDS for name in ("cpu", "moe")
    }
    for _ in range(args.repeats):
        for kind in KINDS:
            ranks = run_job(kind, extra, args.warmup, args.steps, args.timeout)
            per_rank[f"{kind}_cpu"].append([rank["cpu_s_per_step"] for rank in ranks])
            per_rank[f"{kind}_moe"].append([rank["moe_cpu_s_per_step"] for rank in ranks])
    figures: dict[str, float] = {}
    for kind in KINDS:
        figures[f"{kind}_cpu_s_per_step"] = statistics.median(
            statistics.mean(r) for r in per_rank[f"{kind}_cpu"]
        )
        for rank in range(WORLD):
            figures[f"{kind}_rank{rank}_cpu_s_per_step"] = statistics.median(
                r[rank] for r in per_rank[f"{kind}_cpu"]
            )
        figures[f"{kind}_moe_cpu_s_per_step"] = statistics.median(
            statistics.mean(r) for r in per_rank[f"{kind}_moe"]
        )
        figures[f"{kind}_moe_share"] = (
            figures[f"{kind}_moe_cpu_s_per_step"] / figures[f"{kind}_cpu_s_per_step"]
        )
        figures[f"{kind}_rest_cpu_s_per_step"] = (
            figures[f"{kind}_cpu_s_per_step"] - figures[f"{kind}_moe_cpu_s_per_step"]
        )
    # Each ep job against the whole job just before it, then the median: drift cancels within a pair.
    for name, part in (("ep_over_whole", "cpu"), ("ep_over_whole_moe", "moe")):
        pairs = zip(per_rank[f"ep_{part}"], per_rank[f"whole_{part}"])
        figures[name] = statistics.median(statistics.mean(ep) / statistics.mean(whole) for ep, whole in pairs)
    for name, value in figures.items():
        sys.stdout.write(f"{name} {value:.4g}\n")
    setup = {
        "model": [*MODEL, *extra],
        "kinds": [f"--parallel.moe_tp={kind}" for kind in KINDS],
        "ranks": WORLD,
        "threads_per_rank": 1,
        "repeats": args.repeats,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "step": "forward_backward over the global batch, no optimizer",
        "clock": "time.process_time() of each rank's process",
        "per_repeat": per_rank,
    }
    save_record(args.out, figures, setup)


if __name__ == "__main__":
    main()
