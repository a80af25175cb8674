"""The console side of a run: a live `rich` progress bar with the latest metrics, and log lines above it.

On a terminal the bar redraws in place; elsewhere (CI, a log file, `--metrics.progress=false`) each logged
step is a plain line, so logs stay greppable.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

log = logging.getLogger("megascale")


class PlainStderrHandler(logging.Handler):
    """One unwrapped line per record on whatever sys.stderr is at the time (not a captured old stream)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 (logging must never raise into training)
            self.handleError(record)


def setup_logging(
    run_dir: Path | None, console: Console, debug: bool = False, rank: int = 0, filename: str = "train.log"
) -> None:
    """megascale's log lines to the console (through rich) and to <run_dir>/<filename>.

    In a multi-process job rank 0 speaks for the job; every other rank prints only its warnings and
    errors, prefixed with its rank, so that N ranks do not repeat every line N times."""
    log.setLevel(logging.DEBUG if debug else logging.INFO)
    log.propagate = False
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    if rank != 0:
        plain = PlainStderrHandler(level=logging.DEBUG if debug else logging.WARNING)
        plain.setFormatter(logging.Formatter(f"[%(asctime)s rank {rank}] %(message)s", datefmt="%H:%M:%S"))
        log.addHandler(plain)
        return
    if console.is_terminal:
        log.addHandler(
            RichHandler(
                console=console, show_path=False, show_level=False, markup=False, log_time_format="[%X]"
            )
        )
    else:
        plain = PlainStderrHandler()
        plain.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S"))
        log.addHandler(plain)
    if run_dir is not None:
        file_handler = logging.FileHandler(run_dir / filename)
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(file_handler)


def log_to_files(line: str) -> None:
    """`line` (an error) into the log files of megascale's logger only: the console has it already from the
    CLI, and the run directory should say how its run ended."""
    for handler in log.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, line, (), None))


def make_console() -> Console:
    """A console on stderr (resolved at each write, so a replaced sys.stderr is honoured); stdout stays
    free for what a command outputs."""
    return Console(stderr=True)


class TrainingProgress:
    """A step counter with ETA and the newest metrics; a no-op bar when live display is off. The bar ends
    at `end_step`, the step this run stops at (`training.stop_at_step` where set, else `training.steps`),
    so the ETA is to that step."""

    def __init__(self, console: Console, end_step: int, start_step: int, live: bool):
        self.live = live and console.is_terminal
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
            disable=not self.live,
        )
        self._task = self._progress.add_task("train", total=end_step, completed=start_step, status="")

    def __enter__(self) -> TrainingProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, step: int, status: str | None = None) -> None:
        fields: dict[str, Any] = {"status": status} if status is not None else {}
        self._progress.update(self._task, completed=step, **fields)
