"""Python's garbage collector, run at the same step on every rank instead of whenever it likes.

A collection pauses the process for as long as it takes to walk its objects. In synchronous training a
pause on one rank is a pause for all (they wait for it in the next collective), and pauses that land on
different ranks at different steps add up: MegaScale traced part of an MFU decline to irregular collections
skewing when ranks reached the gradient reduce-scatter (paper §6.3). So automatic collection is turned
off for the training loop and every rank collects the young generations at the same steps, where the
pause is short and paid once. The oldest generation, whose walk is the long pause in a job with a large
Python heap, is collected once before training and not again during it (as torchtitan does): what it
would free is cyclic garbage that survived two collections, rare in a training loop.
"""

from __future__ import annotations

import gc
from types import TracebackType


class AlignedGC:
    """`with AlignedGC(every):` automatic collection off inside; `maybe_collect(step)` collects every
    `every` steps. `every = 0` leaves Python's collector as it is."""

    def __init__(self, every: int):
        self.every = every
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> AlignedGC:
        if self.every:
            gc.collect()
            gc.disable()
        return self

    def __exit__(
        self, kind: type | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.every and self._was_enabled:
            gc.enable()

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    @staticmethod
    def collect() -> None:
        gc.collect(generation=1)
