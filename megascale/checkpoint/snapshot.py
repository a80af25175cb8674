"""Stage 1 of a checkpoint: a plain copy of this rank's state into a named buffer in the node's memory.

The training stall of a checkpoint is this copy alone (paper §4.4: each worker "writes its on-chip states
to the host memory, and then continues the training process"). The buffer is a file in tmpfs, allocated
and touched once and reused by every save, so a save pays neither page faults nor serialisation: 1 GiB
copies in ~0.15 s here, where a fresh allocation costs ~0.55 s and DCP's serialisation more. Converting
the snapshot to DCP's sharded format then runs in the background, from views of the buffer.

Because the buffer is a file and not a process's memory, a snapshot outlives the process that took it:
a record written after the copy says which step it holds and how its tensors are laid out, and a
restarted process with the same layout recovers the snapshot from it (`restore`). Each rank keeps two
buffers and takes them in turn (`SnapshotSlots`), so the previous snapshot stays whole while the next
is copied: a rank killed in the middle of a copy, or killed after its peers took a snapshot it never
reached, still holds one its peers hold too. torch's DCP stagers
(`DefaultStager` with shared memory) copy into anonymous shared memory that dies with the process, and
serialise once per save; that is why this is not them.

On CUDA the copy goes device-to-host into this pageable buffer: 1 GiB in 0.076 s on an H100
(docs/gpu.md). Registering the buffer as pinned memory would make it asynchronous.
"""

from __future__ import annotations

import logging
import os
import pickle
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from megascale.checkpoint.staging import OWNER_SUFFIX, claim
from megascale.parallel.tensor import local_shard, sharded_like

log = logging.getLogger(__name__)

ALIGN = 64  # bytes; every tensor starts on a cache line, which also satisfies any dtype's alignment
SLOTS = ("a", "b")  # a rank's two buffers, taken in turn

LeafPath = tuple[str, ...]


def flatten(state: dict[str, Any]) -> dict[str, Any]:
    """The state as DCP saves it: each top-level `Stateful` replaced by its state_dict()."""
    return {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state.items()}


def _leaves(tree: Any, path: LeafPath = ()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, (*path, key))
    else:
        yield path, tree


def split_leaves(tree: dict[str, Any]) -> tuple[dict[LeafPath, torch.Tensor], dict[LeafPath, Any]]:
    """A nested state dict's leaves by path: the tensors, and everything else."""
    leaves = dict(_leaves(tree))
    tensors = {path: leaf for path, leaf in leaves.items() if isinstance(leaf, torch.Tensor)}
    return tensors, {path: leaf for path, leaf in leaves.items() if path not in tensors}


def rebuild(tree: Any, values: dict[LeafPath, Any], path: LeafPath = ()) -> Any:
    """`tree`'s nesting with each leaf replaced by `values[its path]`."""
    if isinstance(tree, dict):
        return {key: rebuild(value, values, (*path, key)) for key, value in tree.items()}
    return values[path]


def load_into(state: dict[str, Any], tree: dict[str, Any], values: dict[LeafPath, Any]) -> None:
    """Give each top-level entry of `state` its part of `tree` (the state as `flatten` described it)
    rebuilt from `values`: a `Stateful` through load_state_dict, anything else by replacement."""
    received = rebuild(tree, values)
    for key, value in state.items():
        if isinstance(value, Stateful):
            value.load_state_dict(received[key])
        else:
            state[key] = received[key]


def _signature(path: LeafPath, tensor: torch.Tensor) -> tuple:
    """What identifies a tensor's bytes: its name, dtype, local shape, and for a DTensor which shard: its
    coordinates along the mesh dimensions it is sharded over (along a replicated one every rank holds the
    same bytes, so a replica's snapshot fits too)."""
    local = local_shard(tensor)
    shard = None
    if isinstance(tensor, DTensor):
        coordinate = tensor.device_mesh.get_coordinate() or ()
        sharded = [
            index for index, placement in zip(coordinate, tensor.placements) if not placement.is_replicate()
        ]
        shard = (tuple(tensor.shape), repr(tensor.placements), tuple(sharded))
    return (path, str(local.dtype), tuple(local.shape), shard)


def _offsets(tensors: dict[LeafPath, torch.Tensor]) -> tuple[dict[LeafPath, int], int]:
    offsets, end = {}, 0
    for path, tensor in tensors.items():
        offsets[path] = end
        local = local_shard(tensor)
        end += -(-local.numel() * local.element_size() // ALIGN) * ALIGN
    return offsets, end


class SnapshotBuffer:
    """One of a rank's snapshot buffers, `rank-R-S.bin`, and its record `rank-R-S.snapshot` in `directory`
    (S names the slot)."""

    def __init__(self, directory: Path, rank: int, slot: str = SLOTS[0]):
        self.directory = Path(directory)
        self.data_path = self.directory / f"rank-{rank:05d}-{slot}.bin"
        self.record_path = self.directory / f"rank-{rank:05d}-{slot}.snapshot"
        self._buffer: torch.Tensor | None = None

    # -- taking ----------------------------------------------------------------------------------------
    def reserve(self, state: dict[str, Any]) -> None:
        """Allocate and touch the buffer for `state` now, so the first save pays no page faults. A buffer
        holding a snapshot keeps it (its pages are touched already)."""
        size = _offsets(split_leaves(flatten(state))[0])[1]
        self._map(size, keep_contents=self.record_path.exists())

    def take(self, state: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
        """Copy `state` into the buffer and record it with `meta`; returns the state as views of the
        buffer (DTensors re-wrapped around them), which the caller may serialise while training goes on."""
        tree = flatten(state)
        tensors, objects = split_leaves(tree)
        offsets, size = _offsets(tensors)
        self.release()  # the buffer is about to change: no record may vouch for it meanwhile
        self._map(size, keep_contents=False)
        views = {}
        for path, tensor in tensors.items():
            view = self._view(offsets[path], local_shard(tensor))
            view.copy_(local_shard(tensor))
            views[path] = sharded_like(view, tensor)
        record: dict[str, Any] = {
            "meta": meta,
            "layout": [_signature(path, tensor) for path, tensor in tensors.items()],
            "objects": pickle.dumps(objects),
        }
        temporary = self.record_path.with_suffix(".tmp")
        temporary.write_bytes(pickle.dumps(record))
        os.replace(temporary, self.record_path)
        return rebuild(tree, {**pickle.loads(record["objects"]), **views})

    def release(self) -> None:
        """The snapshot is in stage 2's hands (or superseded): forget it, keep the memory for the next."""
        self.record_path.unlink(missing_ok=True)

    def close(self) -> None:
        """Give the memory back (the run is over)."""
        self.release()
        self._buffer = None
        self.data_path.unlink(missing_ok=True)
        self.data_path.with_suffix(OWNER_SUFFIX).unlink(missing_ok=True)
        try:
            self.directory.rmdir()
        except OSError:
            pass  # other ranks' buffers are still there

    # -- recovering ------------------------------------------------------------------------------------
    def restore(
        self, state: dict[str, Any], tree: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """A snapshot a previous process left, as (meta, state as views of the buffer), if its tensors
        are laid out exactly as `state`'s (same names, dtypes and shards); else None. `tree`: `state`
        already flattened, where the caller has it."""
        try:
            record = pickle.loads(self.record_path.read_bytes())
        except (OSError, EOFError, pickle.UnpicklingError):
            return None  # none, or one being replaced
        if not self.data_path.exists():
            return None
        tree = flatten(state) if tree is None else tree
        tensors, expected_objects = split_leaves(tree)
        layout = [_signature(path, tensor) for path, tensor in tensors.items()]
        offsets, size = _offsets(tensors)
        objects = pickle.loads(record["objects"])
        problem = None
        if record["layout"] != layout:
            differing = next((a, b) for a, b in zip_longest(record["layout"], layout) if a != b)
            problem = f"tensors laid out differently (first: {differing[0]} then, {differing[1]} now)"
        elif set(objects) != set(expected_objects):
            problem = f"other values differ: {sorted(set(objects) ^ set(expected_objects))[:3]}"
        elif self.data_path.stat().st_size < size:
            problem = f"buffer of {self.data_path.stat().st_size} bytes, {size} needed"
        if problem is not None:
            log.info(
                "checkpoint: the snapshot of step %s in %s is not usable: %s",
                record["meta"].get("step"),
                self.data_path,
                problem,
            )
            return None
        self._map(size, keep_contents=True)
        views = {
            path: sharded_like(self._view(offsets[path], local_shard(t)), t) for path, t in tensors.items()
        }
        return record["meta"], rebuild(tree, {**objects, **views})

    # -- the memory --------------------------------------------------------------------------------------
    def _map(self, size: int, *, keep_contents: bool) -> None:
        if self._buffer is not None and self._buffer.numel() >= size:
            return
        claim(self.directory, self.data_path.stem)  # this rank holds the buffer: not stale while it runs
        size = max(size, ALIGN)
        with open(self.data_path, "ab") as file:
            if file.tell() < size:
                file.truncate(size)
        self._buffer = torch.from_file(str(self.data_path), shared=True, size=size, dtype=torch.uint8)
        if not keep_contents:
            self._buffer.zero_()  # touch every page now, not during a save

    def _view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        assert self._buffer is not None
        nbytes = like.numel() * like.element_size()
        return self._buffer[offset : offset + nbytes].view(like.dtype).view(like.shape)


class SnapshotSlots:
    """A rank's two snapshot buffers, taken in turn, so that the newest snapshot is never the one being
    overwritten. `newest` is the slot holding the newest snapshot this process took or restored.

    A restarted rank may also restore from another rank's buffer on its node whose tensors are laid out as
    its own (a data-parallel replica's, left there by a rank that ran on this node before the ranks were
    numbered anew, after a node was replaced)."""

    def __init__(self, directory: Path, rank: int):
        self.directory, self.rank = Path(directory), rank
        self.buffers = [SnapshotBuffer(directory, rank, slot) for slot in SLOTS]
        self.newest: int | None = None
        # step -> (own slot, or None for another rank's buffer; meta; the state as views of the buffer)
        self._held: dict[int, tuple[int | None, dict[str, Any], dict[str, Any]]] = {}

    def next_slot(self) -> int:
        """The slot the next snapshot goes into: the one not holding the newest."""
        return 0 if self.newest is None else 1 - self.newest

    def reserve(self, state: dict[str, Any]) -> None:
        for buffer in self.buffers:
            buffer.reserve(state)

    def take(self, state: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
        """Copy `state` into the next slot (see `SnapshotBuffer.take`); it becomes the newest."""
        slot = self.next_slot()
        staged = self.buffers[slot].take(state, meta)
        self.newest = slot
        self._held.clear()
        return staged

    def held(self, state: dict[str, Any], tree: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """The snapshots previous processes left on this node that fit `state` (`tree`: it flattened), as
        {step: meta}: this rank's own slots first, then any other rank's buffer laid out alike."""
        self._held.clear()
        own = {buffer.record_path for buffer in self.buffers}
        others = [
            SnapshotBuffer(self.directory, int(path.stem.split("-")[1]), path.stem.split("-")[2])
            for path in sorted(self.directory.glob("rank-*-*.snapshot"))
            if path not in own
        ]
        for slot, buffer in [*enumerate(self.buffers), *((None, other) for other in others)]:
            restored = buffer.restore(state, tree)
            if restored is not None and int(restored[0]["step"]) not in self._held:
                meta, staged = restored
                self._held[int(meta["step"])] = (slot, meta, staged)
        return {step: meta for step, (_, meta, _) in sorted(self._held.items())}

    def restore_into(self, state: dict[str, Any], tree: dict[str, Any], step: int) -> dict[str, Any]:
        """Copy the held snapshot of `step` into `state`'s own tensors (never aliasing the buffer, which a
        later snapshot overwrites) and load its other values; returns the snapshot as views of its buffer
        (for stage 2). Call `held` first."""
        slot, _, staged = self._held[step]
        tensors, _ = split_leaves(tree)
        staged_tensors, objects = split_leaves(staged)
        for path, tensor in tensors.items():
            local_shard(tensor).copy_(local_shard(staged_tensors[path]))
        load_into(state, tree, {**objects, **tensors})
        self.newest = slot
        self._held.clear()
        return staged

    def remove_others(self, ranks: set[int]) -> None:
        """Delete the buffers of ranks not in `ranks` (this node's now): what ranks that ran here before the
        ranks were numbered anew left behind. Call it once no rank will read them."""
        for path in {*self.directory.glob("rank-*-*.bin"), *self.directory.glob("rank-*-*.snapshot")}:
            _, rank, slot = path.stem.split("-")
            if int(rank) not in ranks:
                SnapshotBuffer(self.directory, int(rank), slot).close()

    def close(self) -> None:
        for buffer in self.buffers:
            buffer.close()
