"""Every collective and pipeline send/receive of this process on the timeline, with the waits for them.

torch.distributed offers no hook that sees each operation on gloo (process groups' completion hooks are
NCCL-only; the profiler is too heavy to leave on; the flight recorder has no durations on gloo), so the
public functions that FSDP2, the pipeline schedules and megascale call are wrapped once per process,
in `torch.distributed` and in `distributed_c10d` alike (the pipeline code compares `dist.isend` by
identity; both names must stay the same object). A wrapper only reads the clock and the first tensor's
size around the original call:

- a synchronous collective is one span on its group's track and the same time on the `wait` track (the
  training thread waited for all of it);
- an asynchronous one spans from its issue to its completion (the work's future) on its group's track,
  and the training thread's `Work.wait()` on it is a span on the `wait` track: the exposed part;
- `batch_isend_irecv` (pipeline p2p) is a span of its issue; waiting for its works counts as pipeline
  bubble, not communication (the peer stage was still computing);
- functional collectives (DTensor's tensor parallelism) are spans of their issue only: they are waited
  for inside the tensor that holds their result, which no public hook sees.

Each operation carries its kind, group, bytes and a sequence number per group.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import distributed_c10d

from megascale.observe.timeline import Timeline

COLLECTIVES = {  # every c10d collective with async_op: the argument whose bytes are reported
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "all_gather": "tensor",
    "all_gather_coalesced": "input_tensor_list",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",  # FSDP2's parameter all-gather
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",  # FSDP2's gradient reduce-scatter
    "all_to_all": "input_tensor_list",
    "all_to_all_single": "input",
    "broadcast": "tensor",
    "reduce": "tensor",
    "gather": "tensor",
    "scatter": "scatter_list",
    "barrier": None,
}
FUNCTIONAL = {
    "all_reduce": "self",
    "all_gather_tensor": "self",
    "reduce_scatter_tensor": "self",
    "all_to_all_single": "self",
}
MAX_PENDING = 10_000

_active: Timeline | None = None
_installed = False
_local = threading.local()
_pending: dict[int, dict[str, Any]] = {}  # id(work) -> what it is, until waited for
_sequence: dict[str, itertools.count] = {}
_group_names: dict[int, str] = {}


def record_collectives(timeline: Timeline | None) -> None:
    """Send this process's communication to `timeline` (None: to nowhere); installs the wrappers once."""
    global _active, _installed
    _active = timeline if timeline is not None and timeline.enabled else None
    if _active is not None and not _installed:
        _install()
        _installed = True


def _group_name(group: Any) -> str:
    if group is None:
        return "world"
    key = id(group)
    if key not in _group_names:
        _group_names[key] = (
            getattr(group, "group_desc", None) or getattr(group, "group_name", None) or "group"
        )
    return _group_names[key]


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


def _describe(kind: str, group: Any, nbytes: int) -> dict[str, Any]:
    name = _group_name(group)
    counter = _sequence.setdefault(name, itertools.count(1))
    return {"kind": kind, "group": name, "bytes": nbytes, "seq": next(counter)}


def _remember(work: Any, info: dict[str, Any]) -> None:
    if len(_pending) > MAX_PENDING:  # works that were never waited for
        _pending.clear()
    _pending[id(work)] = info


def _wrap_collective(kind: str, size_arg: str | None, original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        timeline = _active
        if timeline is None or getattr(_local, "inside", False):
            return original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        info = _describe(kind, bound.get("group"), _nbytes(bound.get(size_arg)) if size_arg else 0)
        track = f"comm {info['group']}"
        _local.inside = True
        start = time.perf_counter_ns()
        try:
            work = original(*args, **kwargs)
        finally:
            _local.inside = False
        end = time.perf_counter_ns()
        if not bound.get("async_op"):
            timeline.add_in_lane(kind, track, start, end, info)
            timeline.add(kind, timeline.wait_track(), start, end, info)
            return work
        _remember(work, info)
        try:
            work.get_future().then(
                lambda _: timeline.add_in_lane(kind, track, start, time.perf_counter_ns(), info)
            )
        except RuntimeError:  # a work without a future: its issue is all there is to show
            timeline.add_in_lane(kind, track, start, end, info)
        return work

    return wrapper


def _wrap_batch_p2p(original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(p2p_op_list: list[Any]) -> Any:
        timeline = _active
        if timeline is None or getattr(_local, "inside", False):
            return original(p2p_op_list)
        group = p2p_op_list[0].group if p2p_op_list else None
        ops = ",".join(f"{'send' if op.op is dist.isend else 'recv'}:{op.peer}" for op in p2p_op_list)
        info = {
            **_describe("p2p", group, _nbytes([op.tensor for op in p2p_op_list])),
            "ops": ops,
            "p2p": True,
        }
        _local.inside = True
        start = time.perf_counter_ns()
        try:
            works = original(p2p_op_list)
        finally:
            _local.inside = False
        timeline.add_in_lane("p2p", f"comm {info['group']}", start, time.perf_counter_ns(), info)
        for work in works or []:
            _remember(work, info)
        return works

    return wrapper


def _wrap_functional(kind: str, size_arg: str, original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        timeline = _active
        if timeline is None:
            return original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        group = bound.get("group")
        if isinstance(group, tuple) and len(group) == 2:  # (DeviceMesh, dimension), as DTensor passes it
            mesh, dim = group
            group = mesh.get_group(dim)
        info = {**_describe(kind, group, _nbytes(bound.get(size_arg))), "functional": True}
        start = time.perf_counter_ns()
        result = original(*args, **kwargs)
        timeline.add_in_lane(kind, f"comm {info['group']}", start, time.perf_counter_ns(), info)
        return result

    return wrapper


def _wrap_wait(original: Any) -> Any:
    @functools.wraps(original)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        timeline = _active
        if timeline is None or getattr(_local, "inside", False):  # a synchronous collective's own wait
            return original(self, *args, **kwargs)
        info = _pending.pop(id(self), None) or {"kind": "work"}
        start = time.perf_counter_ns()
        result = original(self, *args, **kwargs)
        timeline.add(f"wait {info['kind']}", timeline.wait_track(), start, time.perf_counter_ns(), info)
        return result

    return wait


def _install() -> None:
    for name, size_arg in COLLECTIVES.items():
        wrapped = _wrap_collective(name, size_arg, getattr(distributed_c10d, name))
        setattr(distributed_c10d, name, wrapped)
        setattr(dist, name, wrapped)
    wrapped = _wrap_batch_p2p(distributed_c10d.batch_isend_irecv)
    distributed_c10d.batch_isend_irecv = dist.batch_isend_irecv = wrapped
    for name, size_arg in FUNCTIONAL.items():
        setattr(funcol, name, _wrap_functional(name, size_arg, getattr(funcol, name)))
    work_class = torch._C._distributed_c10d.Work
    work_class.wait = _wrap_wait(work_class.wait)
