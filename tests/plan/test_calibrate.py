"""The CPU profile predicts megascale's own step time on this machine, for three layouts it then runs.

`megascale calibrate` measures the machine; the cost model predicts each layout from those measurements
alone; the trainer runs it, and the median of its step times after warm-up is compared. The machine's pace
drifts over minutes, so the test calibrates twice, each time followed by one run of every layout, and
compares the prediction from both calibrations with both runs' steps. On a machine shared with other work
both sides move with that work by 30% and more, so the test does not start while other work keeps more
than half of the machine's cores busy: it would measure the neighbours, not the model. The same holds for a
virtual machine's other guests: a run whose timed steps lost more than 5% of the CPU time to them (the
hypervisor's steal time, megascale/observe/cpu_load.py) is replaced by another; when the runs kept, or a
calibration, lost more than 10%, the test skips.
"""

import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascale.cli import main
from megascale.config import load_config
from megascale.observe.cpu_load import CpuSampler, busy_fraction, cpu_times, least_disturbed
from megascale.observe.metrics import read_metrics
from megascale.observe.peak import cached_calibration
from megascale.plan.calibrate import cache_key, measured_profile, profile_cache, run_ranks
from megascale.plan.job import MEGASCALE_TRAINER, Cluster, job_from_config, layout_from_config
from megascale.plan.step import estimate_step

TOLERANCE = 0.25
WARM_UP_STEPS = 2
# The machine's pace drifts by 15% and more over minutes (1 process: step medians 63-86 ms within an hour,
# session 13), on both sides of the comparison. So the test measures the machine CALIBRATIONS times, each
# followed by one run of every layout: the prediction comes from the calibrations' mean, the measured step
# from all runs' timed steps pooled, both spread over the same minutes.
CALIBRATIONS = 2
CALIBRATION_ROUNDS = 2  # rounds of each (`megascale calibrate` makes 3): four in all
QUIET_STEAL = 0.05  # a run whose timed steps lost more than this to the hypervisor is replaced by another,
MAX_ATTEMPTS = 2  # ... up to this many runs in all; if the runs kept still lost more than MAX_STEAL, the
MAX_STEAL = 0.10  # test cannot judge
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
    ("dp2", 2, ["--parallel.dp_shard=2"], 12),
    ("tp2 x pp2", 4, ["--parallel.tp=2", "--parallel.pp=2", "--parallel.dp_shard=1"], 12),
]


def run_megascale(argv, cwd, timeout_s):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "megascale.cli", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def timed_run(args, nproc, run_dirs, tmp_path):
    """One run of a layout, into the next of `run_dirs`: its step times after warm-up, and the share of the
    machine's CPU time the hypervisor took meanwhile."""
    run_dir = next(run_dirs)
    args = [*args, f"--training.run_dir={run_dir}"]
    with CpuSampler() as sampler:
        run_megascale(["train", "--nproc", str(nproc), *args], tmp_path, timeout_s=120)
    records = [record for record in read_metrics(run_dir) if "step_time_s" in record]
    timed = records[WARM_UP_STEPS:]
    return [record["step_time_s"] for record in timed], sampler.steal_over_steps(timed)


@pytest.mark.slow
def test_predicted_step_time_of_three_layouts_is_within_25_percent(tiny_corpus, tmp_path, monkeypatch):
    before = cpu_times()
    time.sleep(1.0)
    busy = busy_fraction(before, cpu_times())
    if busy > 0.5:
        pytest.skip(f"machine busy: other work uses {busy:.0%} of the cores before the test starts")
    monkeypatch.setattr("megascale.plan.calibrate.ROUNDS", CALIBRATION_ROUNDS)
    monkeypatch.setattr("megascale.plan.calibrate.MAX_ROUNDS", CALIBRATION_ROUNDS + 1)  # bounded
    layouts = [
        (name, nproc, layout_args(extra, steps, tiny_corpus, tmp_path))
        for name, nproc, extra, steps in LAYOUTS
    ]
    calibrations, runs = [], {name: [] for name, *_ in layouts}
    attempts = dict.fromkeys(runs, 0)
    run_dirs = {name: map(tmp_path.joinpath, numbered(name.replace(" ", ""))) for name in runs}
    for _ in range(CALIBRATIONS):
        assert main(["calibrate", "--dtype", "float32", "--threads", "1"]) == 0  # into this test's cache
        calibrations.append(json.loads(profile_cache().read_text())[cache_key(1)])
        for name, nproc, args in layouts:
            kept, made = least_disturbed(
                functools.partial(timed_run, args, nproc, run_dirs[name], tmp_path),
                lambda run: run[1],
                1,
                MAX_ATTEMPTS,
                QUIET_STEAL,
            )
            runs[name] += kept
            attempts[name] += made
    calibration = {field: statistics.fmean(each[field] for each in calibrations) for field in calibrations[0]}
    print("\ncalibration: " + ", ".join(f"{name} {value:.3g}" for name, value in calibration.items()))
    calibration_steal = max(each["steal_fraction"] for each in calibrations)
    if calibration_steal > MAX_STEAL:
        pytest.skip(f"the hypervisor took {calibration_steal:.0%} of the CPU time in a calibration")
    profile = measured_profile(calibration, 1, cached_calibration("float32", 1), "this test's calibrations")
    errors = []
    for name, nproc, args in layouts:
        cfg = load_config(None, args)
        predicted_s = estimate_step(
            job_from_config(cfg), layout_from_config(cfg, nproc), MEGASCALE_TRAINER, profile, Cluster(nproc)
        ).step_s
        step_times = [seconds for run, _ in runs[name] for seconds in run]
        measured_s, steal = statistics.median(step_times), max(steal for _, steal in runs[name])
        errors.append(
            (
                name,
                measured_s,
                min(step_times),
                steal,
                attempts[name],
                predicted_s,
                predicted_s / measured_s - 1,
            )
        )
    for name, measured_s, fastest_s, steal, made, predicted_s, error in errors:
        print(
            f"{name:<10} measured {measured_s:.4f} s (fastest step {fastest_s:.4f}; hypervisor steal up to "
            f"{steal:.1%}; {made} runs)  predicted {predicted_s:.4f} s  error {100 * error:+.1f}%"
        )
    stolen = [name for name, _, _, steal, *_ in errors if steal > MAX_STEAL]
    if stolen:
        pytest.skip(f"the hypervisor took over {MAX_STEAL:.0%} of the CPU time in the runs kept of {stolen}")
    assert all(abs(error) <= TOLERANCE for *_, error in errors)


def numbered(prefix):
    """prefix-0, prefix-1, ...: a layout's run directories."""
    return (f"{prefix}-{n}" for n in itertools.count())


def layout_args(extra, steps, corpus, tmp_path):
    """The trainer's arguments for one layout of the test (`extra`) at the test's SHAPE."""
    return [
        *SHAPE,
        *extra,
        f"--training.steps={steps}",
        "--training.val_every=1000",
        "--training.log_every=1",
        "--training.peak_tflops=0.1",
        "--checkpoint.enabled=false",
        "--metrics.progress=false",
        "--metrics.tensorboard=false",
        f"--data.source={corpus}",
        f"--data.cache_dir={tmp_path / 'data'}",
    ]


# One rank of a two-rank tensor-parallel probe (calibrate's, with fewer calls): the parallelised models it
# leaves behind hold collective work in reference cycles.
TP_PROBE_RANK = """
import sys
import torch
from torch.distributed.device_mesh import init_device_mesh
from megascale.plan.calibrate import host_seconds, in_two_rank_group, tensor_parallel

def probe():
    return host_seconds(tensor_parallel(init_device_mesh("cpu", (2,))), calls=2)

torch.set_num_threads(1)
in_two_rank_group(int(sys.argv[1]), sys.argv[2], probe)
"""


@pytest.mark.slow
def test_measuring_ranks_exit_cleanly(tmp_path, monkeypatch):
    """A probe's ranks exit with 0 every time. Before its models were collected while the group was alive,
    a rank aborted at exit (SIGABRT) in 6 of 32 runs of this probe: twelve clean runs had an 8% chance."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for run in range(12):
        run_ranks(TP_PROBE_RANK, [str(tmp_path / f"init{run}")], timeout_s=60)


# The memory probe in an interpreter whose torch asks for huge pages on every allocation of 2 MB and more
# (madvise), as a kernel with transparent huge pages "always" gives them unasked; it counts its own faults.
HUGE_PAGE_PROBE = """
import json, resource, torch
from megascale.plan.calibrate import MEMORY_FLOATS, fresh_memory_bytes_per_s
torch.set_num_threads(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
_, reported = fresh_memory_bytes_per_s(calls=5)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
pages = 6 * MEMORY_FLOATS * 4 / resource.getpagesize()
print(json.dumps({"faults": faults, "pages": pages, "reported": reported}))
"""


def test_the_memory_probe_faults_its_results_in_small_pages_where_huge_pages_are_on_offer():
    """The probe times results faulted in 4 KB pages whatever the kernel's huge-page policy. Before it
    turned them off, the same add here faulted in 6% of its results' 4 KB pages and read 1.7x faster; on a
    CI machine it read 8x, and every layout was predicted short."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.is_file() or "[never]" in thp.read_text():
        pytest.skip("this kernel gives no transparent huge pages, so none can be turned off")
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", HUGE_PAGE_PROBE], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    probe = json.loads(result.stdout)
    assert probe["faults"] >= 0.9 * probe["pages"]  # the warm-up and 5 calls, each a fresh 32 MB result
    assert probe["reported"] >= 0.9


def test_calibrate_warns_when_the_memory_probe_did_not_measure_fresh_pages(capsys, monkeypatch):
    monkeypatch.setattr("megascale.observe.peak.measure_matmul_tflops", lambda dtype, threads: 0.1)
    measured = {"steal_fraction": 0.0, "memory_fresh_page_fraction": 0.25}
    monkeypatch.setattr("megascale.plan.calibrate.calibrate_profile", lambda threads: measured)
    assert main(["calibrate", "--dtype", "float32", "--threads", "1"]) == 0
    assert "warning: the memory probe faulted in 25% of its results' pages" in capsys.readouterr().out
