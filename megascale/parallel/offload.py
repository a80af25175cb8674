"""Activation offload: what a block keeps for its backward leaves the compute device until the backward.

Per block, beside activation checkpointing: a block's forward runs under saved-tensor hooks
(`torch.autograd.graph.saved_tensors_hooks`) that move every tensor autograd keeps for the backward off the
device, except the block's own parameters, and bring each back when the backward asks for it. Bits are
kept exactly: the losses are those without offload. Every block but the last of each model part offloads:
the last one's backward follows its forward at once.

Where the tensors go:
- on an accelerator, to pinned host memory, copied on a side stream so that the forward does not wait for
  them (a device tensor is released once its copy's event has completed). When a block's backward asks
  for its first tensor, the whole block and the block that ran before it in the same forward are fetched
  on that stream, so the copies overlap the backward's compute. This branch has not run on a GPU (no
  device has measured it);
- on CPU the host is the device, so the tensors go to a spill file: an unlinked temporary file in
  `$TMPDIR` (nothing is left behind, even after a crash), written when saved and read when asked for,
  without fetching ahead (the cores that would copy in the background are the ones computing). The bytes
  leave the process for the kernel's page cache, or the disk under memory pressure: the process's peak
  memory measures what offload saves (bench/offload.py).

Why not torch's own: `torch.autograd.graph.save_on_cpu` (and `offload_wrapper`) copies synchronously on the
compute stream, copies the weights that linear layers save as well, fetches nothing ahead, and on CPU does
nothing.

Applied after activation checkpointing and compilation, before FSDP: the hooks wrap a checkpointed block's
call, so a fully checkpointed block offloads the one input it keeps. Selective checkpointing is refused
beside it (megascale/config): torch's selective checkpoint holds the outputs it keeps outside the hooks.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.tensor import DTensor


class _Stored:
    """One storage whose bytes were offloaded: where they are, and their way back."""

    __slots__ = ("__weakref__", "fetched", "nbytes", "place", "restored", "uses")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.place: Any = None  # where the store keeps the bytes
        self.fetched: torch.Tensor | None = None  # on its way back
        self.restored: torch.Tensor | None = None  # back, until the last saved view of it is unpacked
        self.uses = 0  # saved views of it not unpacked yet


class _Saved:
    """One tensor autograd saved: a view of an offloaded storage (and, for a DTensor, its sharding spec,
    rebuilt around it)."""

    __slots__ = ("dtype", "offset", "shape", "spec", "stored", "stride")

    def __init__(self, stored: _Stored, tensor: torch.Tensor, spec: Any = None):
        self.stored = stored
        self.shape, self.stride, self.offset = tensor.shape, tensor.stride(), tensor.storage_offset()
        self.dtype, self.spec = tensor.dtype, spec


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s whole storage as flat bytes (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _host_buffer(data: torch.Tensor) -> memoryview:
    """The bytes of `data` (flat, on the host) as a buffer for the file calls, without `Tensor.numpy()`,
    which would make the storage unresizable for good: FSDP resizes the storages of the weights it gathers,
    and a compiled block's graph saves those as plain tensors."""
    return memoryview((ctypes.c_ubyte * data.numel()).from_address(data.data_ptr())).cast("B")


class _SpillFile:
    """CPU: the saved storages' bytes in an unlinked temporary file, written when saved and read back when
    the backward asks: on a CPU the cores that would copy in the background are the ones computing, so
    nothing is fetched ahead.

    Space is handed out at the end of the file and reclaimed all at once when no saved storage is left
    (after every step's last backward), so the file never grows past one step's offloaded bytes."""

    ahead = False

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile()  # in $TMPDIR, unlinked: gone with the process
        self._end = 0
        self._live = 0
        self.written_bytes = 0  # over the file's life

    def put(self, stored: _Stored, data: torch.Tensor) -> None:
        self._live += 1  # first: a release the garbage collector runs meanwhile cannot reclaim the file
        stored.place = offset = self._end
        self._end += stored.nbytes
        self.written_bytes += stored.nbytes
        weakref.finalize(stored, self._release)
        view = _host_buffer(data)
        while view:  # a write may be short
            written = os.pwrite(self._file.fileno(), view, offset)
            view, offset = view[written:], offset + written

    def fetch(self, stored: _Stored) -> torch.Tensor:
        data = torch.empty(stored.nbytes, dtype=torch.uint8)
        view, offset = _host_buffer(data), stored.place
        while view:
            got = os.preadv(self._file.fileno(), [view], offset)
            if got <= 0:
                raise OSError(f"activation offload: the spill file ended {len(view)} bytes short")
            view, offset = view[got:], offset + got
        return data

    def ready(self, fetched: torch.Tensor) -> torch.Tensor:
        return fetched

    def _release(self) -> None:
        self._live -= 1
        if self._live == 0:
            self._end = 0

    def close(self) -> None:
        self._file.close()


class _PinnedHost:
    """An accelerator: the saved storages in pinned host memory, copied on a side stream, and fetched one
    block ahead. Not yet run on a GPU.

    A device storage stays referenced until its copy's event has completed, so the forward never waits on
    a copy; finished copies release theirs at the next offload."""

    ahead = True

    def __init__(self, device: torch.device):
        self._device = device
        self._stream = torch.Stream(device=device)
        self._in_flight: list[tuple[torch.Event, torch.Tensor]] = []

    def put(self, stored: _Stored, data: torch.Tensor) -> None:
        self._in_flight = [(done, kept) for done, kept in self._in_flight if not done.query()]
        host = torch.empty(stored.nbytes, dtype=torch.uint8, pin_memory=True)
        self._stream.wait_stream(torch.accelerator.current_stream(self._device))
        with self._stream:
            host.copy_(data, non_blocking=True)
            done = torch.Event()
            done.record(self._stream)
        self._in_flight.append((done, data))
        stored.place = host

    def fetch(self, stored: _Stored) -> torch.Tensor:
        with self._stream:
            data = torch.empty(stored.nbytes, dtype=torch.uint8, device=self._device)
            data.copy_(stored.place, non_blocking=True)
        return data

    def ready(self, fetched: torch.Tensor) -> torch.Tensor:
        compute = torch.accelerator.current_stream(self._device)
        compute.wait_stream(self._stream)
        fetched.record_stream(compute)  # allocated on the side stream, used on the compute stream
        return fetched

    def close(self) -> None:
        self._in_flight.clear()


class _BlockCall:
    """One forward call of an offloaded block: the storages it offloaded, and the call before it in the
    same forward (whose backward comes next)."""

    def __init__(self, previous: _BlockCall | None):
        self.stored: weakref.WeakSet[_Stored] = weakref.WeakSet()
        self.previous = previous
        self.fetching = False
        # During the forward: the storages offloaded so far, by address, each with its bytes (kept alive,
        # so that an address stays theirs): views of one storage saved by several ops (the input of the
        # q, k and v projections; the attention's output and the output projection's input) share one
        # copy and come back as views of one storage, as they were.
        self.seen: dict[int, tuple[torch.Tensor, _Stored]] = {}


class ActivationOffload:
    """The saved-tensor hooks one rank's offloaded blocks share, and the store they put storages in.

    Kept on the device: the model part's parameters and buffers (a linear layer saves its weight, RoPE its
    tables), tensors on another device, and tensor subclasses other than DTensor (float8 layers' scaled
    tensors) whose bytes are not theirs alone to copy."""

    def __init__(self, device: torch.device):
        self.device = device
        self._store: _SpillFile | _PinnedHost = _SpillFile() if device.type == "cpu" else _PinnedHost(device)
        self._last: tuple[OffloadedBlock, _BlockCall] | None = None
        weakref.finalize(self, self._store.close)

    @contextlib.contextmanager
    def hooks(self, block: OffloadedBlock) -> Iterator[None]:
        """Run one forward call of `block` under the hooks."""
        last, previous = self._last, block.previous_block() if block.previous_block else None
        follows = last is not None and previous is not None and last[0] is previous
        call = _BlockCall(last[1] if follows and last is not None else None)
        self._last = (block, call)
        part = block.part()
        state = itertools.chain(part.parameters(), part.buffers()) if part is not None else block.parameters()
        kept = {_address(tensor) for tensor in state}
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                lambda tensor: self._pack(tensor, call, kept), lambda saved: self._unpack(saved, call)
            ):
                yield
        finally:
            call.seen.clear()

    def _pack(self, tensor: torch.Tensor, call: _BlockCall, kept: set[int | None]) -> Any:
        local = _local(tensor)
        if type(local) is not torch.Tensor or local.device.type != self.device.type or local.numel() == 0:
            return tensor
        address = local.untyped_storage().data_ptr()  # a plain tensor's, checked above
        if address in kept:
            return tensor
        if address in call.seen:
            stored = call.seen[address][1]
        else:
            data = _storage_bytes(local.detach())
            stored = _Stored(data.numel())
            self._store.put(stored, data)
            call.stored.add(stored)
            call.seen[address] = (data, stored)
        stored.uses += 1
        return _Saved(stored, local, tensor._spec if isinstance(tensor, DTensor) else None)

    def _unpack(self, saved: Any, call: _BlockCall) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        if self._store.ahead:
            self._fetch(call)
            if call.previous is not None:
                self._fetch(call.previous)  # the block whose backward comes next
        stored = saved.stored
        if stored.restored is None:
            fetched = stored.fetched if stored.fetched is not None else self._store.fetch(stored)
            stored.fetched = None
            stored.restored = self._store.ready(fetched)
        data = stored.restored
        stored.uses -= 1
        if stored.uses <= 0:  # the last saved view of it has it: the graph frees it after use
            stored.restored = None
        local = torch.empty(0, dtype=saved.dtype, device=data.device)
        local.set_(data.untyped_storage(), saved.offset, saved.shape, saved.stride)
        if saved.spec is None:
            return local
        return DTensor(local, saved.spec, requires_grad=False)

    def _fetch(self, call: _BlockCall) -> None:
        if not call.fetching:
            call.fetching = True
            for stored in list(call.stored):
                stored.fetched = self._store.fetch(stored)


def _address(tensor: torch.Tensor) -> int | None:
    """Where `tensor`'s (or a DTensor's local shard's) bytes are; None for a tensor subclass that wraps
    others (a float8 weight) and has no storage of its own."""
    local = _local(tensor)
    if type(local) not in (torch.Tensor, nn.Parameter):
        return None
    return local.untyped_storage().data_ptr()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, outside autograd; any other tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class OffloadedBlock(ActivationWrapper):
    """A block whose forward keeps its saved tensors off the device; state-dict names are unchanged."""

    def __init__(
        self, block: nn.Module, offload: ActivationOffload, part: nn.Module, previous: nn.Module | None
    ):
        super().__init__(block)
        self.offload = offload
        self.part = weakref.ref(part)  # the model part it is in, whose parameters and buffers stay
        self.previous_block = weakref.ref(previous) if previous is not None else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.offload.hooks(self):
            return self._checkpoint_wrapped_module(*args, **kwargs)


def apply_activation_offload(model: nn.Module, *, blocks: str, offload: ActivationOffload) -> None:
    """Wrap every block of `model.<blocks>` but the last in place so that it offloads its saved tensors to
    `offload`. The last block's backward follows its forward at once (its stage's first backward), so its
    tensors stay."""
    container = model.get_submodule(blocks)
    previous: nn.Module | None = None
    for name, block in list(container.named_children())[:-1]:
        wrapped = OffloadedBlock(block, offload, model, previous)
        container.register_module(name, wrapped)
        previous = wrapped
