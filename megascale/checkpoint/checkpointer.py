"""Two-stage checkpoints (paper §4.4) through torch.distributed.checkpoint (DCP), to any fsspec location.

Stage 1 writes every rank's state with DCP into a node-local directory in memory (tmpfs), a copy at
memory speed, and training goes on. Stage 2 (persist.py) copies each node's files to the final location
in the background and commits the checkpoint by writing `manifest.json` last, with every file's size
and CRC-32: a checkpoint without a manifest does not exist, so a crash at any moment leaves either the
previous state or a complete new one. Under `megascale launch`, stage 2 runs in the node's executor, so
a snapshot survives the crash of the training processes that took it.

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
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

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
from megascale.errors import CheckpointError

__all__ = [
    "Checkpointer",
    "list_checkpoints",
    "load_checkpoint",
    "read_manifest",
    "verify",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

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


def _reader(location: str):
    fs, path = split_location(location)
    return dcp.FileSystemReader(path) if isinstance(fs, LocalFileSystem) else FsspecReader(location)


def write_checkpoint(location: str, state: dict[str, Any], descriptor: dict[str, Any]) -> str:
    """Write and commit a checkpoint in the foreground, by a single process (e.g. `megascale convert`)."""
    fs, path = split_location(location)
    if fs.exists(join(path, MANIFEST)):
        fs.rm(join(path, MANIFEST))  # uncommit first: a crash below must not leave old files "verified"
    dcp.save(state, storage_writer=_writer(location), no_dist=True)
    commit(location, descriptor)
    return location


def load_checkpoint(location: str, state: dict[str, Any]) -> dict[str, Any]:
    """Load `location` into `state` in place (Stateful values get load_state_dict); returns its manifest.

    Collective over the default process group when there is one: every rank reads what its shards need."""
    manifest = read_manifest(location)
    try:
        dcp.load(state, storage_reader=_reader(location), no_dist=not _distributed())
    except Exception as err:  # DCP wraps storage and shape problems in several exception types
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"checkpoint: cannot load {location}: {first_line}") from err
    return manifest


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
    ):
        self.root = str(root)
        self.keep = keep
        self.async_save = async_save
        self.process_group = process_group
        self._stage_two: threading.Thread | None = None
        self._stage_two_error: BaseException | None = None
        self._stage_two_step: int | None = None

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
                prune(self.root, self.keep)
                log.info(
                    "checkpoint: saved step %d to %s in %.2f s", step, location, time.perf_counter() - started
                )
            self._barrier()
            return location

        staged = staging_root(self.root) / step_dir_name(step)
        if _is_node_main():
            # One snapshot per node in host memory at a time: wait for the executor's stage 2 of the last.
            while os.environ.get(PERSISTER) == "executor" and pending(staged.parent):
                time.sleep(0.05)
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
        save_id = [uuid.uuid4().hex[:12]]
        if _distributed():
            self._barrier()  # every node's staging directory exists before anyone writes
            dist.broadcast_object_list(save_id, src=0, group=self.process_group)
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(str(staged), sync_files=False, thread_count=write_threads()),
            process_group=self.process_group,
            no_dist=not _distributed(),
        )
        if _is_node_main():
            world = dist.get_world_size() if _distributed() else 1
            nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
            mark_ready(
                staged,
                final=location,
                descriptor=descriptor,
                keep=self.keep,
                save_id=save_id[0],
                nodes=nodes,
                node=node_name(),
            )
            if os.environ.get(PERSISTER) != "executor":
                self._stage_two_step = step
                self._stage_two = threading.Thread(
                    target=self._persist, args=(staged,), name="megascale-checkpoint-stage-2"
                )
                self._stage_two.start()
        log.info(
            "checkpoint: step %d in host memory after %.2f s; persisting in the background",
            step,
            time.perf_counter() - started,
        )
        return location

    def _persist(self, staged) -> None:
        try:
            persist(staged)
        except BaseException as err:  # noqa: BLE001 (re-raised by wait())
            self._stage_two_error = err

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

    def recover_staged(self) -> None:
        """Persist snapshots a crashed predecessor left complete in this node's host memory, and drop
        incomplete ones. Collective. (Under `megascale launch` the executor does this as they appear.)"""
        root = staging_root(self.root)
        if _is_node_main() and os.environ.get(PERSISTER) != "executor" and root.is_dir():
            for staged in pending(root):
                log.info("checkpoint: persisting %s, left in host memory by the previous run", staged.name)
                try:
                    persist(staged)
                except Exception as err:  # noqa: BLE001 (a lost snapshot: the previous checkpoint serves)
                    log.warning("checkpoint: could not persist %s (%s); it is dropped", staged.name, err)
            for leftover in root.iterdir():
                shutil.rmtree(leftover, ignore_errors=True)
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

    def load(self, location: str, state: dict[str, Any]) -> dict[str, Any]:
        return load_checkpoint(location, state)

    def _barrier(self) -> None:
        if _distributed():
            dist.barrier(group=self.process_group)
