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
from typing import TYPE_CHECKING, Any

from megascale.checkpoint.staging import is_alive, process_identity
from megascale.errors import ConfigError
from megascale.observe.events import read_events
from megascale.resilience.records import read_blocklist

if TYPE_CHECKING:
    from megascale.resilience.driver import Driver

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
        self.identity, self.pid = identity, int(identity["pid"])
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not is_alive(self.identity):
            self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if timeout is not None and deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.1)
        return code

    def send_signal(self, sig: signal.Signals) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def adopt(driver: Driver) -> None:
    """Take the job of a killed driver over: put its executors' registrations back in a store that died
    with it, adopt the executors it started that still live, and start again those that died."""
    previous = driver.previous
    assert previous is not None  # only a driver that found a killed one's record takes over
    driver.events.write("takeover", job=driver.job, previous_pid=previous["identity"]["pid"])
    known = registrations(driver.run_dir)
    driver.registered.update((info["node"], info) for info in known)  # joined before: no new event
    if driver.store.add("registered", 0) == 0:
        driver.store.add("registered", len(known))
        for ticket, info in enumerate(known):
            driver.store.put(f"node/{ticket}", info)
    blocked = read_blocklist(driver.run_dir)
    for node, identity in previous["executors"].items():
        if is_alive(identity):
            driver.executors[node] = AdoptedProcess(identity)
        elif node not in blocked:
            driver._start_executor(int(node.rsplit("-", 1)[1]))
    driver._write_record()


def resume_point(driver: Driver) -> tuple[int, list[str], bool]:
    """(attempt, its nodes, whether it runs already) for a job taken over: the attempt its executors still
    run (watched on, no step lost), else the next one, from the newest checkpoint."""
    last = last_attempt(driver.run_dir)
    if last is None:  # the killed driver had started none
        return 0, driver.wait_for_nodes()[: driver.res.nodes], False
    attempt, nodes = last["attempt"], last["nodes"]
    deadline = time.time() + driver.res.heartbeat_timeout_s  # executors reconnect within their interval
    while True:
        driver.discover()
        beats = [driver._beat(node) for node in nodes]
        if all(beat and beat.get("attempt") == attempt and beat["state"] != "idle" for beat in beats):
            driver.attempt_started = last["time"]
            driver.events.write("adopted", attempt=attempt, nodes=nodes)
            return attempt, nodes, True
        if time.time() > deadline:
            break
        time.sleep(min(0.2, driver.res.heartbeat_interval_s))
    # Not every node runs it (the killed driver was stopping it, or starting the next): the next one,
    # numbered after any a node may have been told to start.
    live = [node for node in nodes if not driver.executor_gone(node)]
    driver.stop_nodes(live)
    driver.wait_for_snapshots(live)
    driver.events.write("stopped", attempt=attempt, nodes=nodes)
    attempt = max([attempt, *(beat.get("attempt") or 0 for beat in beats if beat)]) + 1
    driver.events.write("restart", attempt=attempt, checkpoint_step=driver._verified_checkpoint_step())
    return attempt, driver.wait_for_nodes()[: driver.res.nodes], False
