"""Training stall of a two-stage checkpoint against a synchronous DCP save of the same state, side by side.

One process holds a model of `--gib` GiB of float32 weights. Rounds alternate (sync, two-stage, sync, ...)
so machine noise hits both alike:
- sync: `torch.distributed.checkpoint.save` straight to the run's disk directory (fsync'd, as many
  writer threads as stage 1 uses), then the
  manifest commit; training would wait for all of it (`checkpoint.async_save = false`);
- two-stage: megascale's `Checkpointer.save` — the training stall is stage 1 (DCP into host memory,
  tmpfs); stage 2 (copy to disk with CRC-32s, commit) runs in the background and is timed apart.
Also times verifying and loading the newest checkpoint. Prints one `name value` line per figure and
writes them, with the machine, as JSON. Not yet measured here: time from a failure to the first step
after recovery (see docs/resilience.md, measured by tests/resilience) and bytes read with a broadcast.

    python bench/checkpoint.py --gib 1 --rounds 3 --out bench/results/checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from megascale.checkpoint.checkpointer import Checkpointer, load_checkpoint, write_threads
from megascale.checkpoint.manifest import commit, verify
from megascale.checkpoint.stateful import ModelState


def big_model(gib: float) -> nn.Module:
    """Square float32 linears, 4096 x 4096 (64 MiB) each, adding up to `gib` GiB."""
    layers = max(1, round(gib * 1024 / 64))
    return nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(layers)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="State size in GiB (float32 weights).")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of each kind, alternating.")
    parser.add_argument(
        "--dir", type=Path, default=None, help="Disk directory for checkpoints (default: temp)."
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/checkpoint.json"))
    args = parser.parse_args()

    model = big_model(args.gib)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state = {"model": ModelState(model)}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        sync_root, staged_root = Path(root) / "sync", Path(root) / "two-stage"
        saver = Checkpointer(str(staged_root), keep=2, async_save=True)
        sync_s, stall_s, stage2_s = [], [], []
        for round_index in range(args.rounds):
            location = sync_root / f"step-{round_index:08d}"
            started = time.perf_counter()
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(str(location), thread_count=write_threads()),
                no_dist=True,
            )
            commit(str(location), {"step": round_index})
            sync_s.append(time.perf_counter() - started)

            started = time.perf_counter()
            newest = saver.save(round_index, state, {})
            stall_s.append(time.perf_counter() - started)
            saver.wait()
            stage2_s.append(time.perf_counter() - started - stall_s[-1])
        started = time.perf_counter()
        problem = verify(newest)
        verify_s = time.perf_counter() - started
        assert problem is None, problem
        started = time.perf_counter()
        load_checkpoint(newest, {"model": ModelState(big_model(args.gib))})
        load_s = time.perf_counter() - started

    figures = {
        "state_gib": state_bytes / 2**30,
        "sync_save_s": statistics.median(sync_s),
        "stage1_stall_s": statistics.median(stall_s),
        "stall_ratio": statistics.median(stall_s) / statistics.median(sync_s),
        "stage2_background_s": statistics.median(stage2_s),
        "verify_s": verify_s,
        "load_s": load_s,
    }
    for name, value in figures.items():
        print(f"{name} {value:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "rounds": {"sync_save_s": sync_s, "stage1_stall_s": stall_s, "stage2_background_s": stage2_s},
        **figures,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
