"""The events log of a job's driver: every decision, with its time, one JSON line each
(`<run_dir>/events.jsonl`). The driver writes it; the report, the rehearsal and the tests read it."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("megascale.driver")

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
