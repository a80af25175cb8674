"""`megascale calibrate`'s probes: their ranks exit cleanly, and the memory probe times fresh pages.

How close the profile's predictions come to megascale's own steps is measured by bench/plan_accuracy.py
(docs/planning.md): a comparison of timings, which a shared machine moves by 30% and more, is a benchmark's
figure, not a test's.
"""

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megascale.calibrate import run_ranks
from megascale.cli import main

# One rank of a two-rank tensor-parallel probe (calibrate's, with fewer calls): the parallelised models it
# leaves behind hold collective work in reference cycles.
TP_PROBE_RANK = """
import sys
import torch
from torch.distributed.device_mesh import init_device_mesh
from megascale.calibrate import host_seconds, in_two_rank_group, tensor_parallel

def probe():
    return host_seconds(tensor_parallel(init_device_mesh("cpu", (2,))), calls=2)

torch.set_num_threads(1)
in_two_rank_group(int(sys.argv[1]), sys.argv[2], probe)
"""


@pytest.mark.slow
def test_measuring_ranks_exit_cleanly(tmp_path, monkeypatch):
    """A probe's ranks exit with 0 every time (six runs of two ranks; the next test checks the cause of
    the aborts it guards against deterministically)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with ThreadPoolExecutor(3) as pool:  # three probes at a time: what fails is a rank's exit, not its pace
        list(pool.map(lambda run: run_ranks(TP_PROBE_RANK, [str(tmp_path / f"init{run}")], 120), range(6)))


def test_a_probes_models_are_collected_before_its_group_is_destroyed(monkeypatch):
    """What a probe leaves in reference cycles is collected while its process group lives. Collected at
    the interpreter's exit, after the group was gone, such models aborted a rank (SIGABRT) in 6 of 32 runs
    of the TP probe."""
    import gc

    import torch.distributed as dist

    from megascale.calibrate import in_two_rank_group

    events: list[str] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: events.append("init"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *args, **kwargs: events.append("destroyed"))

    class HoldsCollectiveWork:
        def __init__(self):
            self.cycle = self

        def __del__(self):
            events.append("collected")

    def measure() -> dict[str, float]:
        HoldsCollectiveWork()  # unreachable at once, but alive until a collection
        return {"seconds": 1.0}

    gc.disable()  # no collection but the one under test
    try:
        assert in_two_rank_group(0, "unused", measure) == {"seconds": 1.0}
    finally:
        gc.enable()
    assert events == ["init", "collected", "destroyed"]


# The memory probe in an interpreter whose torch asks for huge pages on every allocation of 2 MB and more
# (madvise), as a kernel with transparent huge pages "always" gives them unasked; it counts its own faults.
HUGE_PAGE_PROBE = """
import json, resource, torch
from megascale.calibrate import MEMORY_FLOATS, fresh_memory_bytes_per_s
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
    monkeypatch.setattr("megascale.calibrate.calibrate_profile", lambda threads: measured)
    assert main(["calibrate", "--dtype", "float32", "--threads", "1"]) == 0
    assert "warning: the memory probe faulted in 25% of its results' pages" in capsys.readouterr().out


def test_calibrate_says_what_each_figure_is(capsys, monkeypatch):
    """Every figure the profile stores is printed with its unit and what it measures, after a line saying
    what the figures are for."""
    from megascale.calibrate import FIGURES
    from megascale.plan.profiles import MEASURED

    stored = {*MEASURED, "memory_fresh_page_fraction", "steal_fraction"}
    assert set(FIGURES) == stored
    monkeypatch.setattr("megascale.observe.peak.measure_matmul_tflops", lambda dtype, threads: 0.1)
    measured = dict.fromkeys(sorted(stored), 1.0) | {"steal_fraction": 0.0}
    monkeypatch.setattr("megascale.calibrate.calibrate_profile", lambda threads: measured)
    assert main(["calibrate", "--dtype", "float32", "--threads", "1"]) == 0
    header, peak, *figures, cached = capsys.readouterr().out.strip().splitlines()
    assert "1 thread(s) a process" in header and "MFU divides by" in header and "megascale plan" in header
    assert peak == "cpu_matmul_peak_float32_tflops 0.1000  TFLOP/s: a large float32 matmul, this CPU's peak"
    assert len(figures) == len(stored)
    units = {"_s": "s", "_per_s": "/s", "fraction": "fraction"}
    for line in figures:
        name, value, unit, meaning = re.fullmatch(r"cpu_(\w+) (\S+)  (\S+): (.{20,})", line).groups()
        assert name in stored and float(value) == measured[name]
        assert any(name.endswith(end) and want in unit for end, want in units.items()), line
    assert cached.startswith("cached in ")
