"""How busy this machine's cores are, and how much of their time the hypervisor took: Linux's /proc/stat.

A virtual machine shares its host's cores with other guests. Time "stolen" for them (the `steal` column)
slows every measurement taken meanwhile, though nothing here ran slower: on this project's VM it swings
from 0 to 40% within seconds, and a step measured in such a second takes 1.5-2x as long. Calibration and
the test that checks the planner's predictions read it, so that they measure this machine rather than its
neighbours. Elsewhere (no /proc/stat) every figure is 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class CpuTimes:
    """All cores' cumulative time in clock ticks: in total, idle (with I/O wait), and stolen."""

    total: int
    idle: int
    steal: int


def cpu_times() -> CpuTimes:
    if not PROC_STAT.is_file():
        return CpuTimes(0, 0, 0)
    # cpu  user nice system idle iowait irq softirq steal guest guest_nice
    fields = [int(value) for value in PROC_STAT.read_text().split("\n", 1)[0].split()[1:]]
    steal = fields[7] if len(fields) > 7 else 0
    # guest time is counted in user time already
    return CpuTimes(total=sum(fields[:8]), idle=fields[3] + fields[4], steal=steal)


def busy_fraction(before: CpuTimes, after: CpuTimes) -> float:
    """The share of the cores' time between two readings that was neither idle nor stolen."""
    total = after.total - before.total
    return (total - (after.idle - before.idle) - (after.steal - before.steal)) / total if total > 0 else 0.0


def steal_fraction(before: CpuTimes, after: CpuTimes) -> float:
    """The share of the cores' time between two readings that the hypervisor gave to other guests."""
    total = after.total - before.total
    return (after.steal - before.steal) / total if total > 0 else 0.0


class CpuSampler:
    """Reads cpu_times() every `interval_s` in a thread, so that a window known only afterwards (the steps
    a training run logged, by their wall-clock times) can be looked up: `steal_between(start, end)`."""

    def __init__(self, interval_s: float = 0.25):
        self.interval_s = interval_s
        self.samples: list[tuple[float, CpuTimes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megascale-cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), cpu_times()))
            if self._stop.wait(self.interval_s):
                self.samples.append((time.time(), cpu_times()))
                return

    def steal_between(self, start: float, end: float) -> float:
        """The steal fraction from the last reading at or before `start` to the first at or after `end`
        (the whole sampled span, where the window reaches beyond it)."""
        if not self.samples:
            return 0.0
        before = max((s for s in self.samples if s[0] <= start), default=self.samples[0], key=lambda s: s[0])
        after = min((s for s in self.samples if s[0] >= end), default=self.samples[-1], key=lambda s: s[0])
        return steal_fraction(before[1], after[1])

    def steal_over_steps(self, records: list[dict]) -> float:
        """The steal fraction over the training steps these metrics records (metrics.jsonl: each step's end
        `time` and its `step_time_s`) time, from the first one's start to the last one's end."""
        return self.steal_between(records[0]["time"] - records[0]["step_time_s"], records[-1]["time"])


def least_disturbed(
    measure: Callable[[], T], steal_of: Callable[[T], float], wanted: int, most: int, quiet: float
) -> tuple[list[T], int]:
    """The `wanted` least disturbed of repeated measurements, and how many were made: `measure()` is
    called until `wanted` of them lost at most `quiet` of the CPU time to the hypervisor (`steal_of`), or
    `most` calls in all."""
    calm: list[T] = []
    disturbed: list[T] = []
    while len(calm) < wanted and len(calm) + len(disturbed) < most:
        measured = measure()
        (calm if steal_of(measured) <= quiet else disturbed).append(measured)
    return (calm + sorted(disturbed, key=steal_of))[:wanted], len(calm) + len(disturbed)
