"""What a benchmark saves: its figures, how they were made, on what machine and when, as one JSON file."""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch


def save_record(path: Path, figures: dict[str, Any], setup: dict[str, Any]) -> None:
    """Write `figures` and `setup` to `path` with the machine and the time (UTC) they were measured on."""
    record = {
        "figures": figures,
        "setup": setup,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__},
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
