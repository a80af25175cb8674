"""What lets a driver started again on a run directory take over the job a killed driver left running.

The driver is one process; killed (an operator, the OOM killer, its host's reboot), it takes neither the
training nor the executors with it: local executors run in sessions of their own and external ones on
their own hosts, and they ride out the loss of its store for resilience.store_grace_s. A new
`megascale launch` on the same run directory reads the dead driver's record (`driver.json`: its job id,
its store, its process and the executors it started), serves the store again at the same address, puts
back the registrations from the events log, adopts the executors still alive and watches the attempt
they run, so no step is lost. A record whose driver still runs is refused: two drivers of one job would
give contradictory commands.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from megascale.checkpoint.staging import is_alive, process_identity
from megascale.errors import ConfigError
from megascale.resilience.records import read_events

DRIVER_RECORD = "driver.json"


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The record of the driver that last ran the job in `run_dir` and did not end it (None: no such
    driver); ConfigError if that driver still runs."""
    path = run_dir / DRIVER_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if is_alive(record["identity"]):
        raise ConfigError(
            f"a driver (pid {record['identity']['pid']}) already runs the job in {run_dir}: stop it first, "
            "or give this run another training.run_dir"
        )
    return record


def write_record(run_dir: Path, job: str, store: str, executors: dict[str, dict[str, Any]]) -> None:
    """This driver's record: what a driver started after it dies needs to take the job over."""
    record = {"job": job, "store": store, "identity": process_identity(), "executors": executors}
    temporary = run_dir / f".{DRIVER_RECORD}.tmp"
    temporary.write_text(json.dumps(record))
    os.replace(temporary, run_dir / DRIVER_RECORD)


def remove_record(run_dir: Path) -> None:
    """The job ended (done, given up, stopped): nothing is left to take over."""
    with contextlib.suppress(FileNotFoundError):
        (run_dir / DRIVER_RECORD).unlink()


def registrations(run_dir: Path) -> list[dict[str, Any]]:
    """Every executor registration the job's drivers read, in ticket order (from their `joined` events)."""
    keys = ("node", "host", "address")
    return [
        {key: event.get(key) for key in keys} for event in read_events(run_dir) if event["event"] == "joined"
    ]


def last_attempt(run_dir: Path) -> dict[str, Any] | None:
    """The last `start` event of the job: the attempt its executors may still run, and its nodes."""
    starts = [event for event in read_events(run_dir) if event["event"] == "start"]
    return starts[-1] if starts else None


class AdoptedProcess:
    """An executor a dead driver started: this driver is not its parent, so it is watched by its identity
    (pid, start time, boot) rather than waited for. Offers what the driver uses of subprocess.Popen; the
    exit status of a process that is not our child cannot be read (returncode -1 once it is gone)."""

    def __init__(self, identity: dict[str, Any]):
        self.identity, self.pid, self.returncode = identity, int(identity["pid"]), None

    def poll(self) -> int | None:
        if self.returncode is None and not is_alive(self.identity):
            self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.1)
        return self.returncode

    def send_signal(self, sig: signal.Signals) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)
