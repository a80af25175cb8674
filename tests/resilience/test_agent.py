"""torchrun through resilience/agent.py: the elastic agent's account of its failed workers, from which the
executor's heartbeat names the ranks a signal ended (never from the text in the attempt's output)."""

import json
import subprocess
import sys

from megascale.checkpoint.staging import BASE
from megascale.resilience.agent import FAILURES, signalled_ranks
from megascale.resilience.executor import Executor
from megascale.stores.control import open_store

# Rank 1 is SIGKILLed; rank 0 first prints what torchrun's failure summary says of a rank a signal ended
# (as a worker echoing a tool's output might), naming a rank 7 that is not in the job, then waits until
# torchrun stops it.
WORKER = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
print("  rank      : 7 (local_rank: 1)", flush=True)
print("  exitcode  : -11 (pid: 4242)", flush=True)
time.sleep(120)
"""


def test_a_record_names_the_ranks_a_signal_ended_by_their_signal(tmp_path):
    record = tmp_path / FAILURES
    assert signalled_ranks(record) == {}  # none yet: torchrun runs, or no worker failed
    failures = {"0": {"exitcode": 1}, "2": {"exitcode": -9}, "3": {"exitcode": -15}, "5": {"exitcode": -77}}
    record.write_text(json.dumps(failures))
    assert signalled_ranks(record) == {"2": "SIGKILL", "3": "SIGTERM", "5": "signal 77"}


def test_the_executor_names_the_rank_a_signal_ended_from_the_agent_not_from_the_output(tmp_path, monkeypatch):
    monkeypatch.setenv(BASE, str(tmp_path / "shm"))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    store = open_store("tcp://127.0.0.1:0", job="agent", host=True)
    store.put("driver", {"job": "agent", "time": 0})
    executor = Executor(store.url, "agent", "node-0", tmp_path / "run", 1.0, connect_timeout_s=5)
    try:
        executor._begin_attempt(0)
        executor._clear_reports(0)
        attempt_dir = executor._attempt_dir(0)
        torchrun = [sys.executable, "-m", "megascale.resilience.agent", str(attempt_dir / FAILURES)]
        torchrun += ["--standalone", "--nproc-per-node=2", "--monitor-interval=0.1", str(script)]
        with open(attempt_dir / "output.log", "ab") as log:
            executor.proc = subprocess.Popen(torchrun, stdout=log, stderr=subprocess.STDOUT)
        assert executor.proc.wait(timeout=120) == 1  # torchrun's status for failed workers
        beat = executor.heartbeat()
        assert beat["state"] == "exited", beat
        assert beat["signalled"].get("1") == "SIGKILL" and "7" not in beat["signalled"], beat["signalled"]
        assert "rank      : 7" in (attempt_dir / "output.log").read_text()  # the decoy was in the output
    finally:
        executor.close()
