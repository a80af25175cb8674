"""The blocklist of evicted nodes a job's driver keeps in its run directory: it outlives the driver, so
that a new one never reuses an evicted node (`megascale evict` adds to it by hand). The driver's other
record, the events log, is observe/events.py's."""

from __future__ import annotations

import json
import os
from pathlib import Path

BLOCKLIST = "blocklist.json"


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
