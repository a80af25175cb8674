"""Every collective and pipeline send/receive of this process on the timeline, with the waits for them.

torch.distributed offers no hook that sees each operation on gloo (process groups' completion hooks are
NCCL-only; the profiler is too heavy to leave on; the flight recorder has no durations on gloo), so the
public functions that FSDP2, the pipeline schedules and megascale call are wrapped once per process,
in `torch.distributed` and in `distributed_c10d` alike (the pipeline code compares `dist.isend` by
identity; both names must stay the same object). A wrapper only reads the clock and the first tensor's
size around the original call:

- a synchronous collective is one span on its group's track and the same time on the `wait` track (the
  training thread waited for all of it);
- an asynchronous one spans from its issue to when this process saw it finished, on its group's track:
  the end of its `Work.wait()`, or the start of that wait if it had finished before (an upper bound on
  its completion; a callback on the work's future would give the exact time but costs a GIL hand-off
  per operation, about half of all the recording costs). The wait itself is a span on the `wait` track:
  the exposed part;
- `isend`, `irecv` and `batch_isend_irecv` (pipeline p2p) are spans of their issue; waiting for their
  works counts as pipeline bubble, not communication (the peer stage was still computing), except on
  context parallelism's ring (its group `mesh_cp`), whose peers send as soon as they can: there a wait is
  for the transfer, communication;
- functional collectives (DTensor's tensor parallelism) are spans of their issue; the result is waited
  for when first used, through `funcol.wait_tensor` (wrapped too), and that wait is a span on the `wait`
  track like any other.

Each operation carries its kind, group, bytes and a sequence number per group.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import time
from dataclasses import dataclass
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
FUNCTIONAL = {  # what DTensor calls (the older *_tensor names call these, so they are seen too)
    "all_reduce": "self",
    "all_gather_single": "self",
    "reduce_scatter_single": "self",
    "all_to_all_single": "self",
}
MAX_PENDING = 10_000
# A wait for a work not issued through a wrapper.
_UNKNOWN_WORK: tuple[dict[str, Any], None, None] = ({"kind": "work"}, None, None)
_UNKNOWN_FUNCTIONAL: tuple[dict[str, Any], None, None] = ({"kind": "functional"}, None, None)


@dataclass
class _Group:
    """A process group as this process has used it: its members and how far its operations got."""

    name: str
    ranks: list[int]
    issued: int = 0  # operations started on it (each one's sequence number)
    completed: int = 0  # the highest sequence number known finished


_active: Timeline | None = None
_installed = False
_local = threading.local()
# id(work or tensor) -> what (as `_remember` takes it), until waited for
_pending: dict[int, tuple[dict[str, Any], _Group, tuple[str, int] | None]] = {}
_groups: dict[Any, _Group] = {}  # by id() of the process group; 0 the default group; a tuple of ranks
_waiting: dict[int, dict[str, Any]] = {}  # thread id -> the operation it is blocked in now


def record_collectives(timeline: Timeline | None) -> None:
    """Send this process's communication to `timeline` (None: to nowhere); installs the wrappers once."""
    global _active, _installed
    _active = timeline if timeline is not None and timeline.enabled else None
    if _active is not None and not _installed:
        _install()
        _installed = True


def communication_state(thread: int) -> dict[str, Any]:
    """Every group's progress, and what `thread` is blocked in: what a rank dumps when the job hangs."""
    groups = [dataclasses.asdict(group) for group in list(_groups.values())]
    return {"groups": groups, "waiting": _waiting.get(thread)}


# Groups whose point-to-point transfers are communication, not a pipeline's hand-offs: context
# parallelism's ring (ParallelDims names each mesh dimension's group `mesh_<dimension>`).
RING_GROUPS = ("mesh_cp",)


def _group(group: Any) -> _Group:
    """The record of a process group (None: the default one; a functional collective may name its
    group by a list of ranks instead)."""
    if isinstance(group, (list, tuple)):
        ranks = [int(rank) for rank in group]
        key: Any = tuple(ranks)
        found = _groups.get(key)
        if found is None:
            found = _groups[key] = _Group("ranks " + ",".join(map(str, ranks)), ranks)
        return found
    key = 0 if group is None else id(group)
    found = _groups.get(key)
    if found is None:
        process_group = group if group is not None else distributed_c10d._get_default_group()
        name = "world" if group is None else (
            getattr(group, "group_desc", None) or getattr(group, "group_name", None) or "group"
        )  # fmt: skip
        found = _groups[key] = _Group(name, dist.get_process_group_ranks(process_group))
    return found


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


def _describe(kind: str, group: Any, nbytes: int) -> tuple[dict[str, Any], _Group]:
    record = _group(group)
    record.issued += 1
    return {"kind": kind, "group": record.name, "bytes": nbytes, "seq": record.issued}, record


def _completed(record: _Group, seq: int) -> None:
    record.completed = max(record.completed, seq)


def _remember(work: Any, info: dict[str, Any], record: _Group, issued: tuple[str, int] | None = None) -> None:
    """Keep what `work` is until it is waited for; `issued` (its track, its issue time) when its span is
    still open."""
    if len(_pending) > MAX_PENDING:  # works that were never waited for
        _pending.clear()
    _pending[id(work)] = (info, record, issued)


def _argument_reader(original: Any, *names: str | None) -> Any:
    """A fast reader of the named arguments of a call to `original` (by keyword or position, else their
    defaults): `inspect.Signature.bind` costs more than the rest of a wrapper together."""
    parameters = list(inspect.signature(original).parameters.values())
    spots = []
    for name in names:
        index = next((i for i, parameter in enumerate(parameters) if parameter.name == name), None)
        default = parameters[index].default if index is not None else None
        spots.append((name, index, None if default is inspect.Parameter.empty else default))

    def read(args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        return [
            kwargs[name]
            if name in kwargs
            else args[index]
            if index is not None and index < len(args)
            else default
            for name, index, default in spots
        ]

    return read


def _wrap_collective(kind: str, size_arg: str | None, original: Any) -> Any:
    read = _argument_reader(original, "group", "async_op", size_arg)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        timeline = _active
        if timeline is None or getattr(_local, "inside", False):
            return original(*args, **kwargs)
        group, async_op, sized = read(args, kwargs)
        info, record = _describe(kind, group, _nbytes(sized))
        track = f"comm {info['group']}"
        synchronous = not async_op
        thread = threading.get_ident()
        if synchronous:
            _waiting[thread] = info
        _local.inside = True
        start = time.perf_counter_ns()
        try:
            work = original(*args, **kwargs)
        finally:
            _local.inside = False
            _waiting.pop(thread, None)
        end = time.perf_counter_ns()
        if synchronous:
            _completed(record, info["seq"])
            timeline.add_in_lane(kind, track, start, end, info)
            timeline.add(kind, timeline.wait_track(), start, end, info)
            return work
        if work is None:  # not a member of the group: nothing was sent
            timeline.add_in_lane(kind, track, start, end, info)
        else:
            _remember(work, info, record, (track, start))  # its span ends when its wait sees it done
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
        info, record = _describe("p2p", group, _nbytes([op.tensor for op in p2p_op_list]))
        info.update(ops=ops, p2p=True)
        _local.inside = True
        start = time.perf_counter_ns()
        try:
            works = original(p2p_op_list)
        finally:
            _local.inside = False
        timeline.add_in_lane("p2p", f"comm {info['group']}", start, time.perf_counter_ns(), info)
        for work in works or []:
            _remember(work, info, record)
        return works

    return wrapper


def _wrap_p2p(kind: str, original: Any) -> Any:
    """isend / irecv: a span of the issue; the wait for the work is pipeline bubble."""
    read = _argument_reader(original, "group", "tensor")

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        timeline = _active
        if timeline is None or getattr(_local, "inside", False):
            return original(*args, **kwargs)
        group, tensor = read(args, kwargs)
        info, record = _describe(kind, group, _nbytes(tensor))
        info["p2p"] = info["group"] not in RING_GROUPS
        start = time.perf_counter_ns()
        work = original(*args, **kwargs)
        timeline.add_in_lane(kind, f"comm {info['group']}", start, time.perf_counter_ns(), info)
        if work is not None:
            _remember(work, info, record)
        return work

    return wrapper


def _wrap_functional(kind: str, size_arg: str, original: Any) -> Any:
    read = _argument_reader(original, "group", size_arg)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        timeline = _active
        if timeline is None:
            return original(*args, **kwargs)
        group, sized = read(args, kwargs)
        if isinstance(group, tuple) and len(group) == 2:  # (DeviceMesh, dimension), as DTensor passes it
            mesh, dim = group
            group = mesh.get_group(dim)
        info, record = _describe(kind, group, _nbytes(sized))
        info["functional"] = True
        start = time.perf_counter_ns()
        result = original(*args, **kwargs)
        _completed(record, info["seq"])  # counted done at issue: a result never used is never waited for
        timeline.add_in_lane(kind, f"comm {info['group']}", start, time.perf_counter_ns(), info)
        _remember(getattr(result, "elem", result), info, record)  # the tensor `wait_tensor` will be given
        return result

    return wrapper


def _wrap_functional_wait(original: Any) -> Any:
    """funcol.wait_tensor: where a functional collective's result is first used (or its gradient's)."""

    @functools.wraps(original)
    def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
        timeline = _active
        if timeline is None:
            return original(tensor)
        info = (_pending.pop(id(tensor), None) or _UNKNOWN_FUNCTIONAL)[0]
        thread = threading.get_ident()
        _waiting[thread] = info
        start = time.perf_counter_ns()
        try:
            result = original(tensor)
        finally:
            del _waiting[thread]
        timeline.add("wait " + info["kind"], timeline.wait_track(), start, time.perf_counter_ns(), info)
        return result

    return wait_tensor


def _wrap_wait(original: Any) -> Any:
    @functools.wraps(original)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        timeline = _active
        if timeline is None or getattr(_local, "inside", False):  # a synchronous collective's own wait
            return original(self, *args, **kwargs)
        info, record, issued = _pending.pop(id(self), None) or _UNKNOWN_WORK
        thread = threading.get_ident()
        _waiting[thread] = info
        start = time.perf_counter_ns()
        finished_before = issued is not None and self.is_completed()
        try:
            result = original(self, *args, **kwargs)
        finally:
            del _waiting[thread]
        end = time.perf_counter_ns()
        if record is not None:
            _completed(record, info["seq"])
        if issued is not None:
            track, issued_ns = issued
            timeline.add_in_lane(info["kind"], track, issued_ns, start if finished_before else end, info)
        timeline.add("wait " + info["kind"], timeline.wait_track(), start, end, info)
        return result

    return wait


def _install() -> None:
    for name, size_arg in COLLECTIVES.items():
        if not hasattr(distributed_c10d, name):  # *_single arrived in torch 2.13; older FSDP2 uses *_tensor
            continue
        wrapped = _wrap_collective(name, size_arg, getattr(distributed_c10d, name))
        setattr(distributed_c10d, name, wrapped)
        setattr(dist, name, wrapped)
    for name in ("isend", "irecv"):  # both namespaces: P2POp and the pipeline compare them by identity
        wrapped = _wrap_p2p(name, getattr(distributed_c10d, name))
        setattr(distributed_c10d, name, wrapped)
        setattr(dist, name, wrapped)
    wrapped = _wrap_batch_p2p(distributed_c10d.batch_isend_irecv)
    distributed_c10d.batch_isend_irecv = dist.batch_isend_irecv = wrapped
    for name, size_arg in FUNCTIONAL.items():
        if not hasattr(funcol, name):
            continue
        setattr(funcol, name, _wrap_functional(name, size_arg, getattr(funcol, name)))
    funcol.wait_tensor = _wrap_functional_wait(funcol.wait_tensor)
    work_class = torch._C._distributed_c10d.Work
    work_class.wait = _wrap_wait(work_class.wait)  # type: ignore[method-assign]  # patching torch's C++ class
