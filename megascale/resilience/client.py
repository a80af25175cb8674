"""What a training process tells its executor: its progress, one small JSON file per rank, every step.

The executor's heartbeat reads these files (node-local, so no network and no store client in the hot
loop). Written by rename, so a reader never sees half a file. Off unless the executor set
MEGASCALE_HEARTBEAT_DIR.

A warm standby (the executor set MEGASCALE_STANDBY) is a training process started ahead of a fault: it
builds everything a rank needs (process groups, data, model), says so in a `standby-<rank>.json` file,
and waits at `wait_until_activated` until the executor creates the file MEGASCALE_STANDBY names, having
killed the attempt the standby replaces; it then resumes from the newest snapshot in memory.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

HEARTBEAT_DIR = "MEGASCALE_HEARTBEAT_DIR"
STANDBY = "MEGASCALE_STANDBY"  # the file whose appearance activates a warm standby
# A standby follows its node's executor through the record every executor writes (executor.json, naming
# itself): a killed executor's successor adopts the standby, and a standby that sees no live executor
# there for the grace (the driver's heartbeat_timeout_s + startup_timeout_s: time to notice the death and
# start a successor) exits.
EXECUTOR_RECORD = "MEGASCALE_EXECUTOR_RECORD"
EXECUTOR_GRACE = "MEGASCALE_EXECUTOR_GRACE_S"
POLL_S = 0.01  # how often a standby looks for its activation


class ProgressReporter:
    def __init__(self, rank: int, directory: str | None = None):
        directory = directory or os.environ.get(HEARTBEAT_DIR)
        self.path = Path(directory) / f"rank-{rank}.json" if directory else None
        self.last: dict[str, Any] | None = None  # the newest report's contents

    def report(self, step: int, **metrics: Any) -> None:
        if self.path is None:
            return
        staged = self.path.with_suffix(".tmp")
        staged.write_text(json.dumps({"step": step, "time": time.time(), "pid": os.getpid(), **metrics}))
        os.replace(staged, self.path)
        self.last = {"step": step, **metrics}

    def finish(self) -> None:
        """The training loop ended by itself (done, or stopped and saved): this process's exit that
        follows is no fault. Marks the newest report."""
        if self.last is not None:
            self.report(**{**self.last, "finished": True})


class ExecutorGone(RuntimeError):
    """A standby's executor died before activating it: nothing will, and nothing may train unwatched."""


def is_standby() -> bool:
    """Whether this process was started as a warm standby."""
    return bool(os.environ.get(STANDBY))


def wait_until_activated(rank: int) -> bool:
    """Block while this process is a warm standby (MEGASCALE_STANDBY set), once it has said it is ready;
    True when it was one and has been activated, False when it never was one. Raises ExecutorGone when
    no live executor has been on its node for the grace (its executor died and none adopted it)."""
    go = os.environ.get(STANDBY)
    if not go:
        return False
    ready = Path(go).parent / f"standby-{rank}.json"
    staged = ready.with_suffix(".tmp")
    staged.write_text(json.dumps({"rank": rank, "pid": os.getpid(), "time": time.time()}))
    os.replace(staged, ready)
    record = os.environ.get(EXECUTOR_RECORD)
    grace_s = float(os.environ.get(EXECUTOR_GRACE, "0"))
    checked = time.monotonic()
    alone_since: float | None = None  # since when no live executor has been on the node
    while not os.path.exists(go):
        time.sleep(POLL_S)
        if record and time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            if executor_alive(Path(record)):
                alone_since = None
            elif alone_since is None:
                alone_since = checked
            elif checked - alone_since > grace_s:
                raise ExecutorGone(
                    f"standby rank {rank}: no executor on its node for {grace_s:.0f} s ({record})"
                )
    return True


def executor_alive(record: Path) -> bool:
    """Whether the executor that last wrote the node's record (`executor.json`) is alive."""
    from megascale.checkpoint.staging import is_alive

    try:
        identity = json.loads(record.read_text()).get("executor")
    except (OSError, ValueError):
        return False  # none yet, or the node is done with the job
    return bool(identity) and is_alive(identity)


def standby_ranks_ready(directory: Path) -> list[int]:
    """The ranks of the standby in `directory` (an attempt's) that are ready to take over."""
    return sorted(int(path.stem.split("-")[1]) for path in directory.glob("standby-*.json"))


def report_input_error(message: str) -> None:
    """Tell the executor this process ends on an error in the job's input (config, data, checkpoint): a
    restart would meet it again, so the driver ends the job at once with `message`. Nothing without one."""
    directory = os.environ.get(HEARTBEAT_DIR)
    if directory:
        rank = os.environ.get("RANK", "0")
        staged = Path(directory) / f"input-error-{rank}.tmp"
        staged.write_text(json.dumps({"rank": int(rank), "message": message}))
        os.replace(staged, staged.with_suffix(".json"))


def read_input_errors(directory: Path) -> list[dict[str, Any]]:
    """What `report_input_error` left in `directory`, lowest rank first."""
    errors = []
    for path in directory.glob("input-error-*.json"):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(errors, key=lambda error: error["rank"])


def read_progress(directory: Path) -> dict[int, dict[str, Any]]:
    """Every rank's newest report in `directory`, by rank."""
    reports = {}
    for path in directory.glob("rank-*.json"):
        try:
            reports[int(path.stem.split("-")[1])] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced while reading: the next heartbeat has it
    return reports


def attempt_reports(run_dir: Path, attempt: int) -> dict[int, dict[str, Any]]:
    """Every rank's newest report of `attempt`, over all the run's nodes (`<run_dir>/nodes/*/attempt-N`)."""
    reports = {}
    for directory in Path(run_dir).glob(f"nodes/*/attempt-{attempt}"):
        reports.update(read_progress(directory))
    return reports
