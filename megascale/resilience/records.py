"""What a job's driver keeps in its run directory: the events log (every decision, with its time) and the
blocklist of evicted nodes, which outlives the driver so that a new one never reuses an evicted node. The
report, `megascale evict` and the tests read them here without a driver."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("megascale.driver")

BLOCKLIST = "blocklist.json"
EVENTS = "events.jsonl"


class EventLog:
    """Append-only JSON lines: {"time": unix seconds, "event": name, ...}; each also logged."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / EVENTS

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, **fields}
        details = ", ".join(f"{key} {value}" for key, value in fields.items())
        try:
            with open(self.path, "a") as file:
                file.write(json.dumps(record) + "\n")
        except OSError as err:  # a full disk must not end the driver: the console and driver.log still say it
            log.error("%s%s (not in %s: %s)", event, f": {details}" if details else "", self.path, err)
            return record
        log.info("%s%s", event, f": {details}" if details else "")
        return record


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """The events so far; a line the driver was still writing (it died mid-line) is left out."""
    path = Path(run_dir) / EVENTS
    events = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def read_blocklist(run_dir: Path) -> list[str]:
    path = Path(run_dir) / BLOCKLIST
    return json.loads(path.read_text()) if path.exists() else []


def evict(run_dir: Path, node: str) -> list[str]:
    """Add `node` to the job's blocklist (`megascale evict`); returns the list."""
    nodes = read_blocklist(run_dir)
    if node not in nodes:
        nodes.append(node)
        staged = Path(run_dir) / f".{BLOCKLIST}.tmp"
        staged.write_text(json.dumps(nodes))
        os.replace(staged, Path(run_dir) / BLOCKLIST)
    return nodes
