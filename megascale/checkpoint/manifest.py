"""What makes a checkpoint exist: its manifest, committed last, with every file's size and CRC-32.

Storage-level helpers shared by the saver (checkpointer.py), the stage-2 persister (persist.py) and the
loader: listing committed checkpoints, reading and writing manifests, verifying files, retention. Every
location is a path or an fsspec URL.
"""

from __future__ import annotations

import json
import logging
import re
import time
import zlib
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from megascale.errors import CheckpointError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STAGED_MANIFEST = f".{MANIFEST}.tmp"
NODE_MARKER = re.compile(r"^\.node-.+\.json$")  # one per node's files, merged into the manifest
STEP_NAME = re.compile(r"^step-(\d{8})$")
CHUNK = 8 << 20


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def split_location(location: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(str(location))


def join(location: str, name: str) -> str:
    return f"{str(location).rstrip('/')}/{name}"


def _name(entry: str) -> str:
    return entry.rstrip("/").rsplit("/", 1)[-1]


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Committed checkpoints (those with a manifest) under `root`, oldest first, as (step, location)."""
    fs, path = split_location(root)
    if not fs.isdir(path):
        return []
    found = []
    for entry in fs.ls(path, detail=False):
        match = STEP_NAME.match(_name(entry))
        if match and fs.isfile(join(entry, MANIFEST)):
            found.append((int(match.group(1)), join(str(root), _name(entry))))
    return sorted(found)


def read_manifest(location: str) -> dict[str, Any]:
    """The step, config, layout and file list recorded in a committed checkpoint."""
    fs, path = split_location(location)
    if not fs.isdir(path):
        raise CheckpointError(f"checkpoint: {location} does not exist or is not a directory")
    try:
        with fs.open(join(path, MANIFEST), "r") as file:
            return json.load(file)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"checkpoint: {location} has no readable {MANIFEST} ({err}); it is incomplete or not a "
            "megascale checkpoint"
        ) from None


def checksum(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, int]:
    """{'bytes': size, 'crc32': CRC-32} of one file, read in chunks."""
    size, crc = 0, 0
    with fs.open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            size += len(chunk)
            crc = zlib.crc32(chunk, crc)
    return {"bytes": size, "crc32": crc}


def data_files(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """The checkpoint's own files: DCP's shards and .metadata, not the manifest or node markers."""
    names = [_name(entry) for entry in fs.ls(path, detail=False)]
    return sorted(n for n in names if n not in (MANIFEST, STAGED_MANIFEST) and not NODE_MARKER.match(n))


def verify(location: str) -> str | None:
    """None if every file of the checkpoint matches its manifest, else what is wrong, in a few words."""
    try:
        manifest = read_manifest(location)
    except CheckpointError as err:
        return str(err)
    fs, path = split_location(location)
    for name, expected in manifest.get("files", {}).items():
        file = join(path, name)
        if not fs.isfile(file):
            return f"file {name} is missing"
        found = checksum(fs, file)
        if found["bytes"] != expected["bytes"]:
            return f"file {name} has {found['bytes']} bytes, the manifest says {expected['bytes']}"
        if found["crc32"] != expected["crc32"]:
            return f"file {name} fails its CRC-32 check"
    return None


def newest_verified(root: str) -> str | None:
    """The newest committed checkpoint under `root` whose files match their manifest, or None; each newer
    one that fails verification is passed over with a one-line warning."""
    for step, location in reversed(list_checkpoints(root)):
        problem = verify(location)
        if problem is None:
            return location
        log.warning(
            "checkpoint: step %d at %s failed verification (%s); trying the previous one",
            step,
            location,
            problem,
        )
    return None


def verified_checkpoint(source: str) -> str:
    """The checkpoint a user named, verified as a resume verifies it: `source` itself when it is a
    checkpoint (refused in one line, naming it, when it fails), else the newest verified checkpoint of the
    run directory `source` (under its `checkpoints/`), falling back past damaged ones with a warning."""
    fs, path = split_location(source)
    if fs.isfile(join(path, MANIFEST)):
        if (problem := verify(source)) is not None:
            raise CheckpointError(
                f"checkpoint: {source} failed verification ({problem}); name an earlier checkpoint of its "
                "run, or the run directory to take its newest verified one"
            )
        return source
    root = join(source, "checkpoints")
    if not list_checkpoints(root):
        raise CheckpointError(
            f"checkpoint: {source} is neither a checkpoint (no {MANIFEST}) nor a run directory with "
            "committed checkpoints"
        )
    location = newest_verified(root)
    if location is None:
        raise CheckpointError(
            f"checkpoint: every checkpoint under {root} failed verification (see the warnings above); "
            "name a checkpoint kept elsewhere, or train again"
        )
    return location


def commit(location: str, descriptor: dict[str, Any], files: dict[str, dict[str, int]] | None = None) -> None:
    """Write the manifest last (atomically by rename on local disks; an object store's put is atomic).
    `files` are checksums already taken; the rest of the directory is read and summed here."""
    fs, path = split_location(location)
    files = dict(files or {})
    for name in data_files(fs, path):
        if name not in files:
            files[name] = checksum(fs, join(path, name))
    manifest = json.dumps({"saved_at": time.time(), **descriptor, "files": files}, indent=2)
    target = join(path, STAGED_MANIFEST) if isinstance(fs, LocalFileSystem) else join(path, MANIFEST)
    with fs.open(target, "w") as file:
        file.write(manifest)
    if target != join(path, MANIFEST):
        fs.mv(target, join(path, MANIFEST))


def prune(root: str, keep: int) -> None:
    """Delete committed checkpoints beyond the newest `keep`, and uncommitted leftovers (a save that
    died) older than the newest committed one. What is deleted is always older than the newest
    committed checkpoint, so the newest verified one survives."""
    committed = list_checkpoints(root)
    fs, root_path = split_location(root)
    for _, location in committed[: max(0, len(committed) - keep)]:
        fs.rm(split_location(location)[1], recursive=True)
    if not committed:
        return
    newest = committed[-1][0]
    for entry in fs.ls(root_path, detail=False):
        match = STEP_NAME.match(_name(entry))
        if match and int(match.group(1)) < newest and not fs.isfile(join(entry, MANIFEST)):
            fs.rm(entry, recursive=True)
