"""Two-stage checkpoints (paper §4.4) through torch.distributed.checkpoint (DCP), to any fsspec location.

Stage 1 copies every rank's state to host memory (DCP's stager: pinned memory on CUDA, ordinary memory on
CPU) and returns, so training goes on after a memory copy instead of a write. Stage 2 writes that copy in
the background through DCP (a thread, on the checkpointer's own gloo group: its collectives must never
interleave with training's on one group, ../shared/pytorch-on-cpu.md trap 1), and then rank 0 commits it
by writing `manifest.json` last: the step, the config, the layout and every file's size and CRC-32.

A checkpoint without a manifest does not exist, so a crash at any moment leaves either the previous state
or a complete new one. Loading verifies the files against the manifest and falls back to the previous
verified checkpoint, saying so. The newest `keep` committed checkpoints are kept; what is deleted is always
older than the one just committed, so the newest verified checkpoint survives.

DCP provides staging, the sharded format and resharding on load; what this module adds is the commit
protocol, the checksums, retention, and verification with fallback.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import warnings
import zlib
from concurrent.futures import Future
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from megascale.errors import CheckpointError

log = logging.getLogger(__name__)

# Single-process saves and loads run DCP without a process group, as intended; its warning says otherwise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MANIFEST = "manifest.json"
_STAGED_MANIFEST = f".{MANIFEST}.tmp"
_NAME = re.compile(r"^step-(\d{8})$")
_CHUNK = 8 << 20


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _fs(location: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(str(location))


def _join(location: str, name: str) -> str:
    return f"{str(location).rstrip('/')}/{name}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Committed checkpoints (those with a manifest) under `root`, oldest first, as (step, location)."""
    fs, path = _fs(root)
    if not fs.isdir(path):
        return []
    found = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        match = _NAME.match(name)
        if match and fs.isfile(_join(entry, MANIFEST)):
            found.append((int(match.group(1)), _join(str(root), name)))
    return sorted(found)


def read_manifest(location: str) -> dict[str, Any]:
    """The step, config, layout and file list recorded in a committed checkpoint."""
    fs, path = _fs(location)
    if not fs.isdir(path):
        raise CheckpointError(f"checkpoint: {location} does not exist or is not a directory")
    try:
        with fs.open(_join(path, MANIFEST), "r") as file:
            return json.load(file)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"checkpoint: {location} has no readable {MANIFEST} ({err}); it is incomplete or not a "
            "megascale checkpoint"
        ) from None


def _checksum(fs: fsspec.AbstractFileSystem, path: str) -> tuple[int, int]:
    """(bytes, CRC-32) of one file, read in chunks."""
    size, crc = 0, 0
    with fs.open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            size += len(chunk)
            crc = zlib.crc32(chunk, crc)
    return size, crc


def _data_files(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
    return sorted(name for name in names if name not in (MANIFEST, _STAGED_MANIFEST))


def verify(location: str) -> str | None:
    """None if every file of the checkpoint matches its manifest, else what is wrong, in a few words."""
    try:
        manifest = read_manifest(location)
    except CheckpointError as err:
        return str(err)
    fs, path = _fs(location)
    for name, expected in manifest.get("files", {}).items():
        file = _join(path, name)
        if not fs.isfile(file):
            return f"file {name} is missing"
        size, crc = _checksum(fs, file)
        if size != expected["bytes"]:
            return f"file {name} has {size} bytes, the manifest says {expected['bytes']}"
        if crc != expected["crc32"]:
            return f"file {name} fails its CRC-32 check"
    return None


def _commit(location: str, descriptor: dict[str, Any]) -> None:
    """Write the manifest last, atomically where the filesystem can rename (local disks)."""
    fs, path = _fs(location)
    files = {}
    for name in _data_files(fs, path):
        size, crc = _checksum(fs, _join(path, name))
        files[name] = {"bytes": size, "crc32": crc}
    manifest = json.dumps({"saved_at": time.time(), **descriptor, "files": files}, indent=2)
    if isinstance(fs, LocalFileSystem):
        staged = _join(path, _STAGED_MANIFEST)
        with fs.open(staged, "w") as file:
            file.write(manifest)
        fs.mv(staged, _join(path, MANIFEST))
    else:  # an object store's single put is atomic
        with fs.open(_join(path, MANIFEST), "w") as file:
            file.write(manifest)


def _writer(location: str):
    fs, path = _fs(location)
    return dcp.FileSystemWriter(path) if isinstance(fs, LocalFileSystem) else FsspecWriter(location)


def _reader(location: str):
    fs, path = _fs(location)
    return dcp.FileSystemReader(path) if isinstance(fs, LocalFileSystem) else FsspecReader(location)


def write_checkpoint(location: str, state: dict[str, Any], descriptor: dict[str, Any]) -> str:
    """Write and commit a checkpoint in the foreground, by a single process (e.g. `megascale convert`)."""
    fs, path = _fs(location)
    if fs.exists(_join(path, MANIFEST)):
        fs.rm(_join(path, MANIFEST))  # uncommit first: a crash below must not leave old files "verified"
    dcp.save(state, storage_writer=_writer(location), no_dist=True)
    _commit(location, descriptor)
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
    `process_group` is the group DCP's background saves use (one of their own, not the training group).
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
        self._pending: Future | None = None
        self._pending_step: int | None = None
        self._commit_thread: threading.Thread | None = None
        self._commit_error: BaseException | None = None

    # -- saving ---------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], descriptor: dict[str, Any]) -> str:
        """Stage 1 now (state copied to host memory); stage 2 and the commit in the background, or
        before returning when async_save is off. Waits for the previous save first. Returns the location
        the checkpoint will have once committed."""
        self.wait()
        location = _join(self.root, step_dir_name(step))
        fs, path = _fs(location)
        if _is_main():
            if fs.exists(path):  # a re-save of the same step (e.g. after a resume): uncommit, then replace
                fs.rm(path, recursive=True)
            fs.makedirs(path, exist_ok=True)
        self._barrier()
        started = time.perf_counter()
        descriptor = {"step": step, **descriptor}
        if self.async_save:
            stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=torch.accelerator.is_available(),
                    use_shared_memory=False,
                    use_async_staging=False,  # stage 1 ends when the copy is complete
                    use_non_blocking_copy=False,
                )
            )
            self._pending = dcp.async_save(
                state,
                storage_writer=_writer(location),
                process_group=self.process_group,
                async_stager=stager,
                no_dist=not _distributed(),
            )
        else:
            dcp.save(
                state,
                storage_writer=_writer(location),
                process_group=self.process_group,
                no_dist=not _distributed(),
            )
        stall_s = time.perf_counter() - started
        self._pending_step = step
        if not self.async_save:
            self._finish(location, descriptor, started)
            return location
        if _is_main():
            self._commit_thread = threading.Thread(
                target=self._commit_when_written,
                args=(self._pending, location, descriptor, started),
                name="megascale-checkpoint-commit",
                daemon=False,
            )
            self._commit_thread.start()
        log.info("checkpoint: step %d staged in %.2f s; writing it in the background", step, stall_s)
        return location

    def wait(self) -> None:
        """Block until the pending save is written and committed; re-raise what went wrong with it."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        if self._commit_thread is not None:
            self._commit_thread.join()
            self._commit_thread = None
        error, self._commit_error = self._commit_error, None
        if error is not None:
            raise CheckpointError(f"checkpoint: saving step {self._pending_step} failed: {error}") from error

    def _commit_when_written(self, pending: Future, location: str, descriptor: dict, started: float) -> None:
        try:
            pending.result()
            self._finish(location, descriptor, started)
        except BaseException as err:  # noqa: BLE001 (reported by wait())
            self._commit_error = err

    def _finish(self, location: str, descriptor: dict[str, Any], started: float) -> None:
        """Rank 0 commits (manifest last) and prunes once every rank's files are written; DCP's
        coordinator writes its metadata only after gathering all ranks' results, so when rank 0's write
        completes, all have."""
        if _is_main():
            _commit(location, descriptor)
            log.info(
                "checkpoint: committed step %d to %s, %.2f s after it was taken",
                descriptor["step"],
                location,
                time.perf_counter() - started,
            )
            self._prune()
        if not self.async_save:
            self._barrier()

    def _prune(self) -> None:
        """Delete committed checkpoints beyond the newest `keep`, and uncommitted leftovers (a crash in
        stage 2) older than the newest committed one."""
        committed = list_checkpoints(self.root)
        fs, root = _fs(self.root)
        for _, location in committed[: max(0, len(committed) - self.keep)]:
            fs.rm(_fs(location)[1], recursive=True)
        if not committed:
            return
        newest = committed[-1][0]
        for entry in fs.ls(root, detail=False):
            match = _NAME.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if match and int(match.group(1)) < newest and not fs.isfile(_join(entry, MANIFEST)):
                fs.rm(entry, recursive=True)

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
