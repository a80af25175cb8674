"""Each rank's timeline: spans of the step's phases and of its communication, as Chrome trace events.

MegaScale explains lost MFU and finds stragglers from a timeline of every rank (paper §5.1). torch's
profiler records one too, but costs too much to leave on for a whole run, and its flight recorder keeps
no durations on gloo; so spans are recorded here, cheaply enough to be always on (bench/observe_overhead.py).
The training thread records its phases (`span`: data, forward and backward per micro-batch and model
chunk, clip, optimizer, checkpoint stage 1); `observe/collectives.py` adds every collective and every wait
for one. A span costs two clock reads and a deque append; a background thread turns them into JSON and
appends them to `<run_dir>/traces/<session>/rank-RRRRR.json` every second, so a crash loses at most that.

The file is a trace-event JSON array (Perfetto and chrome://tracing open it; the closing bracket is
written at the end, and the format allows it missing after a crash). Timestamps count from a barrier all
ranks left together at start (`sync_clock`), so the ranks' files line up without further work;
`megascale trace merge` puts them in one file with the tracks grouped by pipeline stage, data- and
tensor-parallel rank.

Each track holds spans that never overlap: the training thread's phases (`main`), its waits for
communication (`wait`), and one track per process group and lane for the collectives themselves (from
issue to completion; two in flight at once take two lanes). On an accelerator a span's times would come
from device events (`torch.Event`, resolved by the background thread, never synchronising the hot path);
its cost on one H100 is in docs/gpu.md.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import torch

from megascale.observe.trace import TRACES

MAIN, WAIT = "main", "wait"
# Which phases are compute, for the step's breakdown (communication waits inside them are taken out).
COMPUTE = ("forward", "backward", "backward_weight", "clip", "optimizer")


class _Span:
    __slots__ = ("timeline", "name", "track", "args", "start", "cpu_start")
    counts_cpu_time = True  # on CPU the compute phases' CPU time is what ranks are compared by

    def __init__(self, timeline: Timeline, name: str, track: str, args: dict[str, Any]):
        self.timeline, self.name, self.track, self.args = timeline, name, track, args

    def __enter__(self) -> Self:
        if self.track == MAIN:
            self.timeline.phase = self.name
            if self.name in COMPUTE:
                self.timeline.computing += 1
                if self.counts_cpu_time:
                    self.cpu_start = time.thread_time()
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        end = time.perf_counter_ns()
        if self.track == MAIN:
            self.timeline.phase = None
            if self.name in COMPUTE:
                self.timeline.computing -= 1
                if self.counts_cpu_time:
                    self.timeline.step.compute_cpu += time.thread_time() - self.cpu_start
        self.timeline.add(self.name, self.track, self.start, end, self.args)


class _DeviceSpan(_Span):
    """On an accelerator: device events around the span's work, read by the flush thread."""

    __slots__ = ("events",)
    counts_cpu_time = False  # the device's time is

    def __enter__(self) -> _DeviceSpan:
        self.events = (torch.Event(enable_timing=True), torch.Event(enable_timing=True))
        self.events[0].record()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.events[1].record()
        self.args = {**self.args, "_events": self.events}
        super().__exit__(*exc)


class _NoSpan:
    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


NO_SPAN = _NoSpan()


class StepTimes:
    """Seconds of one step by kind, summed from the training thread's spans."""

    def __init__(self) -> None:
        self.compute = self.comm = self.bubble = self.waits_in_compute = 0.0
        self.compute_cpu = 0.0  # the training thread's CPU time in compute phases

    @property
    def compute_s(self) -> float:
        return max(0.0, self.compute - self.waits_in_compute)

    def as_metrics(self, step_time_s: float, data_wait_s: float) -> dict[str, float]:
        """Compute (its phases less the waits inside them: FSDP's all-gathers wait in the forward), exposed
        communication, pipeline bubble (waiting for the neighbour stage), and what is left."""
        compute = self.compute_s
        other = max(0.0, step_time_s - compute - self.comm - self.bubble - data_wait_s)
        return {
            "compute_s": round(compute, 6),
            "comm_exposed_s": round(self.comm, 6),
            "bubble_s": round(self.bubble, 6),
            "other_s": round(other, 6),
        }


class Timeline:
    """One rank's recorder; `Timeline.disabled()` records nothing at the cost of an attribute check."""

    def __init__(
        self,
        directory: Path | None,
        rank: int,
        coords: dict[str, int],
        *,
        device: torch.device | None = None,
        flush_every_s: float = 1.0,
    ):
        self.enabled = directory is not None
        self.on_cpu = device is None or device.type == "cpu"
        self._span_class = _Span if self.on_cpu else _DeviceSpan
        self.rank, self.coords = rank, coords
        self.thread = threading.get_ident()  # the training thread: its waits are the step's
        self.computing = 0  # compute spans open on the training thread
        self.phase: str | None = None  # the training thread's open phase, if any (for a hang dump)
        self.steps_begun = 0
        self.origin_ns = time.perf_counter_ns()  # replaced by sync_clock
        self.step = StepTimes()
        self._events: collections.deque = collections.deque()
        self._tracks: dict[str, int] = {}
        self._lanes: dict[str, list[int]] = {}  # end times of each lane of a communication track
        self._lanes_lock = threading.Lock()
        self._closed = threading.Event()
        self._flush_lock = threading.Lock()  # the flush thread and whoever else flushes (close, benchmarks)
        self._file = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self.path = directory / f"rank-{rank:05d}.json"
            self._file = open(self.path, "w")  # noqa: SIM115 (closed by close())
            self._file.write("[\n")
            self._flusher = threading.Thread(
                target=self._flush_loop, args=(flush_every_s,), name="megascale-timeline", daemon=True
            )
            self._flusher.start()

    @classmethod
    def disabled(cls) -> Timeline:
        return cls(None, 0, {})

    # -- recording (hot path) -------------------------------------------------------------------------
    def span(self, name: str, track: str = MAIN, **args: Any) -> _Span | _NoSpan:
        """A context manager recording one span of this thread's work."""
        if not self.enabled:
            return NO_SPAN
        return self._span_class(self, name, track, args)

    def add(self, name: str, track: str, start_ns: int, end_ns: int, args: dict[str, Any]) -> None:
        """Record a finished span (thread-safe); main-thread spans also count towards the step's times."""
        if track == MAIN:
            if name in COMPUTE:
                self.step.compute += (end_ns - start_ns) / 1e9
        elif track == WAIT:
            seconds = (end_ns - start_ns) / 1e9
            if args.get("p2p"):
                self.step.bubble += seconds
            else:
                self.step.comm += seconds
            if self.computing:
                self.step.waits_in_compute += seconds
        if self.enabled:
            self._events.append((name, track, start_ns, end_ns, args))

    def add_in_lane(self, name: str, track: str, start_ns: int, end_ns: int, args: dict[str, Any]) -> None:
        """Record a span on the first lane of `track` free at `start_ns` (spans of one lane never
        overlap); called from communication threads as operations complete."""
        with self._lanes_lock:
            lanes = self._lanes.setdefault(track, [])
            for index, busy_until in enumerate(lanes):
                if busy_until <= start_ns:
                    lanes[index] = end_ns
                    break
            else:
                index = len(lanes)
                lanes.append(end_ns)
        self.add(name, track if index == 0 else f"{track} #{index + 1}", start_ns, end_ns, args)

    @property
    def compute_clock(self) -> Callable[[], float]:
        """What a rank's compute is timed by when ranks are compared (stragglers; a slow rank's stretch)."""
        return time.thread_time if self.on_cpu else time.perf_counter

    def compute_busy_s(self) -> float:
        """This step's compute as ranks are compared for stragglers: the time the device was busy with it.
        On CPU that is the training thread's CPU time in compute phases, not their wall time less waits:
        with more ranks than cores, or a hypervisor taking time for other guests, wall time also counts
        time the CPU spent on someone else, and that alone put an unslowed rank 1.35x above its peers'
        median over 20 steps (4 ranks on 2 cores). With intra-op threads it is the training thread's
        share, which grows and shrinks with the rank's compute. On an accelerator: wall time less waits."""
        return self.step.compute_cpu if self.on_cpu else self.step.compute_s

    def begin_step(self) -> None:
        self.step = StepTimes()
        self.steps_begun += 1

    def wait_track(self) -> str:
        """Where the calling thread's waits for communication go: `wait` for the training thread (they
        count towards its step), a track of their own for others (checkpoint writers, for one)."""
        if threading.get_ident() == self.thread:
            return WAIT
        return f"{WAIT} ({threading.current_thread().name})"

    # -- alignment ------------------------------------------------------------------------------------
    def sync_clock(self, barrier: Any = None, rounds: int = 3) -> None:
        """Count time from the moment every rank leaves a barrier (the last of `rounds`, so that
        connections are made before): the ranks' clocks line up to within a barrier's skew."""
        for _ in range(rounds if barrier is not None else 0):
            barrier()
        self.origin_ns = time.perf_counter_ns()
        self._meta_wall_ns = time.time_ns()
        if self.enabled:
            self._write_metadata()

    # -- writing --------------------------------------------------------------------------------------
    def _write_metadata(self) -> None:
        coords = ", ".join(f"{key} {value}" for key, value in self.coords.items())
        events = [
            {
                "ph": "M",
                "name": "process_name",
                "pid": self.rank,
                "args": {"name": f"rank {self.rank} ({coords})"},
            },
            {"ph": "M", "name": "process_sort_index", "pid": self.rank, "args": {"sort_index": self.rank}},
            {
                "ph": "M",
                "name": "process_labels",
                "pid": self.rank,
                "args": {"labels": coords, "coords": self.coords, "clock_origin_wall_ns": self._meta_wall_ns},
            },
        ]
        self._events.append(("__raw__", events))

    def _track_id(self, track: str, out: list[dict[str, Any]]) -> int:
        if track not in self._tracks:
            self._tracks[track] = len(self._tracks)
            out.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": self.rank,
                    "tid": self._tracks[track],
                    "args": {"name": track},
                }
            )
            out.append(
                {"ph": "M", "name": "thread_sort_index", "pid": self.rank, "tid": self._tracks[track],
                 "args": {"sort_index": self._tracks[track]}}
            )  # fmt: skip
        return self._tracks[track]

    def _drain(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while self._events:
            item = self._events.popleft()
            if item[0] == "__raw__":
                out.extend(item[1])
                continue
            name, track, start_ns, end_ns, args = item
            if "_events" in args:  # device time of the span, from its launch on the host
                args = dict(args)
                begin, end = args.pop("_events")
                end.synchronize()
                end_ns = start_ns + int(begin.elapsed_time(end) * 1e6)
            tid = self._track_id(track, out)
            out.append(
                {
                    "ph": "X",
                    "name": name,
                    "cat": track.split(" #")[0].split(" ")[0],
                    "pid": self.rank,
                    "tid": tid,
                    "ts": (start_ns - self.origin_ns) / 1000,
                    "dur": (end_ns - start_ns) / 1000,
                    "args": args,
                }
            )
        return out

    def flush(self) -> None:
        with self._flush_lock:
            events = self._drain()
            if events and self._file is not None:
                self._file.write("".join(json.dumps(event) + ",\n" for event in events))
                self._file.flush()

    def _flush_loop(self, every_s: float) -> None:
        while not self._closed.wait(every_s):
            self.flush()

    def close(self) -> None:
        """Write what is left and end the JSON array."""
        if self._file is None or self._closed.is_set():
            return
        self._closed.set()
        self._flusher.join()
        self.flush()
        self._file.write(json.dumps({"ph": "M", "name": "trace_end", "pid": self.rank, "args": {}}) + "\n]\n")
        self._file.close()


def session_dir(run_dir: Path, start_step: int) -> Path:
    """Where this run's (or this resumed run's) per-rank traces go."""
    return run_dir / TRACES / f"from-step-{start_step:08d}"
