"""Stage 2 of a checkpoint: move a snapshot from host memory to its final location, then commit it.

Stage 1 (checkpointer.py) leaves every node's share of the state in a node-local directory in memory
(tmpfs, /dev/shm) with a READY.json saying where it goes. `persist` copies a node's files to the final
location (a path or fsspec URL), checksumming as it copies, and leaves a marker listing them; the node
holding DCP's `.metadata` (the coordinator's) waits for every node's marker and commits the manifest.

It runs in a thread of the training process, or, under `megascale launch`, in the node's executor
(MEGASCALE_PERSISTER=executor). The executor outlives the training processes, so a snapshot taken just
before a crash is still persisted and the restart loses no more than the steps since that snapshot
(paper §4.4: "a background process takes over").
"""

from __future__ import annotations

import getpass
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megascale.checkpoint.ledger import record_commit
from megascale.checkpoint.manifest import CHUNK, MANIFEST, commit, join, prune, split_location
from megascale.checkpoint.staging import staging_base

log = logging.getLogger(__name__)

READY = "READY.json"
STAGING_DIR = "MEGASCALE_STAGING_DIR"
PERSISTER = "MEGASCALE_PERSISTER"
NODE = "MEGASCALE_NODE"


def staging_root(final_root: str) -> Path:
    """This node's in-memory staging directory for checkpoints bound for `final_root`."""
    if os.environ.get(STAGING_DIR):
        return Path(os.environ[STAGING_DIR])
    digest = hashlib.sha1(str(final_root).encode()).hexdigest()[:12]
    return staging_base() / f"megascale-{getpass.getuser()}" / digest


def node_name() -> str:
    return os.environ.get(NODE) or socket.gethostname()


def mark_ready(staged: Path, **ready: Any) -> None:
    """Hand a complete snapshot to stage 2: final, descriptor, keep, nodes, save_id, node (the name of
    the node that took it; stage 2 may run in another process, which need not know it)."""
    temporary = staged / f".{READY}.tmp"
    temporary.write_text(json.dumps(ready))
    os.replace(temporary, staged / READY)


def pending(root: Path) -> list[Path]:
    """Snapshots in `root` waiting for stage 2, oldest step first."""
    return sorted(path.parent for path in root.glob(f"*/{READY}")) if root.is_dir() else []


def abandon_marker(save_id: str) -> str:
    """The file that tells a coordinator waiting on save `save_id` to give up (see `abandon`)."""
    return f".abandoned-{save_id}"


def abandon(final: str, save_id: str) -> None:
    """Make the coordinator waiting on the other nodes' markers of this save stop without committing: the
    driver does this once every node's training processes are gone and no other node still persists, so
    the missing markers can never come (a node died before its share was ready)."""
    fs, path = split_location(final)
    with fs.open(join(path, abandon_marker(save_id)), "w") as marker:
        marker.write("")


def persist(
    staged: Path,
    marker_timeout_s: float = 600.0,
    on_wait: Callable[[dict[str, str] | None], None] | None = None,
) -> str:
    """Copy this node's files of one snapshot to its final location; commit if this node coordinates.
    The snapshot leaves host memory either way: a failed one is not retried (the next one is due).
    `on_wait` hears {'final', 'save_id'} while the coordinator waits for the other nodes, then None."""
    try:
        return _persist(staged, marker_timeout_s, on_wait or (lambda waiting: None))
    except BaseException:
        _discard_uncommitted(staged)
        raise
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def _discard_uncommitted(staged: Path) -> None:
    """Remove what a failed persist wrote of a step that can no longer commit (a full disk, a node that
    died): left there, it takes the space the next save needs, and retention only prunes after a commit.
    A committed step (a re-save that failed) keeps its files."""
    try:
        final = json.loads((staged / READY).read_text())["final"]
        fs, path = split_location(final)
        if fs.exists(path) and not fs.exists(join(path, MANIFEST)):
            fs.rm(path, recursive=True)
            log.warning("checkpoint: removed the uncommitted %s", final)
    except Exception as err:  # noqa: BLE001 (the persist's own error is the one to report)
        log.warning("checkpoint: could not remove an uncommitted step's files: %s", err)


def _persist(staged: Path, marker_timeout_s: float, on_wait: Callable[[dict[str, str] | None], None]) -> str:
    ready = json.loads((staged / READY).read_text())
    final, save_id = ready["final"], ready["save_id"]
    fs, path = split_location(final)
    fs.makedirs(path, exist_ok=True)
    if fs.exists(join(path, MANIFEST)):  # a re-save of a committed step: uncommit before overwriting
        fs.rm(join(path, MANIFEST))
    files = {}
    for source in sorted(staged.iterdir()):
        if source.name in (READY, f".{READY}.tmp"):
            continue
        size, crc = 0, 0
        with open(source, "rb") as reader, fs.open(join(path, source.name), "wb") as writer:
            while chunk := reader.read(CHUNK):
                writer.write(chunk)
                size, crc = size + len(chunk), zlib.crc32(chunk, crc)
        files[source.name] = {"bytes": size, "crc32": crc}
    with fs.open(join(path, f".node-{save_id}-{ready['node']}.json"), "w") as marker:
        marker.write(json.dumps(files))
    if (staged / ".metadata").exists():
        on_wait({"final": final, "save_id": save_id})
        try:
            _commit_when_all_nodes_are_in(final, ready, marker_timeout_s)
        finally:
            on_wait(None)
    return final


def _commit_when_all_nodes_are_in(final: str, ready: dict[str, Any], timeout_s: float) -> None:
    fs, path = split_location(final)
    prefix = f".node-{ready['save_id']}-"
    deadline = time.monotonic() + timeout_s
    while True:
        names = [entry.rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
        markers = [join(path, name) for name in names if name.startswith(prefix)]
        if len(markers) >= ready["nodes"]:
            break
        if abandon_marker(ready["save_id"]) in names:
            raise RuntimeError(
                f"{len(markers)} of {ready['nodes']} nodes persisted {final} and the others never will "
                "(their processes died first); not committed"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(markers)} of {ready['nodes']} nodes persisted {final}; not committed")
        time.sleep(0.1)
    files = {}
    for marker in markers:
        with fs.open(marker, "r") as file:
            files.update(json.load(file))
    commit(final, ready["descriptor"], files)
    record_commit(ready.get("ledger"), ready["descriptor"]["step"], final)
    for entry in fs.ls(path, detail=False):
        if entry.rsplit("/", 1)[-1].startswith((".node-", ".abandoned-")):
            fs.rm(entry)
    log.info("checkpoint: committed step %d to %s", ready["descriptor"]["step"], final)
    prune(final.rstrip("/").rsplit("/", 1)[0], ready["keep"])


class Persister(threading.Thread):
    """Persists every snapshot that appears under a staging root, in step order (the executor's).
    `waiting` is the save whose coordinator waits for the other nodes' markers, if any."""

    def __init__(self, root: Path, interval_s: float = 0.2):
        super().__init__(name="megascale-persister", daemon=True)
        self.root = root
        self.interval_s = interval_s
        self.errors: list[str] = []
        self.waiting: dict[str, str] | None = None
        self._stopping = threading.Event()

    def stop(self) -> None:
        """End the thread after the snapshot it is persisting, if any."""
        self._stopping.set()
        self.join()

    def run(self) -> None:
        while not self._stopping.is_set():
            for staged in pending(self.root):
                try:
                    persist(staged, on_wait=self._set_waiting)
                except Exception as err:  # noqa: BLE001 (reported in the heartbeat)
                    self.errors.append(f"persisting {staged.name}: {err}")
                    log.error("checkpoint: persisting %s failed: %s", staged, err)
            self._stopping.wait(self.interval_s)

    def _set_waiting(self, waiting: dict[str, str] | None) -> None:
        self.waiting = waiting

    def busy(self) -> int:
        return len(pending(self.root))
