"""Activation offload: the peak memory a training step adds, with and without it, against the planner.

For each case (the default model in float32 and bfloat16, with and without full activation checkpointing,
and 8 layers deep), two fresh processes train the same 5 steps, one with `parallel.activation_offload`,
each measuring every step's peak resident memory above what the process held when the step began (Linux's
VmHWM, reset before each step through /proc/self/clear_refs). glibc is told to map every allocation of 64
KiB or more on its own (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once and the
peak follows the live tensors. The measured saving is the difference of the median step peaks (steps 2-5);
the predicted one is `megascale plan`'s memory model for the same job and layout: its activations and
gradients at the step's peak, the activations counted as megascale's blocks save them and the peak found
among the moments of the step's one backward (`megascale.plan.memory`). The two runs' losses are
compared bit for bit, and their CPU time per step gives offload's cost. On CPU offload writes to a
spill file (the kernel's page cache), which the process's resident memory does not count. Prints one
`name value` line per figure and writes them as JSON.

    python bench/offload.py                      # about 80 seconds; writes bench/results/offload.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from megascale.observe.peak import cpu_model

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.toml"
STEPS = 5
# Case name -> overrides of the default config (16 sequences of 256 tokens in one micro-batch).
CASES = {
    "fp32": [],
    "bf16": ["--training.dtype=bfloat16"],
    "fp32_full_checkpoint": ["--parallel.activation_checkpoint=full"],
    "fp32_8_layers": ["--model.n_layers=8"],
}
COMMON = [
    "--training.compile=false",  # eager, as the memory model counts what autograd saves block by block
    "--training.global_batch_size=16",
    "--training.micro_batch_size=16",
    "--training.val_every=1000",
    "--training.threads=2",
    "--checkpoint.enabled=false",
    "--checkpoint.resume=false",
    "--metrics.progress=false",
    "--metrics.tensorboard=false",
    "--metrics.jsonl=false",
]


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_one(overrides: list[str]) -> dict[str, Any]:
    """In this process: train STEPS steps; each step's peak resident bytes above its start, loss, CPU s."""
    from megascale.config import load_config
    from megascale.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="megascale-bench-") as run_dir:
        trainer = Trainer(load_config(CONFIG, [f"--training.run_dir={run_dir}", *COMMON, *overrides]))
        peaks, losses, cpu_s = [], [], []
        try:
            for _ in range(STEPS):
                held = _status_bytes("VmRSS")
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
                started = time.process_time()
                metrics = trainer.train_step()
                cpu_s.append(time.process_time() - started)
                peaks.append(_status_bytes("VmHWM") - held)
                losses.append(metrics.loss)
        finally:
            trainer.close()
    return {"peak_bytes": peaks, "losses": losses, "cpu_s": cpu_s}


def run_case(overrides: list[str]) -> dict[str, Any]:
    """measure_one in a fresh process (a clean allocator and resident set)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    command = [sys.executable, __file__, "--one", json.dumps(overrides)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    if result.returncode:
        raise SystemExit(f"{' '.join(overrides)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def predicted_bytes(overrides: list[str], offload: bool) -> float:
    """The planner's activations and gradients at the step's peak, on this CPU (no block fetched ahead):
    what a step adds to what it starts with (the step's single micro-batch makes its gradients in its
    backward, `megascale.plan.memory.backward_moments`)."""
    from megascale.config import load_config
    from megascale.plan.job import job_from_config, layout_from_config
    from megascale.plan.memory import memory_per_device
    from megascale.plan.systems import TRAINER

    flag = [f"--parallel.activation_offload={str(offload).lower()}"]
    cfg = load_config(CONFIG, [*COMMON, *overrides, *flag])
    job, layout = job_from_config(cfg), layout_from_config(cfg, 1)
    memory = memory_per_device(job, layout, TRAINER, on_cpu=True)  # the trainer's blocks
    return memory.activations_bytes + memory.grads_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "offload.json")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one configuration
    args = parser.parse_args()
    if args.one is not None:
        sys.stdout.write(json.dumps(measure_one(json.loads(args.one))) + "\n")
        return
    figures: dict[str, float] = {}
    runs: dict[str, Any] = {}
    for case in args.cases.split(","):
        overrides = CASES[case]
        plain = run_case(overrides)
        offloaded = run_case([*overrides, "--parallel.activation_offload=true"])
        runs[case] = {"plain": plain, "offload": offloaded}
        mib = 2**20
        peak = statistics.median(plain["peak_bytes"][1:])
        peak_offload = statistics.median(offloaded["peak_bytes"][1:])
        predicted = predicted_bytes(overrides, False) - predicted_bytes(overrides, True)
        cpu = statistics.median(
            b / a for a, b in zip(plain["cpu_s"][1:], offloaded["cpu_s"][1:], strict=True)
        )
        case_figures = {
            f"offload_{case}_step_peak_mib": peak / mib,
            f"offload_{case}_step_peak_with_offload_mib": peak_offload / mib,
            f"offload_{case}_measured_saving_mib": (peak - peak_offload) / mib,
            f"offload_{case}_predicted_saving_mib": predicted / mib,
            f"offload_{case}_measured_over_predicted": (peak - peak_offload) / predicted,
            f"offload_{case}_losses_identical": float(plain["losses"] == offloaded["losses"]),
            f"offload_{case}_cpu_time_ratio": cpu,
        }
        for name, value in case_figures.items():
            sys.stdout.write(f"{name} {value:.3f}\n")
        sys.stdout.flush()
        figures.update(case_figures)
    machine = {
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine, "steps": STEPS, "cases": CASES, "results": figures, "runs": runs}
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
