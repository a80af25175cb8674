"""How close the planner's step time for this CPU (`megascale plan --hardware cpu`) comes to megascale's own
steps, for three layouts it then trains: 1 process, dp2, and tp2 x pp2.

The cost model predicts each layout from `megascale calibrate`'s measurements alone; the trainer runs it,
and the median of its step times after warm-up is compared (error = predicted / measured - 1). The
machine's pace drifts by 15% and more over minutes, on both sides of the comparison, so the bench
calibrates CALIBRATIONS times, each followed by one run of every layout: the prediction comes from the
calibrations' mean, the measured step from all runs' timed steps pooled. A run whose timed steps lost more
than 5% of the CPU time to the hypervisor (steal time, megascale/observe/cpu_load.py) is replaced by
another, once. Calibrations go to a cache of the bench's own, never the user's.

Prints one `name value` line per figure and writes them, with the machine, as JSON.

    python bench/plan_accuracy.py --out bench/results/plan_accuracy.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.record, run as a script
from bench.record import save_record  # noqa: E402
from megascale import calibrate as plan_calibrate  # noqa: E402
from megascale.config import load_config  # noqa: E402
from megascale.observe.cpu_load import CpuSampler, busy_fraction, cpu_times, least_disturbed  # noqa: E402
from megascale.observe.metrics import read_metrics  # noqa: E402
from megascale.observe.peak import calibrate  # noqa: E402
from megascale.plan import profiles as plan_profiles  # noqa: E402
from megascale.plan.job import Cluster, job_from_config, layout_from_config  # noqa: E402
from megascale.plan.step import estimate_step  # noqa: E402
from megascale.plan.systems import TRAINER  # noqa: E402

WARM_UP_STEPS = 2
QUIET_STEAL = 0.05  # a run whose timed steps lost more than this to the hypervisor is replaced by another,
MAX_ATTEMPTS = 2  # ... up to this many runs in all
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
    "--training.val_every=1000",
    "--training.log_every=1",
    "--training.peak_tflops=0.1",
    "--checkpoint.enabled=false",
    "--metrics.progress=false",
    "--metrics.tensorboard=false",
]
LAYOUTS = {
    "1process": (1, []),
    "dp2": (2, ["--parallel.dp_shard=2"]),
    "tp2xpp2": (4, ["--parallel.tp=2", "--parallel.pp=2", "--parallel.dp_shard=1"]),
}


def timed_run(args: list[str], nproc: int, run_dirs, cwd: Path) -> tuple[list[float], float]:
    """One run of a layout, into the next of `run_dirs`: its step times after warm-up, and the share of the
    machine's CPU time the hypervisor took meanwhile."""
    run_dir = next(run_dirs)
    command = [sys.executable, "-m", "megascale.cli", "train", "--nproc", str(nproc), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with CpuSampler() as sampler:
        result = subprocess.run(
            [*command, f"--training.run_dir={run_dir}"], capture_output=True, text=True, cwd=cwd, env=env
        )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    timed = [record for record in read_metrics(run_dir) if "step_time_s" in record][WARM_UP_STEPS:]
    return [record["step_time_s"] for record in timed], sampler.steal_over_steps(timed)


def calibration(rounds: int) -> tuple[dict[str, float], float]:
    """One calibration as `megascale calibrate --dtype float32 --threads 1` makes it, with `rounds` rounds:
    the profile's figures and the matmul peak (TFLOP/s)."""
    plan_calibrate.ROUNDS, plan_calibrate.MAX_ROUNDS = rounds, rounds + 1
    return plan_calibrate.calibrate_profile(1), calibrate("float32", 1, force=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrations", type=int, default=2, help="Calibrations, each followed by runs.")
    parser.add_argument("--rounds", type=int, default=2, help="Rounds of measurement per calibration.")
    parser.add_argument("--steps", type=int, default=12, help="Steps per run (the first 2 are warm-up).")
    parser.add_argument("--data", default="stdlib", help="The runs' data.source.")
    parser.add_argument("--out", type=Path, default=Path("bench/results/plan_accuracy.json"))
    args = parser.parse_args()

    before = cpu_times()
    time.sleep(1.0)
    busy = busy_fraction(before, cpu_times())
    if busy > 0.5:
        print(f"warning: other work keeps {busy:.0%} of the cores busy; the figures measure it too")
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        work = Path(tmp)
        os.environ["MEGASCALE_CACHE"] = str(work / "cache")  # this bench's calibrations only
        common = [*SHAPE, f"--training.steps={args.steps}", f"--data.source={args.data}"]
        layouts = {name: (nproc, [*common, *extra]) for name, (nproc, extra) in LAYOUTS.items()}
        calibrations, peaks = [], []
        runs: dict[str, list[tuple[list[float], float]]] = {name: [] for name in layouts}
        run_dirs = {name: (work / f"{name}-{n}" for n in itertools.count()) for name in layouts}
        for _ in range(args.calibrations):
            measured, peak = calibration(args.rounds)
            calibrations.append(measured)
            peaks.append(peak)
            for name, (nproc, layout_args) in layouts.items():
                measure = functools.partial(timed_run, layout_args, nproc, run_dirs[name], work)
                kept, _ = least_disturbed(measure, lambda run: run[1], 1, MAX_ATTEMPTS, QUIET_STEAL)
                runs[name] += kept
    mean = {field: statistics.fmean(each[field] for each in calibrations) for field in calibrations[0]}
    profile = plan_profiles.measured_profile(mean, 1, statistics.fmean(peaks), "this bench's calibrations")
    figures = {"calibration_steal_fraction": max(each["steal_fraction"] for each in calibrations)}
    for name, (nproc, layout_args) in layouts.items():
        cfg = load_config(None, layout_args)
        predicted_s = estimate_step(
            job_from_config(cfg), layout_from_config(cfg, nproc), TRAINER, profile, Cluster(nproc)
        ).step_s
        measured_s = statistics.median(seconds for run, _ in runs[name] for seconds in run)
        figures |= {
            f"{name}_measured_s": measured_s,
            f"{name}_predicted_s": predicted_s,
            f"{name}_error_pct": 100 * (predicted_s / measured_s - 1),
            f"{name}_run_steal_fraction": max(steal for _, steal in runs[name]),
        }
    for name, value in figures.items():
        print(f"{name} {value:+.1f}" if name.endswith("_pct") else f"{name} {value:.4g}")
    save_record(args.out, figures, {**vars(args), "shape": SHAPE, "layouts": LAYOUTS})
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
