"""The run's record of its checkpoint commits, kept in the run directory, away from the checkpoints.

A run that finds no checkpoint starts from step 0; that is right for a new run and a disaster for one
whose checkpoints were deleted, lost with a volume or written to a bucket since emptied: weeks of
training restarted without a word. The checkpoints cannot tell which case it is (they are gone), so each
commit is also appended here (`checkpoints.jsonl`: step, location, time), and a start from scratch is
marked too. A run whose ledger shows a commit since its last start under the checkpoint root it resumes
from, and finds none there, refuses to start over unless told to (`checkpoint.resume = false`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from megascale.errors import CheckpointError

LEDGER = "checkpoints.jsonl"

log = logging.getLogger("megascale.checkpoint")


def _append(ledger: Path, record: dict[str, Any]) -> None:
    try:
        with open(ledger, "a") as file:
            file.write(json.dumps({"time": time.time(), **record}) + "\n")
    except OSError as err:  # the checkpoint itself is committed; only its record is missing
        log.warning("checkpoint: could not record %s in %s: %s", record, ledger, err)


def record_commit(ledger: str | Path | None, step: int, location: str) -> None:
    if ledger is not None:
        _append(Path(ledger), {"event": "commit", "step": step, "location": location})


def record_start(ledger: Path, root: str) -> None:
    """A run starts from scratch with its checkpoints under `root`: earlier commits there are history."""
    _append(ledger, {"event": "start", "root": root})


def commits_since_start(ledger: Path, root: str) -> list[dict[str, Any]]:
    """The commits under `root` recorded since the run last started from scratch there."""
    prefix = root.rstrip("/") + "/"
    found: list[dict[str, Any]] = []
    lines = ledger.read_text().splitlines() if ledger.exists() else []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if record.get("event") == "start" and record.get("root") == root:
            found = []
        elif record.get("event") == "commit" and str(record.get("location", "")).startswith(prefix):
            found.append(record)
    return found


def check_not_lost(ledger: Path, root: str) -> None:
    """Refuse to start a run from scratch whose ledger says it had committed checkpoints under `root`."""
    commits = commits_since_start(ledger, root)
    if commits:
        newest = max(commits, key=lambda record: record["step"])
        raise CheckpointError(
            f"checkpoint: every checkpoint of this run is gone: step {newest['step']} was committed to "
            f"{newest['location']} ({ledger}), and none is under {root} now; restore them, or start the "
            "run from scratch with --checkpoint.resume=false"
        )
