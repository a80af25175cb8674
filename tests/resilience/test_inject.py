"""Fault-injection specs: parsing, first-attempt-only, and the per-rank hooks."""

import math
import time

import pytest

from megascale.checkpoint.manifest import MANIFEST
from megascale.resilience.inject import FaultInjector, active_faults, parse_faults


def test_parse_and_filter_by_attempt():
    faults = parse_faults("kill:rank=1:step=7, nan:step=3:attempt=1,corrupt_checkpoint:step=9")
    assert [fault.kind for fault in faults] == ["kill", "nan", "corrupt_checkpoint"]
    assert faults[0].params == {"rank": 1.0, "step": 7.0}
    assert [fault.kind for fault in active_faults("kill:rank=1:step=7,nan:step=3:attempt=1", 1)] == ["nan"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("explode:step=1", "unknown fault 'explode'"),
        ("kill:rank", "'rank' is not key=number"),
        ("kill:step=x", "'step=x' is not key=number"),
        ("corrupt_checkpoint", "the step it happens at is missing"),
    ],
)
def test_bad_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_faults(spec)


def test_a_rank_takes_only_its_own_faults():
    spec = "nan:step=3,slow:rank=1:factor=2"
    assert math.isnan(FaultInjector(spec, rank=0, attempt=0).loss_scale(3))
    assert FaultInjector(spec, rank=0, attempt=0).loss_scale(4) == 1.0
    assert [fault.kind for fault in FaultInjector(spec, rank=1, attempt=0).faults] == ["nan", "slow"]
    assert not FaultInjector(spec, rank=0, attempt=1)


def test_a_corrupted_checkpoint_is_the_newest_committed_one_truncated_by_rank_0_as_its_step_begins(tmp_path):
    """The fault happens in the job, when it is due; the driver's restart finds it done."""
    shards = {}
    for step in (4, 8):
        location = tmp_path / f"step-{step:08d}"
        location.mkdir()
        (location / MANIFEST).write_text("{}")
        shards[step] = location / "__0_0.distcp"
        shards[step].write_bytes(bytes(100))
    (tmp_path / "step-00000012").mkdir()  # not committed (no manifest): not a checkpoint yet
    spec, root = "corrupt_checkpoint:step=9", str(tmp_path)
    FaultInjector(spec, rank=1, attempt=0, checkpoints=root).before_step(9)  # another rank's fault
    FaultInjector(spec, rank=0, attempt=0, checkpoints=root).before_step(8)  # not yet
    assert [shards[step].stat().st_size for step in (4, 8)] == [100, 100]
    FaultInjector(spec, rank=0, attempt=0, checkpoints=root).before_step(9)
    assert [shards[step].stat().st_size for step in (4, 8)] == [100, 50]
    FaultInjector(f"{spec}:rank=1", rank=1, attempt=0, checkpoints=root).before_step(9)
    assert shards[8].stat().st_size == 25


def test_a_slow_rank_works_on_rather_than_sleeps():
    """A slow rank on CPU must take more CPU time, as a slower CPU would: the straggler detector compares
    ranks by CPU time there, and a sleep would not show."""
    injector = FaultInjector("slow:rank=0:factor=1.5:step=2", rank=0, attempt=0)
    started = time.thread_time()
    injector.stretch(1, 0.1, time.thread_time)  # before the fault's step
    assert time.thread_time() - started < 0.01
    injector.stretch(2, 0.1, time.thread_time)
    assert 0.05 <= time.thread_time() - started < 0.07


def test_a_bad_spec_is_a_config_error_before_anything_starts(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "megascale.cli",
            "launch",
            "--resilience.inject=kill:rank",
            f"--training.run_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: config: resilience.inject = 'kill:rank': fault 'kill:rank': 'rank' is not key=number"
    )


def test_a_file_spec_is_read_again_whenever_the_file_changes(tmp_path):
    """`@PATH`: the soak writes faults for an attempt and a step to come while the job runs."""
    spec = tmp_path / "faults.txt"
    injector = FaultInjector(f"@{spec}", rank=0, attempt=2)
    assert not injector and active_faults(f"@{spec}", 2) == []  # no file yet: no faults
    spec.write_text("nan:step=5:attempt=2\ndiagnose_fail:node=1:attempt=2\n")
    assert math.isnan(injector.loss_scale(5)) and injector.loss_scale(4) == 1.0
    assert [fault.kind for fault in active_faults(f"@{spec}", 2)] == ["nan", "diagnose_fail"]
    assert not FaultInjector(f"@{spec}", rank=0, attempt=3)  # a restarted attempt replays cleanly
    spec.write_text("kill:rank=1:step=9:attempt=2\n")
    assert injector.loss_scale(5) == 1.0  # the file changed: the NaN is gone
