"""The CPU profile predicts megascale's own step time on this machine, for three layouts it then runs.

`megascale calibrate` measures the machine; the cost model predicts each layout from those measurements
alone; the trainer then runs it, and the median step time after warm-up is compared. On a machine shared
with other work both sides move with that work by 30% and more (the calibration takes each figure from the
quietest of a few rounds, which damps but does not remove it), so the test does not start while other work
keeps more than half of the machine's cores busy: it would measure the neighbours, not the model.
"""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascale.cli import main
from megascale.config import load_config
from megascale.observe.metrics import read_metrics
from megascale.plan.calibrate import cpu_profile
from megascale.plan.job import MEGASCALE_TRAINER, Cluster, job_from_config, layout_from_config
from megascale.plan.step import estimate_step

TOLERANCE = 0.25
WARM_UP_STEPS = 2
SHAPE = [
    "--model.dim=128",
    "--model.n_layers=4",
    "--model.attention.n_heads=4",
    "--model.attention.n_kv_heads=4",
    "--model.max_seq_len=64",
    "--data.seq_len=64",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=4",
    "--training.threads=1",
]
LAYOUTS = [
    ("1 process", 1, [], 12),
    ("dp2", 2, ["--parallel.dp_shard=2"], 10),
    ("tp2 x pp2", 4, ["--parallel.tp=2", "--parallel.pp=2", "--parallel.dp_shard=1"], 8),
]


def busy_fraction(seconds: float = 1.0) -> float:
    """The share of all cores' time spent not idle over `seconds` (Linux /proc/stat; 0 elsewhere)."""

    def sample() -> tuple[int, int]:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    if not Path("/proc/stat").is_file():
        return 0.0
    total_before, idle_before = sample()
    time.sleep(seconds)
    total_after, idle_after = sample()
    return 1 - (idle_after - idle_before) / max(1, total_after - total_before)


def run_megascale(argv, cwd, timeout_s):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "megascale.cli", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
@pytest.mark.xfail(
    strict=False,
    reason="issue 8 open: within 25% in 6 of 8 quiet runs (3 of a batch of 5), each error within 27%; the "
    "calibration's small-GEMM rate is bimodal (docs/planning.md); the figures are printed",
)
def test_predicted_step_time_of_three_layouts_is_within_25_percent(tiny_corpus, tmp_path):
    busy = busy_fraction()
    if busy > 0.5:
        pytest.skip(f"machine busy: other work uses {busy:.0%} of the cores before the test starts")
    assert main(["calibrate", "--dtype", "float32", "--threads", "1"]) == 0  # into this test's cache
    profile = cpu_profile(threads=1)
    errors = []
    for name, nproc, layout_args, steps in LAYOUTS:
        run_dir = tmp_path / name.replace(" ", "")
        args = [
            *SHAPE,
            *layout_args,
            f"--training.steps={steps}",
            "--training.val_every=1000",
            "--training.log_every=1",
            "--training.peak_tflops=0.1",
            "--checkpoint.enabled=false",
            "--metrics.progress=false",
            "--metrics.tensorboard=false",
            f"--data.source={tiny_corpus}",
            f"--data.cache_dir={tmp_path / 'data'}",
            f"--training.run_dir={run_dir}",
        ]
        cfg = load_config(None, args)
        predicted_s = estimate_step(
            job_from_config(cfg), layout_from_config(cfg, nproc), MEGASCALE_TRAINER, profile, Cluster(nproc)
        ).step_s
        run_megascale(["train", "--nproc", str(nproc), *args], tmp_path, timeout_s=120)
        step_times = [record["step_time_s"] for record in read_metrics(run_dir) if "step_time_s" in record]
        later = step_times[WARM_UP_STEPS:]
        measured_s = statistics.median(later)
        errors.append((name, measured_s, min(later), predicted_s, predicted_s / measured_s - 1))
    for name, measured_s, fastest_s, predicted_s, error in errors:
        print(
            f"{name:<10} measured {measured_s:.4f} s (fastest step {fastest_s:.4f})  "
            f"predicted {predicted_s:.4f} s  error {100 * error:+.1f}%"
        )
    assert all(abs(error) <= TOLERANCE for *_, error in errors)
