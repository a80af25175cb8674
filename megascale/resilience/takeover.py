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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megascale.checkpoint.staging import is_alive, process_identity
from megascale.config import ResilienceConfig
from megascale.errors import ConfigError
from megascale.observe.events import EventLog, read_events
from megascale.resilience.lifecycle import ExecutorLifecycle, Heartbeats
from megascale.resilience.records import read_blocklist

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


class Takeover(Heartbeats, ExecutorLifecycle, Protocol):
    """What taking a job over needs of the new driver (driver.py's Driver): its nodes' heartbeats and
    executors, their registrations, stopping them, and the newest checkpoint a restart would read."""

    job: str
    run_dir: Path
    res: ResilienceConfig
    events: EventLog

    def restore_registrations(self, known: list[dict[str, Any]]) -> None: ...
    def discover(self) -> None: ...
    def wait_for_nodes(self) -> list[str]: ...
    def stop_nodes(self, nodes: list[str]) -> None: ...
    def wait_for_snapshots(self, nodes: list[str]) -> None: ...
    def verified_checkpoint_step(self) -> int: ...


@dataclass(frozen=True)
class ResumePoint:
    """Where a job taken over goes on: `attempt` on `nodes`, which runs since `started` (time.time()), or,
    with `started` None, is to be started."""

    attempt: int
    nodes: list[str]
    started: float | None


def adopt(job: Takeover, previous: dict[str, Any]) -> None:
    """Take the job of a killed driver (its record: `previous`) over: put its executors' registrations
    back in a store that died with it, adopt the executors it started that still live, and start again
    those that died."""
    job.events.write("takeover", job=job.job, previous_pid=previous["identity"]["pid"])
    job.restore_registrations(registrations(job.run_dir))
    blocked = read_blocklist(job.run_dir)
    for node, identity in previous["executors"].items():
        if is_alive(identity):
            job.adopt_executor(node, identity)
        elif node not in blocked:
            job.start_executor(node)


def resume_point(job: Takeover) -> ResumePoint:
    """For a job taken over: the attempt its executors still run (watched on, no step lost), else the
    next one, from the newest checkpoint."""
    last = last_attempt(job.run_dir)
    if last is None:  # the killed driver had started none
        return ResumePoint(0, job.wait_for_nodes()[: job.res.nodes], None)
    attempt, nodes = last["attempt"], last["nodes"]
    deadline = time.time() + job.res.heartbeat_timeout_s  # executors reconnect within their interval
    while True:
        job.discover()
        beats = [job.heartbeat(node) for node in nodes]
        if all(beat and beat.get("attempt") == attempt and beat["state"] != "idle" for beat in beats):
            job.events.write("adopted", attempt=attempt, nodes=nodes)
            return ResumePoint(attempt, nodes, last["time"])
        if time.time() > deadline:
            break
        time.sleep(min(0.2, job.res.heartbeat_interval_s))
    # Not every node runs it (the killed driver was stopping it, or starting the next): the next one,
    # numbered after any a node may have been told to start.
    live = [node for node in nodes if not job.executor_gone(node)]
    job.stop_nodes(live)
    job.wait_for_snapshots(live)
    job.events.write("stopped", attempt=attempt, nodes=nodes)
    attempt = max([attempt, *(beat.get("attempt") or 0 for beat in beats if beat)]) + 1
    job.events.write("restart", attempt=attempt, checkpoint_step=job.verified_checkpoint_step())
    return ResumePoint(attempt, job.wait_for_nodes()[: job.res.nodes], None)
