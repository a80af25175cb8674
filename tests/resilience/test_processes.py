"""What an executor reads of its node's processes in /proc: a rank that died or stopped, and a torchrun a
killed predecessor started."""

import json
import signal
import subprocess
import sys
import time

from megascale.checkpoint.staging import process_identity
from megascale.resilience.processes import AdoptedTorchrun, RankWatch


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_rank_that_stops_without_a_step_is_timed_and_one_that_dies_is_lost():
    proc = sleeper()
    try:
        watch = RankWatch()
        progress = {0: {"step": 7, "pid": proc.pid}, 1: {"step": 7, "pid": proc.pid, "finished": True}}
        assert watch.read(progress, now=100.0) == ([], {})
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.2)  # the stop takes effect
        assert watch.read(progress, now=101.0) == ([], {"0": 0.0})
        assert watch.read(progress, now=102.5) == ([], {"0": 1.5})
        progress[0]["step"] = 8  # a throttled rank that still steps starts again from zero
        assert watch.read(progress, now=103.0) == ([], {"0": 0.0})
        proc.kill()
        proc.wait()
        assert watch.read(progress, now=104.0) == ([0], {})  # rank 1 finished: its exit is no fault
    finally:
        proc.kill()
        proc.wait()


def test_an_adopted_torchrun_succeeded_when_every_rank_of_it_finished(tmp_path):
    for finished, code in ((True, 0), (False, 1)):
        attempt_dir = tmp_path / f"finished-{finished}"
        attempt_dir.mkdir()
        for rank in (0, 1):
            report = {"step": 12, "pid": 1, "finished": finished or rank == 0}
            (attempt_dir / f"rank-{rank}.json").write_text(json.dumps(report))
        proc = sleeper()
        adopted = AdoptedTorchrun(process_identity(proc.pid), attempt_dir)
        assert adopted.poll() is None
        proc.kill()
        proc.wait()
        assert adopted.wait(timeout=10) == code


def test_a_standby_waits_for_its_executors_successor_and_leaves_when_none_comes(tmp_path, monkeypatch):
    """The standby reads the node's executor record: a dead executor's successor (a new `executor` in the
    record) keeps it waiting to be adopted; no live executor for the grace and it exits (ExecutorGone)."""
    import threading

    import pytest

    from megascale.resilience import client

    record, go = tmp_path / "executor.json", tmp_path / "attempt-1" / "go"
    go.parent.mkdir()
    dead = sleeper()
    dead_identity = process_identity(dead.pid)
    dead.kill()
    dead.wait()
    record.write_text(json.dumps({"executor": dead_identity}))
    monkeypatch.setenv(client.STANDBY, str(go))
    monkeypatch.setenv(client.EXECUTOR_RECORD, str(record))
    monkeypatch.setenv(client.EXECUTOR_GRACE, "2.5")

    def succeed_then_activate() -> None:
        time.sleep(1.5)  # the successor starts and adopts within the grace
        record.write_text(json.dumps({"executor": process_identity()}))
        time.sleep(3.0)  # longer than the grace: the standby is still there
        go.touch()

    helper = threading.Thread(target=succeed_then_activate)
    helper.start()
    started = time.monotonic()
    assert client.wait_until_activated(0) is True and time.monotonic() - started > 4.0
    helper.join()
    assert (go.parent / "standby-0.json").exists()

    go.unlink()
    record.write_text(json.dumps({"executor": dead_identity}))  # its executor died; none comes
    started = time.monotonic()
    with pytest.raises(client.ExecutorGone, match="no executor on its node for 2 s"):
        client.wait_until_activated(0)
    assert 2.5 < time.monotonic() - started < 6.0
