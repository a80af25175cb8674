"""What a training process tells its executor: its progress, one small JSON file per rank, every step.

The executor's heartbeat reads these files (node-local, so no network and no store client in the hot
loop). Written by rename, so a reader never sees half a file. Off unless the executor set
MEGASCALE_HEARTBEAT_DIR.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

HEARTBEAT_DIR = "MEGASCALE_HEARTBEAT_DIR"


class ProgressReporter:
    def __init__(self, rank: int, directory: str | None = None):
        directory = directory or os.environ.get(HEARTBEAT_DIR)
        self.path = Path(directory) / f"rank-{rank}.json" if directory else None

    def report(self, step: int, **metrics: Any) -> None:
        if self.path is None:
            return
        staged = self.path.with_suffix(".tmp")
        staged.write_text(json.dumps({"step": step, "time": time.time(), "pid": os.getpid(), **metrics}))
        os.replace(staged, self.path)


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
