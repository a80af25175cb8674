"""The driver's detectors over heartbeat readings: each takes what the heartbeats carry and says whether,
and why, something is wrong. Pure (no store, no clock of their own), so each is tested on a made-up series.

Process exit, a lost heartbeat and a stalled step counter are checked in the driver's loop itself; these
are the ones that need a window of history (paper §4.2: loss, step time and communication counters are
among what the executors report, and "abnormal" ones start the recovery workflow).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any


def nonfinite_steps(reports: dict[str, dict[str, Any]], ranks: int) -> dict[int, list[int]]:
    """Non-finite steps that every one of `ranks` has got past, each with the ranks that saw it.

    Waiting until all have reported past it makes the list of ranks complete (reports are sticky:
    `last_nonfinite_step` stays in every later report of a rank)."""
    if len(reports) < ranks:
        return {}
    oldest = min(report["step"] for report in reports.values())
    seen: dict[int, list[int]] = {}
    for rank, report in reports.items():
        step = report.get("last_nonfinite_step")
        if step is not None and step <= oldest:
            seen.setdefault(step, []).append(int(rank))
    return {step: sorted(found) for step, found in seen.items()}


@dataclass
class LossSpike:
    """A loss more than `z` standard deviations above the mean of the last `window` readings.

    Judged only once half the window is filled, and never on a flat history (no spread to measure
    against). A spike is not added to the history, so a run of them is reported each time."""

    z: float
    window: int
    history: deque = field(init=False)

    def __post_init__(self) -> None:
        self.history = deque(maxlen=self.window)

    def observe(self, step: int, loss: float) -> dict[str, Any] | None:
        finding = None
        if self.z > 0 and len(self.history) >= max(2, self.window // 2):
            mean, spread = statistics.fmean(self.history), statistics.pstdev(self.history)
            if spread > 0 and (loss - mean) / spread > self.z:
                finding = {
                    "step": step,
                    "loss": loss,
                    "mean": mean,
                    "std": spread,
                    "z": (loss - mean) / spread,
                }
        if finding is None:
            self.history.append(loss)
        return finding


@dataclass
class StepTimeCollapse:
    """Step times more than `factor` x the median of the last `window` readings, `persist` readings in a
    row (one slow step is a checkpoint or a validation, not a degraded node). Slow readings stay out of
    the history, so a node that stays slow keeps being compared with its healthy past."""

    factor: float
    window: int
    persist: int = 3
    history: deque = field(init=False)
    slow_in_a_row: int = 0

    def __post_init__(self) -> None:
        self.history = deque(maxlen=self.window)

    def observe(self, step: int, step_time_s: float) -> dict[str, Any] | None:
        if self.factor > 0 and len(self.history) >= max(2, self.window // 2):
            median = statistics.median(self.history)
            if step_time_s > self.factor * median:
                self.slow_in_a_row += 1
                if self.slow_in_a_row == self.persist:
                    return {"step": step, "step_time_s": step_time_s, "median_s": median}
                return None
        self.slow_in_a_row = 0
        self.history.append(step_time_s)
        return None


@dataclass
class FlatCounter:
    """How long a counter (the workers' bytes through their sockets and files) has not moved."""

    value: int | None = None
    since: float = 0.0

    def observe(self, now: float, value: int) -> float:
        if value != self.value:
            self.value, self.since = value, now
        return now - self.since
