"""`megascale rehearse --soak`: one job under a stream of faults done from outside; each recovered by itself,
the undisturbed run's losses and final weights, nothing left behind, and the job's goodput."""

import json
import subprocess
import sys
from collections import Counter

import pytest

from megascale.resilience.soak import (
    FAULTS,
    Injected,
    by_class,
    first_differing,
    measure_fault,
    parse_duration,
    schedule,
    tables,
)


def test_every_class_comes_up_once_in_each_round_of_the_schedule():
    import random

    names, every_class = schedule(random.Random(1), 2 * len(FAULTS) + 3), Counter(list(FAULTS))
    assert Counter(names[: len(FAULTS)]) == every_class == Counter(names[len(FAULTS) : 2 * len(FAULTS)])
    assert names != schedule(random.Random(2), len(names))


def test_durations_are_read_as_an_operator_writes_them():
    assert [parse_duration(text) for text in ("30m", "90s", "1h30m", "45", "2.5m")] == [
        1800.0,
        90.0,
        5400.0,
        45.0,
        150.0,
    ]
    with pytest.raises(ValueError, match="a duration such as 30m"):
        parse_duration("30 minutes")


def test_a_fault_is_measured_from_the_records_up_to_the_next_one():
    """A SIGKILL at t=100 the standby took over (next step 102.2), then a store restart at t=150 that
    stopped nothing: each reads only its own events."""
    events = [
        {"time": 100.4, "event": "fault", "kind": "rank_exit", "last_step": 40},
        {"time": 100.9, "event": "restart", "attempt": 2, "standby": True},
        {"time": 102.5, "event": "recovered", "attempt": 2, "first_step": 40, "resumed_from": 38},
        {"time": 154.0, "event": "store_back", "outage_s": 4.0},
        {"time": 170.0, "event": "restart", "attempt": 3},  # the next fault's
    ]
    records = [{"step": 38, "time": 99.8}, {"step": 39, "time": 102.2}, {"step": 200, "time": 150.1}]
    kill = measure_fault(Injected("rank SIGKILL", "SIGKILL rank 1", 100.0, 40, 1), 150.0, events, records)
    assert kill["detected_as"] == "rank_exit" and kill["detected_after_s"] == 0.4
    assert kill["path"] == "standby" and kill["steps_redone"] == 2
    assert kill["fault_to_next_step_s"] == 2.2 and kill["detection_to_next_step_s"] == 1.8
    store = measure_fault(Injected("store restart", "SIGKILL redis", 150.0, 199, 2), 160.0, events, records)
    assert store["detected_as"] == "store_back" and store["path"] == "none needed"
    assert store["fault_to_next_step_s"] == 0.1 and store["detection_to_next_step_s"] is None
    (row,) = [row for row in by_class([kill, store]) if row["fault"] == "rank SIGKILL"]
    assert row["paths"] == ["standby"] and row["median_detection_to_next_step_s"] == 1.8


def test_a_soak_that_parts_from_the_undisturbed_run_says_where():
    """The first step whose loss differs (the fault before it parted the curves), and which checkpoints
    the final weights were read from."""
    assert first_differing({1: 2.0, 2: 1.5, 3: 1.25}, {1: 2.0, 2: 1.5, 3: 1.25}) is None
    assert first_differing({1: 2.0, 2: 1.5, 3: 1.0}, {1: 2.0, 2: 1.75, 3: 1.0}) == 2
    assert first_differing({1: 2.0, 2: 1.5}, {1: 2.0}) == 2  # a step the reference never took
    result = {
        "ettr": 0.9, "productive_s": 90.0, "wall_s": 100.0, "faults": [], "classes": [], "recovered": True,
        "losses_equal": False, "first_loss_differing": 913, "weights_equal": False, "steps": 1425,
        "final_checkpoints": ["step-00001400", "step-00001425"], "processes_left": 0, "shm_bytes_left": 0,
        "began": 0.0,
    }  # fmt: skip
    said = tables(result).splitlines()[0]
    assert "undisturbed run: **no** (steps 1-1425, losses first differ at step 913" in said
    assert "final weights differ (checkpoints step-00001400 and step-00001425)" in said


# The suite's soak: three windows of 12 s (each fault done once the job trains again after the one before
# and its standby is ready), the seed drawing a rank SIGSTOP, an executor kill and then a NaN: faults the
# standby takes over, and a killed executor whose successor adopts the attempt and the standby, which the
# NaN then calls on. The other classes have tests of their own: a rank SIGKILL (found as a rank's exit in
# test_rehearsal.py and test_driver.py; the standby takes over from any fault that restarts, as it does
# here), and in test_driver.py a slow rank (the same in-job hook), a failing node (a full restart), a
# corrupted checkpoint (the fallback in storage), a store restart.
SUITE_SOAK = ["--soak", "36s", "--fault-every", "12", "--seed", "463"]
SUITE_CLASSES = {"rank SIGSTOP", "executor kill", "NaN"}


@pytest.mark.slow
@pytest.mark.alone  # its goodput floor and step-time detector: no other test's load beside it
def test_a_short_soak_recovers_every_fault_with_the_undisturbed_curve(tiny_corpus, tmp_path):
    """Each fault recovered by itself, the losses and final weights equal to the undisturbed run's bit for
    bit, nothing left behind; every fault that stops the job taken over by the standby, an executor kill
    not even a restart (its successor adopts the attempt and the standby); and the goodput above a floor
    set from measurement (0.70 on 2 cores, where the 15 s from the launch to the first step and the
    stop weigh on a run of under a minute and a half; a slower machine starts slower)."""
    work = tmp_path / "soak"
    result = subprocess.run(
        [
            sys.executable, "-m", "megascale.cli", "rehearse", *SUITE_SOAK, "--work", str(work),
            f"--data.source={tiny_corpus}",
        ],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    soak = json.loads((work / "soak" / "soak.json").read_text())
    print((work / "soak.md").read_text())
    assert soak["recovered"] and soak["losses_equal"] and soak["weights_equal"]
    assert soak["processes_left"] == 0 and soak["shm_bytes_left"] == 0
    faults = soak["faults"]
    assert {fault["fault"] for fault in faults} == SUITE_CLASSES
    for fault in faults:
        assert fault["detected_as"] is not None, fault
        expected = "none needed" if fault["fault"] == "executor kill" else "standby"
        assert fault["path"] == expected and fault["steps_redone"] <= 2, fault
    assert soak["ettr"] >= 0.6
