"""The next step's batches prepared while this step runs: one background thread ahead of the trainer.

MegaScale prepares the next batch while the current step's gradients synchronise, so a step never starts
by waiting for data (paper §3.4). A `Prefetcher` runs a daemon thread that calls `produce(position)` for
the stream positions after the one the trainer last took and keeps the results in a bounded queue; the
trainer takes them in order, so a step's fetch finds them ready.

Why a thread and not torch's DataLoader worker processes:
- the work is a memmap slice copied into an int64 array, with a few lines of Python around it: numpy
  makes such copies without holding the GIL (above 500 elements; a sequence of 256 tokens is copied
  holding it, for microseconds from the page cache), and the step's torch kernels release the GIL too.
  A thread runs it beside the step with nothing pickled and no process started, where a worker process
  would cost an `import torch` and send every batch back through a queue of shared-memory tensors;
- the state must stay exact: a DataLoader's sampler runs ahead of the trainer by its prefetch depth, so
  its position is not the trainer's (torchdata's StatefulDataLoader exists to repair that). Here batches
  are pure functions of a stream position, the thread is only told where to start, and the loader's
  state is the position after the last batch the trainer *took*: a checkpoint never counts a prefetched
  batch.

Every item carries the position it was made for. `take(position)` returns it, or, when the position is
not the next one the thread made (a `load_state_dict` moved the stream), discards what was prepared and
starts over from there. An exception in the thread reaches the taker and is raised there: the same
object, with its message and traceback. A prefetcher that is dropped without `stop()` ends its thread.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from megascale.errors import DataError

T = TypeVar("T")

POLL_S = 0.05  # how often a waiting thread looks at the stop flag
JOIN_TIMEOUT_S = 30.0  # a produce call in flight when stopping must finish within this


class Stopped(Exception):
    """Raised inside `produce` by a wait that saw the stop flag; the prefetcher drops it."""


class Prefetcher(Generic[T]):
    """Keeps up to `depth` items ahead of the taker, made by `produce(position)` in a daemon thread for
    positions start, start + stride, ...

    `stop` is the flag the thread's waits watch; pass the one the producer's own blocking waits watch
    (see node_share.py), so that stopping interrupts them too. `produce` must not hold a reference to the
    owner of this prefetcher, or dropping the owner could not end the thread.
    """

    def __init__(
        self,
        produce: Callable[[int], T],
        stride: int,
        depth: int,
        *,
        stop: threading.Event | None = None,
        name: str = "megascale-prefetch",
    ):
        if depth < 1 or stride < 1:
            raise ValueError(f"prefetch: depth = {depth} and stride = {stride} must both be >= 1")
        self.produce, self.stride, self.depth, self.name = produce, stride, depth, name
        self.stop_flag = stop or threading.Event()
        self._thread: threading.Thread | None = None
        self._items: queue.Queue | None = None
        self._next_position: int | None = None  # the position of the next item the queue will give
        weakref.finalize(self, self.stop_flag.set)  # a dropped prefetcher ends its thread

    @property
    def running(self) -> bool:
        return self._thread is not None

    def take(
        self, position: int, timeout_s: float | None = None, waiting_for: Callable[[], str] | None = None
    ) -> T:
        """The item for `position`, prepared ahead where possible; blocks until it is ready, at most
        `timeout_s` (None: no limit) before a DataError saying what the thread waits for."""
        if self._thread is None or position != self._next_position:
            self._start(position)
        assert self._items is not None and self._thread is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                item_position, value, error = self._items.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive():  # it always hands over its error first; this is a bug
                    self._thread = None
                    raise RuntimeError(f"{self.name}: the thread ended without an item or an error") from None
                if deadline is not None and time.monotonic() > deadline:
                    what = waiting_for() if waiting_for else "its source"
                    raise DataError(
                        f"data: no batch for stream position {position} after {timeout_s:.0f} s; the "
                        f"prefetch thread is waiting for {what}"
                    ) from None
        if error is not None:
            self._thread.join(timeout=JOIN_TIMEOUT_S)  # it ends after handing over its error
            self._thread = self._items = None
            raise error
        assert item_position == position, (item_position, position)
        self._next_position = position + self.stride
        return value

    def stop(self) -> None:
        """Discard what was prepared and end the thread (a later `take` starts a new one)."""
        if self._thread is None:
            return
        self.stop_flag.set()
        self._thread.join(timeout=JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            raise DataError(
                f"data: the prefetch thread did not stop within {JOIN_TIMEOUT_S:.0f} s (a batch read is "
                "stuck); the process must be restarted"
            )
        self._thread = self._items = self._next_position = None
        self.stop_flag.clear()

    def _start(self, position: int) -> None:
        self.stop()
        self._items = queue.Queue(maxsize=self.depth)
        self._next_position = position
        self._thread = threading.Thread(
            target=_prepare,
            args=(self.produce, position, self.stride, self._items, self.stop_flag),
            name=self.name,
            daemon=True,  # a process that exits without stop() is not held up by it
        )
        self._thread.start()


def _prepare(
    produce: Callable[[int], object],
    position: int,
    stride: int,
    items: queue.Queue,
    stop: threading.Event,
) -> None:
    """The thread: produce items from `position` on until stopped or an error was handed over."""
    while not stop.is_set():
        item: tuple[int, object, Exception | None]
        try:
            item = (position, produce(position), None)
        except Exception as error:  # noqa: BLE001 (handed to the taker, raised in its thread)
            item = (position, None, error)
        while not stop.is_set():
            try:
                items.put(item, timeout=POLL_S)
                break
            except queue.Full:
                continue
        if item[2] is not None:
            return
        position += stride
