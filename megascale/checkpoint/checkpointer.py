"""Two-stage checkpoints (paper §4.4) through torch.distributed.checkpoint (DCP), to any fsspec location.

Stage 1 copies every rank's state into a buffer in the node's memory (snapshot.py), and training goes on.
In the background, DCP serialises that copy into a node-local directory in memory (tmpfs), and stage 2
(persist.py) copies each node's files to the final location and commits the checkpoint by writing
`manifest.json` last, with every file's size and CRC-32: a checkpoint without a manifest does not exist,
so a crash at any moment leaves either the previous state or a complete new one. Under `megascale
launch`, stage 2 runs in the node's executor, so a snapshot survives the crash of the training processes
that took it. Between saves, `snapshot` takes stage 1 alone, a copy in memory written nowhere. A restart
resumes from the newest snapshot every rank still holds in memory, when no committed checkpoint is newer
(`restore_from_memory`: no storage read, the time of a memory copy); a save's snapshot that never reached
storage is then written as the save would have.

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

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch import nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from megascale.checkpoint.ledger import check_not_lost, record_commit, record_start
from megascale.checkpoint.manifest import (
    MANIFEST,
    commit,
    join,
    list_checkpoints,
    newest_verified,
    prune,
    read_manifest,
    split_location,
    step_dir_name,
    verify,
)
from megascale.checkpoint.persist import PERSISTER, mark_ready, node_name, pending, persist, staging_root
from megascale.checkpoint.resume import changes_since, check_resumable, data_reading_change, init_from_path
from megascale.checkpoint.snapshot import SnapshotSlots, flatten, load_into, split_leaves
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
    except (Exception, CheckpointException) as err:  # DCP's own is a BaseException, wrapping each rank's
        raise CheckpointError(f"checkpoint: cannot load {location}: {_first_failure(err)}") from err
    if group is not None and source is not None:
        _broadcast_state(state, source, group)
    return manifest, reader.bytes_read


def _first_failure(err: BaseException) -> str:
    """What failed, in one line: where DCP gathers the ranks' errors, the first rank's own."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


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
    if dist.get_rank() != source:
        load_into(state, tree, {**carried[0], **tensors})


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
        self._stage_two_slot: int | None = None  # the snapshot slot stage 2 reads from
        self._slots: SnapshotSlots | None = None
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

        staged_state = self._take(state, {"step": step, "descriptor": descriptor, "persist": True})
        log.info(
            "checkpoint: step %d in host memory after %.2f s; writing it in the background",
            step,
            time.perf_counter() - started,
        )
        self._start_stage_two(step, staged_state, descriptor)
        return location

    def snapshot(self, step: int, state: dict[str, Any], descriptor: dict[str, Any]) -> None:
        """Stage 1 alone: a copy of the state in this node's memory, written nowhere. A restart on the same
        nodes resumes from it (`resume`), so a fault costs the steps since the newest snapshot rather than
        since the newest checkpoint in storage."""
        self._take(state, {"step": step, "descriptor": {"step": step, **descriptor}, "persist": False})

    def _take(self, state: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
        """Stage 1 into the slot not holding the newest snapshot, once stage 2 no longer reads it."""
        slots = self._snapshots()
        if self._stage_two is not None and self._stage_two_slot == slots.next_slot():
            self.wait()
        return slots.take(state, meta)

    def _start_stage_two(self, step: int, staged_state: dict[str, Any], descriptor: dict[str, Any]) -> None:
        self._stage_two_step = step
        self._stage_two_slot = self._snapshots().newest
        self._stage_two = threading.Thread(
            target=self._in_background,
            args=(step, staged_state, descriptor),
            name="megascale-checkpoint-stage-2",
        )
        self._stage_two.start()

    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate this rank's snapshot memory (two buffers of `state`'s size) now rather than at the
        first snapshot."""
        self._snapshots().reserve(state)

    def close(self) -> None:
        """Wait for the save in flight, then give this rank's snapshot memory back (the run is over)."""
        self.wait()
        if self._slots is not None:
            self._slots.close()
            self._slots = None
        root = staging_root(self.root)
        for directory in (root, root.parent):  # this job's staging directory, then megascale-<user>
            try:
                directory.rmdir()
            except OSError:
                break  # not empty (another job's, or a snapshot left for stage 2), or already gone

    def _snapshots(self) -> SnapshotSlots:
        if self._slots is None:
            rank = dist.get_rank() if _distributed() else 0
            self._slots = SnapshotSlots(staging_root(self.root) / SNAPSHOTS, rank)
        return self._slots

    def _in_background(self, step: int, staged_state: dict[str, Any], descriptor: dict[str, Any]) -> None:
        try:
            self._hand_over(step, staged_state, descriptor)
        except BaseException as err:  # noqa: BLE001 (re-raised by wait())
            self._stage_two_error = err

    def _hand_over(self, step: int, staged_state: dict[str, Any], descriptor: dict[str, Any]) -> None:
        """Serialise a snapshot with DCP into the node's staging directory and hand it to stage 2
        (READY.json); then, unless the executor persists, persist it here. Collective. The buffer keeps
        the snapshot (and its record) until a later one overwrites it: a restart restores from it."""
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
        self._barrier()  # every node has marked its share ready
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

    def persist_leftovers(self) -> None:
        """Finish what a crashed predecessor left serialised in this node's memory: each complete snapshot
        is persisted, anything else dropped. Collective. Under `megascale launch` the executor persists
        them; this waits for it (`wait_for_executor`)."""
        root = staging_root(self.root)
        if _is_node_main() and root.is_dir():
            for staged in pending(root):
                log.info("checkpoint: persisting %s, left in host memory by the previous run", staged.name)
                try:
                    persist(staged)
                except Exception as err:  # noqa: BLE001 (a lost snapshot: the previous checkpoint serves)
                    log.warning("checkpoint: could not persist %s (%s); it is dropped", staged.name, err)
            for leftover in root.iterdir():
                if leftover.name != SNAPSHOTS:
                    shutil.rmtree(leftover, ignore_errors=True)
        self._barrier()

    def wait_for_executor(self, timeout_s: float = 600.0) -> None:
        """Until this node's executor has persisted the snapshots the previous processes left. Collective."""
        root = staging_root(self.root)
        if _is_node_main():
            deadline = time.monotonic() + timeout_s
            while pending(root) and time.monotonic() < deadline:
                time.sleep(0.1)
        self._barrier()

    def restore_from_memory(
        self, state: dict[str, Any], cfg: JobConfig, replicas: dist.ProcessGroup | None = None
    ) -> dict[str, Any] | None:
        """Load into `state` the newest snapshot that every rank, or a data-parallel replica of it
        (`replicas`: its group), still holds in its node's memory, when it is at least as new as the
        newest committed checkpoint and laid out as `state` is; returns its descriptor, or None (nothing
        read). Collective.

        No storage is read: a restart on the same nodes (the driver's standby, or any restart that keeps
        each rank on its node) resumes in the time of a memory copy, and a rank on a node that replaced a
        lost one receives its state from a replica that holds it. A snapshot that a save took and that
        never reached storage, nor is waiting for stage 2 on any node, is handed to stage 2 now, in the
        background, as the save would have: a crash just after stage 1 loses nothing."""
        slots, tree, rank = self._snapshots(), flatten(state), dist.get_rank() if _distributed() else 0
        held = slots.held(state, tree)
        committed = list_checkpoints(self.root)
        mine: dict[str, Any] = {
            "rank": rank,
            "held": sorted(held),
            "committed": committed[-1][0] if committed else -1,
            "staged": [int(path.name.split("-")[1]) for path in pending(staging_root(self.root))],
            "replicas": dist.get_process_group_ranks(replicas) if replicas is not None else [rank],
            "node": str(staging_root(self.root)),
        }
        views: list[Any] = [mine]
        if _distributed():
            views = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(views, mine, group=self.process_group)
        by_rank = {view["rank"]: view for view in views}
        newest_committed = max(view["committed"] for view in views)

        def covered(step: int) -> bool:  # every rank holds it, or a replica of it does
            return all(
                any(step in by_rank[peer]["held"] for peer in view["replicas"] if peer in by_rank)
                for view in views
            )

        candidates = sorted({step for view in views for step in view["held"]}, reverse=True)
        step = next((step for step in candidates if step >= newest_committed and covered(step)), -1)
        if step < 0:
            if candidates and candidates[0] > newest_committed:
                log.warning(
                    "checkpoint: a snapshot of step %d is in memory but not on every rank (or a replica of "
                    "it) in this layout; resuming from the newest committed checkpoint",
                    candidates[0],
                )
            return None
        holders = sorted(view["rank"] for view in views if step in view["held"])
        carried: list[Any] = (
            [(held[step]["descriptor"], bool(held[step].get("persist")))] if step in held else [None]
        )
        if _distributed():
            dist.broadcast_object_list(carried, src=holders[0], group=self.process_group)
        descriptor, persist = carried[0]
        check_resumable(f"the snapshot of step {step} in host memory", descriptor, cfg)
        staged_state = slots.restore_into(state, tree, step) if step in held else None
        group_holders = [peer for peer in mine["replicas"] if peer in holders]
        if replicas is not None and len(group_holders) < len(mine["replicas"]):
            _broadcast_state(state, group_holders[0], replicas)  # to the replicas that lack it
        waiting = any(step in view["staged"] for view in views)  # stage 2 has it
        if persist and step > newest_committed and not waiting:
            log.warning(
                "checkpoint: step %d was only in host memory when the previous run stopped; writing it now",
                step,
            )
            if staged_state is None:  # received from a replica: a snapshot of its own first
                staged_state = slots.take(state, {"step": step, "descriptor": descriptor, "persist": True})
            self._start_stage_two(step, staged_state, descriptor)
        else:
            self._barrier()  # every rank has read what it needs of the node's buffers
            if _is_node_main():
                slots.remove_others({view["rank"] for view in views if view["node"] == mine["node"]})
        return descriptor

    # -- finding and loading --------------------------------------------------------------------------
    def latest(self) -> str | None:
        """The newest committed checkpoint, not verified."""
        checkpoints = list_checkpoints(self.root)
        return checkpoints[-1][1] if checkpoints else None

    def latest_verified(self) -> str | None:
        """The newest checkpoint whose files match their manifest, falling back past damaged ones with a
        warning. In a multi-process job rank 0 checks and every rank gets its answer."""
        choice: list[str | None] = [newest_verified(self.root) if _is_main() else None]
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
        """Load into `state` the newest snapshot every rank holds in memory (`restore_from_memory`), else
        the newest verified checkpoint (snapshots a crashed predecessor left serialised are persisted
        first), or, when the run starts afresh, `checkpoint.init_from`'s model weights into
        `state["model"]`. Returns the resumed snapshot's or checkpoint's descriptor; None for a start from
        step 0.

        Refused: checkpoints that all fail verification, and (unless `checkpoint.resume` is off) a run
        whose ledger shows commits that are all gone. `layout` (this job's, in words) is compared with the
        checkpoint's in the log line, which also says what the config changed since."""
        executor = os.environ.get(PERSISTER) == "executor"
        if not executor:
            self.persist_leftovers()
        if cfg.checkpoint.resume and (descriptor := self.restore_from_memory(state, cfg, replicas)):
            saved_layout, step = descriptor.get("layout", "1 process"), descriptor.get("step")
            log.info("resumed from the snapshot of step %s in host memory (%s)", step, saved_layout)
            if (changes := changes_since(descriptor, cfg)) and _is_main():  # once for the job, not per rank
                log.warning("resumed with settings changed since step %s: %s", step, "; ".join(changes))
            return descriptor
        if executor:
            self.wait_for_executor()
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
        manifest = read_manifest(location)
        check_resumable(location, manifest, cfg)
        if (data_change := data_reading_change(manifest, cfg)) is not None:
            state = {part: value for part, value in state.items() if part != "data"}
            log.warning(
                "data: %s; the model, optimizer and schedule resume from step %s, the data at its beginning",
                data_change,
                manifest.get("step"),
            )
        descriptor = self.load(location, state, replicas=replicas)
        saved_layout, step = descriptor.get("layout", "1 process"), descriptor.get("step")
        log.info(
            "resumed from %s at step %s%s",
            location,
            step,
            f" (saved as {saved_layout}, now {layout})" if saved_layout != layout else "",
        )
        changes = changes_since(descriptor, cfg)
        if changes and _is_main():  # once for the job, not per rank
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
