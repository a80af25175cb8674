"""Scalar metrics to metrics.jsonl and TensorBoard event files, one record per logged step.

JSONL is what our own tools (report, tests, the resilience driver) read; TensorBoard is what users already
watch. Both are appended to, so a resumed run continues the same files; TensorBoard is told the resumed
step so its curves do not fold back.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends {"step": ..., "time": ..., **scalars} records; closes its files on `close()`."""

    def __init__(self, run_dir: Path, *, jsonl: bool, tensorboard: bool, purge_step: int | None = None):
        self._jsonl = open(run_dir / "metrics.jsonl", "a") if jsonl else None  # noqa: SIM115 (closed in close)
        self._tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imported lazily: it loads TensorBoard

            self._tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)

    def write(self, step: int, scalars: dict[str, Any]) -> None:
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({k: _jsonable(v) for k, v in scalars.items()})
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tensorboard is not None:
            for key, value in scalars.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run's metrics.jsonl, in order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
