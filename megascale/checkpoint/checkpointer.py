"""Two-stage checkpoints (paper §4.4) through torch.distributed.checkpoint (DCP), to any fsspec location.

Stage 1 copies every rank's state into a buffer in the node's memory (snapshot.py), and training goes on.
In the background, DCP serialises that copy into a node-local directory in memory (tmpfs), and stage 2
(persist.py) copies each node's files to the final location and commits the checkpoint by writing
`manifest.json` last, with every file's size and CRC-32: a checkpoint without a manifest does not exist,
so a crash at any moment leaves either the previous state or a complete new one. Under `megascale
launch`, stage 2 runs in the node's executor, so a snapshot survives the crash of the training processes
that took it; one still only in the buffers is written by the restarted processes (`recover_staged`).

Loading verifies files against the manifest and falls back to the previous verified checkpoint, saying
so. The newest `keep` committed checkpoints are kept; the newest verified one is never deleted.

DCP provides the sharded format, the planning collectives and resharding on load; what this module adds
is the staging in memory, the hand-over to stage 2, and verification with fallback.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch import nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from megascale.checkpoint.ledger import check_not_lost, record_commit, record_start
from megascale.checkpoint.manifest import (
    MANIFEST,
    commit,
    join,
    list_checkpoints,
    prune,
    read_manifest,
    split_location,
    step_dir_name,
    verify,
)
from megascale.checkpoint.persist import PERSISTER, mark_ready, node_name, pending, persist, staging_root
from megascale.checkpoint.resume import changes_since, check_resumable, init_from_path
from megascale.checkpoint.snapshot import SnapshotBuffer, flatten, rebuild, split_leaves
from megascale.checkpoint.stateful import ModelState
from megascale.config import JobConfig
from megascale.errors import CheckpointError

__all__ = [
    "Checkpointer",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_weights",
    "read_manifest",
    "verify",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

SNAPSHOTS = "snapshots"  # the ranks' stage-1 buffers, in the node's staging directory

# Single-process saves and loads run DCP without a process group, as intended; its warning says otherwise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _is_node_main() -> bool:
    """The first process on this node (torchrun's LOCAL_RANK 0), which hands the node's files to stage 2."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 if _distributed() else True


def write_threads() -> int:
    """Threads each rank writes its shards with: this node's cores shared among its processes (at most 8)."""
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, (os.cpu_count() or 1) // local_processes))


def _writer(location: str):
    fs, path = split_location(location)
    return dcp.FileSystemWriter(path) if isinstance(fs, LocalFileSystem) else FsspecWriter(location)


class _Counting:
    """Counts the bytes a DCP reader takes from storage (the sum of the stored items it reads)."""

    bytes_read = 0

    def read_data(self, plan, planner):
        self.bytes_read += sum(self.storage_data[item.storage_index].length for item in plan.items)
        return super().read_data(plan, planner)


class _CountingFileSystemReader(_Counting, dcp.FileSystemReader):
    pass


class _CountingFsspecReader(_Counting, FsspecReader):
    pass


def _reader(location: str) -> _Counting:
    fs, path = split_location(location)
    if isinstance(fs, LocalFileSystem):
        return _CountingFileSystemReader(path)
    return _CountingFsspecReader(location)


def write_checkpoint(location: str, state: dict[str, Any], descriptor: dict[str, Any]) -> str:
    """Write and commit a checkpoint in the foreground, by a single process (e.g. `megascale convert`)."""
    fs, path = split_location(location)
    if fs.exists(join(path, MANIFEST)):
        fs.rm(join(path, MANIFEST))  # uncommit first: a crash below must not leave old files "verified"
    dcp.save(state, storage_writer=_writer(location), no_dist=True)
    commit(location, descriptor)
    return location


def load_checkpoint(
    location: str, state: dict[str, Any], *, replicas: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """Load `location` into `state` in place (Stateful values get load_state_dict); returns its manifest.

    Collective over the default process group when there is one: every rank reads what its shards need.
    With `replicas`, the group of this rank's replicas (ranks holding identical state: the DP replicas),
    only the group's first rank reads and broadcasts to the others (paper §4.4), so storage serves each
    byte once per group rather than once per replica."""
    return _load(location, state, replicas)[0]


def load_model_weights(checkpoint: str, model: nn.Module | list[nn.Module]) -> None:
    """Load only the model entry of a checkpoint (no optimizer, schedule or data position); the caller has
    checked it was written for this model's shape (`check_model_matches`)."""
    load_checkpoint(checkpoint, {"model": ModelState(model)})


def _load(
    location: str, state: dict[str, Any], replicas: dist.ProcessGroup | None
) -> tuple[dict[str, Any], int]:
    """The manifest, and the bytes this rank read from storage."""
    manifest = read_manifest(location)
    reader = _reader(location)
    group = replicas if replicas is not None and dist.get_world_size(replicas) > 1 else None
    broadcast = group is not None
    source = dist.get_global_rank(group, 0) if group is not None else None
    try:
        # DCP's planning is collective over every rank; a rank with nothing to load reads nothing.
        mine = state if not broadcast or dist.get_rank() == source else {}
        dcp.load(mine, storage_reader=reader, no_dist=not _distributed())
    except Exception as err:  # DCP wraps storage and shape problems in several exception types
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"checkpoint: cannot load {location}: {first_line}") from err
    if group is not None and source is not None:
        _broadcast_state(state, source, group)
    return manifest, reader.bytes_read


def _broadcast_state(state: dict[str, Any], source: int, group: dist.ProcessGroup) -> None:
    """Make every rank of `group` hold `source`'s state: its tensors, then its other values."""
    tree = flatten(state)  # on the source, what it just loaded; elsewhere, tensors to receive into
    tensors, objects = split_leaves(tree)
    for path in sorted(tensors):  # by name: a fresh optimizer may order its state differently
        tensor = tensors[path]
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        staging = local if local.is_contiguous() else local.contiguous()
        dist.broadcast(staging, src=source, group=group)
        if staging is not local:
            local.copy_(staging)
    carried = [objects]
    dist.broadcast_object_list(carried, src=source, group=group)
    if dist.get_rank() == source:
        return
    received = rebuild(tree, {**carried[0], **tensors})
    for key, value in state.items():
        if isinstance(value, Stateful):
            value.load_state_dict(received[key])
        else:
            state[key] = received[key]


class Checkpointer:
    """Saves, commits, prunes and finds checkpoints under `root`/step-NNNNNNNN (a path or fsspec URL).

    In a multi-process job every rank holds a Checkpointer and calls save/latest_verified together;
    `process_group` is the group the saves' collectives use (one of their own, not the training group).
    """

    def __init__(
        self,
        root: str,
        keep: int,
        *,
        async_save: bool = True,
        process_group: dist.ProcessGroup | None = None,
        ledger: Path | None = None,
    ):
        self.root = str(root)
        self.keep = keep
        self.ledger = ledger  # where commits are recorded (checkpoint/ledger.py), if anywhere
        self.async_save = async_save
        self.process_group = process_group
        self._stage_two: threading.Thread | None = None
        self._stage_two_error: BaseException | None = None
        self._stage_two_step: int | None = None
        self._buffer: SnapshotBuffer | None = None
        self.bytes_read = 0

    # -- saving ---------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], descriptor: dict[str, Any]) -> str:
        """Stage 1 now; stage 2 and the commit in the background (or, with async_save off, in the
        foreground). Waits for this process's previous stage 2 first. Returns the location the
        checkpoint will have once committed."""
        self.wait()
        location = join(self.root, step_dir_name(step))
        descriptor = {"step": step, **descriptor}
        started = time.perf_counter()
        if not self.async_save:
            dcp.save(
                state,
                storage_writer=_writer(location),
                process_group=self.process_group,
                no_dist=not _distributed(),
            )
            if _is_main():
                commit(location, descriptor)
                record_commit(self.ledger, step, location)
                prune(self.root, self.keep)
                log.info(
                    "checkpoint: saved step %d to %s in %.2f s", step, location, time.perf_counter() - started
                )
            self._barrier()
            return location

        staged_state = self._snapshot().take(state, {"step": step, "descriptor": descriptor})
        log.info(
            "checkpoint: step %d in host memory after %.2f s; writing it in the background",
            step,
            time.perf_counter() - started,
        )
        self._stage_two_step = step
        self._stage_two = threading.Thread(
            target=self._in_background,
            args=(step, staged_state, descriptor),
            name="megascale-checkpoint-stage-2",
        )
        self._stage_two.start()
        return location

    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate this rank's snapshot memory for `state` now rather than at the first save."""
        if self.async_save:
            self._snapshot().reserve(state)

    def close(self) -> None:
        """Wait for the save in flight, then give this rank's snapshot memory back (the run is over)."""
        self.wait()
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
        root = staging_root(self.root)
        for directory in (root, root.parent):  # this job's staging directory, then megascale-<user>
            try:
                directory.rmdir()
            except OSError:
                break  # not empty (another job's, or a snapshot left for stage 2), or already gone

    def _snapshot(self) -> SnapshotBuffer:
        if self._buffer is None:
            rank = dist.get_rank() if _distributed() else 0
            self._buffer = SnapshotBuffer(staging_root(self.root) / SNAPSHOTS, rank)
        return self._buffer

    def _in_background(self, step: int, staged_state: dict[str, Any], descriptor: dict[str, Any]) -> None:
        try:
            self._hand_over(step, staged_state, descriptor)
        except BaseException as err:  # noqa: BLE001 (re-raised by wait())
            self._stage_two_error = err

    def _hand_over(self, step: int, staged_state: dict[str, Any], descriptor: dict[str, Any]) -> None:
        """Serialise a snapshot with DCP into the node's staging directory, hand it to stage 2 (READY.json)
        and release the buffer; then, unless the executor persists, persist it here. Collective."""
        staged = staging_root(self.root) / step_dir_name(step)
        executor = os.environ.get(PERSISTER) == "executor"
        if _is_node_main():
            # One snapshot per node in the staging directory at a time: wait for stage 2 of the last.
            while executor and pending(staged.parent):
                time.sleep(0.05)
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
        save_id = [uuid.uuid4().hex[:12]]
        if _distributed():
            self._barrier()  # every node's staging directory exists before anyone writes
            dist.broadcast_object_list(save_id, src=0, group=self.process_group)
        dcp.save(
            staged_state,
            storage_writer=dcp.FileSystemWriter(str(staged), sync_files=False, thread_count=write_threads()),
            process_group=self.process_group,
            no_dist=not _distributed(),
        )
        if _is_node_main():
            world = dist.get_world_size() if _distributed() else 1
            nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
            mark_ready(
                staged,
                final=join(self.root, step_dir_name(step)),
                descriptor=descriptor,
                keep=self.keep,
                save_id=save_id[0],
                nodes=nodes,
                node=node_name(),
                ledger=str(self.ledger.resolve()) if self.ledger else None,  # for another cwd
            )
        self._barrier()  # every node has marked its share ready: the buffers are no longer the only copy
        self._snapshot().release()
        if _is_node_main() and not executor:
            persist(staged)

    def wait(self) -> None:
        """Block until this process's stage 2 is done; re-raise what went wrong with it."""
        if self._stage_two is not None:
            self._stage_two.join()
            self._stage_two = None
        error, self._stage_two_error = self._stage_two_error, None
        if error is not None:
            raise CheckpointError(
                f"checkpoint: saving step {self._stage_two_step} failed: {error}"
            ) from error

    def recover_staged(self, state: dict[str, Any]) -> None:
        """Finish what a crashed predecessor left in this node's memory. Collective.

        Staged snapshots that were complete are persisted (under `megascale launch` the executor does
        this; here we wait for it), incomplete ones dropped. Then, if every rank holds a snapshot of the
        same step in its buffer, laid out as `state` is, and that step is newer than every committed
        checkpoint, it is written and committed now: a crash just after stage 1 loses nothing."""
        root = staging_root(self.root)
        executor = os.environ.get(PERSISTER) == "executor"
        if _is_node_main() and root.is_dir():
            if executor:
                deadline = time.monotonic() + 600
                while pending(root) and time.monotonic() < deadline:
                    time.sleep(0.1)
            else:
                for staged in pending(root):
                    log.info(
                        "checkpoint: persisting %s, left in host memory by the previous run", staged.name
                    )
                    try:
                        persist(staged)
                    except Exception as err:  # noqa: BLE001 (a lost snapshot: the previous checkpoint serves)
                        log.warning("checkpoint: could not persist %s (%s); it is dropped", staged.name, err)
                for leftover in root.iterdir():
                    if leftover.name != SNAPSHOTS:
                        shutil.rmtree(leftover, ignore_errors=True)
        self._barrier()
        if not self.async_save:
            return
        restored = self._snapshot().restore(state)
        committed = list_checkpoints(self.root)
        step = restored[0]["step"] if restored is not None else -1
        # MIN over ranks gives the lowest step held, minus the highest, and minus the newest committed.
        votes = torch.tensor([step, -step, -(committed[-1][0] if committed else -1)], dtype=torch.int64)
        if _distributed():
            dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self.process_group)
        lowest, highest, newest = int(votes[0]), -int(votes[1]), -int(votes[2])
        if restored is None or lowest < 0 or lowest != highest or lowest <= newest:
            if highest > newest:
                log.warning(
                    "checkpoint: a snapshot of step %d is in memory but not on every rank in this layout "
                    "(steps %d to %d held); resuming from the newest committed checkpoint",
                    highest,
                    lowest,
                    highest,
                )
            self._snapshot().release()
            return
        log.warning(
            "checkpoint: step %d was only in host memory when the previous run stopped; writing it now",
            lowest,
        )
        meta, staged_state = restored
        self._hand_over(lowest, staged_state, meta["descriptor"])
        if executor and _is_node_main():
            while pending(root):
                time.sleep(0.1)
        self._barrier()

    # -- finding and loading --------------------------------------------------------------------------
    def latest(self) -> str | None:
        """The newest committed checkpoint, not verified."""
        checkpoints = list_checkpoints(self.root)
        return checkpoints[-1][1] if checkpoints else None

    def latest_verified(self) -> str | None:
        """The newest checkpoint whose files match their manifest, falling back past damaged ones with a
        warning. In a multi-process job rank 0 checks and every rank gets its answer."""
        choice: list[str | None] = [None]
        if _is_main():
            for step, location in reversed(list_checkpoints(self.root)):
                problem = verify(location)
                if problem is None:
                    choice[0] = location
                    break
                log.warning(
                    "checkpoint: step %d at %s failed verification (%s); trying the previous one",
                    step,
                    location,
                    problem,
                )
        if _distributed():
            dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def load(
        self, location: str, state: dict[str, Any], *, replicas: dist.ProcessGroup | None = None
    ) -> dict[str, Any]:
        """`load_checkpoint`; the bytes this rank read from storage are kept in `bytes_read`."""
        started = time.perf_counter()
        manifest, self.bytes_read = _load(location, state, replicas)
        log.info(
            "checkpoint: loaded %s in %.2f s (%.1f MiB read from storage by this rank%s)",
            location,
            time.perf_counter() - started,
            self.bytes_read / 2**20,
            ", shared with its replicas"
            if replicas is not None and dist.get_world_size(replicas) > 1
            else "",
        )
        return manifest

    # -- resuming -------------------------------------------------------------------------------------
    def resume(
        self, state: dict[str, Any], cfg: JobConfig, *, layout: str, replicas: dist.ProcessGroup | None = None
    ) -> dict[str, Any] | None:
        """Load the newest verified checkpoint into `state` (a snapshot a crashed predecessor left in memory
        is persisted first), or, when the run starts afresh, `checkpoint.init_from`'s model weights into
        `state["model"]`. Returns the resumed checkpoint's descriptor; None for a start from step 0.

        Refused: checkpoints that all fail verification, and (unless `checkpoint.resume` is off) a run
        whose ledger shows commits that are all gone. `layout` (this job's, in words) is compared with the
        checkpoint's in the log line, which also says what the config changed since."""
        self.recover_staged(state)
        committed = list_checkpoints(self.root) if cfg.checkpoint.resume else []
        location = self.latest_verified() if committed else None
        if committed and location is None:
            raise CheckpointError(
                f"checkpoint: every checkpoint under {self.root} failed verification (see the warnings "
                "above); move them away, or start afresh with --checkpoint.resume=false"
            )
        if location is None:
            self._start_afresh(state, cfg)
            return None
        check_resumable(location, read_manifest(location), cfg)
        descriptor = self.load(location, state, replicas=replicas)
        saved_layout, step = descriptor.get("layout", "1 process"), descriptor.get("step")
        log.info(
            "resumed from %s at step %s%s",
            location,
            step,
            f" (saved as {saved_layout}, now {layout})" if saved_layout != layout else "",
        )
        changes = changes_since(descriptor, cfg)
        if changes:
            log.warning("resumed with settings changed since step %s: %s", step, "; ".join(changes))
        if cfg.checkpoint.init_from:
            log.info("checkpoint.init_from is read only when a run starts: this one resumes")
        return descriptor

    def _start_afresh(self, state: dict[str, Any], cfg: JobConfig) -> None:
        """Step 0: refused if the ledger shows this run's checkpoints were lost, recorded in it otherwise;
        the model from `checkpoint.init_from` when set."""
        if cfg.checkpoint.enabled and self.ledger is not None:
            if cfg.checkpoint.resume:
                check_not_lost(self.ledger, self.root)
            if _is_main():
                record_start(self.ledger, self.root)
        if (init_from := init_from_path(cfg)) is not None:
            load_checkpoint(init_from, {"model": state["model"]})
            log.info("initialised the model from %s", init_from)

    def _barrier(self) -> None:
        if _distributed():
            dist.barrier(group=self.process_group)
