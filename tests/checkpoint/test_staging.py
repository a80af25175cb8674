"""Checkpoint staging in host memory is removed once every process that owned it is gone: by the next
executor to start on the host, and by `megascale clean`; never while an owner runs, and an executor adopts
its own node's directory (its snapshots still to persist) rather than removing it."""

import json
import subprocess
import sys

import pytest

from megascale.checkpoint.staging import BASE, OWNER_SUFFIX, claim, is_alive, process_identity
from megascale.cli import main
from megascale.resilience.executor import Executor
from megascale.stores.control import open_store


@pytest.fixture
def base(tmp_path, monkeypatch):
    """The host's staging memory, as this test's directory."""
    monkeypatch.setenv(BASE, str(tmp_path / "shm"))
    return tmp_path / "shm"


def dead_identity():
    """The identity of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        return process_identity(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def staged(base, job, node, owner, megabytes=1):
    """A node's staging directory as an executor and its rank leave it: a snapshot buffer, owned."""
    directory = base / f"megascale-{job}" / node
    (directory / "snapshots").mkdir(parents=True)
    (directory / "snapshots" / "rank-00000.bin").write_bytes(b"\1" * (megabytes << 20))
    (directory / f"executor{OWNER_SUFFIX}").write_text(json.dumps(owner))
    return directory


def test_a_process_is_alive_until_it_exits_and_a_reused_pid_is_not_it():
    assert is_alive(process_identity())
    assert not is_alive(dead_identity())
    assert not is_alive({**process_identity(), "start": process_identity()["start"] - 1})


def test_an_executor_start_removes_dead_jobs_staging_keeps_live_ones_and_adopts_its_own(base):
    dead, live = staged(base, "killed", "node-0", dead_identity()), staged(base, "running", "node-0", {})
    claim(live, "executor")  # this process: alive
    own = staged(base, "ours", "node-1", dead_identity())  # this node's previous executor's, killed
    (own / "step-00000004").mkdir()
    store = open_store("tcp://127.0.0.1:0", job="ours", host=True)
    store.put("driver", {"job": "ours", "time": 0})
    executor = Executor(store.url, "ours", "node-1", base / "run", 1.0, connect_timeout_s=5)
    try:
        assert not dead.parent.exists()  # nor its job's directory, left empty
        assert (live / "snapshots" / "rank-00000.bin").is_file()
        assert (own / "step-00000004").is_dir() and executor.staging_dir == own
        assert json.loads((own / f"executor{OWNER_SUFFIX}").read_text())["pid"] == process_identity()["pid"]
    finally:
        executor.close()


def test_megascale_clean_removes_only_what_no_live_process_owns(base, capsys):
    dead = staged(base, "killed", "node-0", dead_identity(), megabytes=2)
    live = staged(base, "running", "node-0", {})
    claim(live / "snapshots", "rank-00000")  # a rank's claim, deeper down, keeps the whole node's
    assert main(["clean", "--dry-run"]) == 0
    assert f"would remove {dead} (2.1 MB)" in capsys.readouterr().out and dead.is_dir()
    assert main(["clean"]) == 0
    out = capsys.readouterr().out
    assert f"removed {dead} (2.1 MB)" in out and "1 staging directories of dead processes" in out
    assert not dead.exists() and live.is_dir()


def test_a_run_directory_made_just_now_without_an_owner_is_left_alone(base):
    fresh = base / "megascale-new" / "node-0"
    fresh.mkdir(parents=True)
    assert main(["clean"]) == 0
    assert fresh.is_dir()
