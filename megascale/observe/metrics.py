"""Scalar metrics to metrics.jsonl, TensorBoard event files and Weights & Biases, one record per logged step.

JSONL is what our own tools (report, tests, the resilience driver) read; TensorBoard and W&B are what users
already watch (W&B optional: wandb_sink.py). The files are appended to, so a resumed run continues them;
TensorBoard is told the resumed step so its curves do not fold back.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Protocol


class ScalarSink(Protocol):
    """Where a step's numbers go besides the files (wandb_sink.py's WandbSink)."""

    def write(self, step: int, numbers: dict[str, int | float]) -> None: ...

    def close(self) -> None: ...


class MetricsWriter:
    """Appends {"step": ..., "time": ..., **scalars} records; closes its files on `close()`."""

    def __init__(
        self,
        run_dir: Path,
        *,
        jsonl: bool,
        tensorboard: bool,
        purge_step: int | None = None,
        wandb: ScalarSink | None = None,
    ):
        """`purge_step`: the first step this run will write; records from it on that an earlier run left
        (it went past its last checkpoint, or the directory was run afresh) are dropped first, so each
        step appears once in the files."""
        self._wandb = wandb
        path = run_dir / "metrics.jsonl"
        if jsonl and purge_step is not None:
            _drop_records_from(path, purge_step)
        self._jsonl = open(path, "a") if jsonl else None  # noqa: SIM115 (closed in close)
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
        numbers = {
            key: value
            for key, value in scalars.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        if self._tensorboard is not None:
            for key, value in numbers.items():
                self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.write(step, numbers)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.close()


def _drop_records_from(path: Path, step: int) -> None:
    """Rewrite `path` (atomically) without its records of `step` and later, if it has any."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) < step]
    if len(kept) == len(lines):
        return
    partial = path.with_name(path.name + ".tmp")
    partial.write_text("".join(kept))
    partial.replace(path)


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
