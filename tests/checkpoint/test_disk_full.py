"""A checkpoint that no longer fits on its file system is abandoned loudly and leaves none of its files
behind: retention prunes only after a commit, so a partial step would take the space of every later one."""

import os
import subprocess

import pytest

from megascale.checkpoint.checkpointer import list_checkpoints
from megascale.errors import CheckpointError
from megascale.observe.events import EventLog
from megascale.trainer import Trainer


@pytest.fixture
def small_disk(tmp_path):
    """A 1.6 MB file system: one checkpoint of the tiny model (about 1.05 MB) fits, two do not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_step_that_does_not_fit_is_abandoned_and_leaves_no_partial_directory(tiny_config, small_disk):
    trainer = Trainer(tiny_config(f"--checkpoint.location={small_disk}"))  # saves at steps 3 and 6
    with pytest.raises(CheckpointError, match="saving step 6 failed: .*No space left"):
        trainer.train()
    assert [step for step, _ in list_checkpoints(str(small_disk))] == [3]
    assert sorted(path.name for path in small_disk.iterdir()) == ["step-00000003"]


def test_the_driver_s_event_log_on_a_full_disk_says_it_and_goes_on(small_disk, caplog):
    with open(small_disk / "filler", "wb") as filler, pytest.raises(OSError, match="No space left"):
        while True:
            filler.write(b"\0" * 65536)
            filler.flush()
    record = EventLog(small_disk).write("give_up", reason="disk full")
    assert record["event"] == "give_up"
    assert "give_up: reason disk full (not in" in caplog.text and "No space left" in caplog.text
