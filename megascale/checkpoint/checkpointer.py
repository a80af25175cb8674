"""Checkpoints of every Stateful part of a run, through torch.distributed.checkpoint (DCP).

DCP writes sharded state that reloads into any other layout, so the same files serve one process and
every 3D-parallel layout, whichever wrote them. What DCP leaves to us is the life cycle: a checkpoint is
written under a temporary name and renamed into place only once complete (plus a `megascale.json`
descriptor holding the step, the config and the layout), so a crash mid-save leaves nothing that looks
like a checkpoint; the newest committed one is found by name; the oldest beyond `keep` are deleted; and
a checkpoint written for another model shape is refused with a clear message before anything is loaded.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megascale.errors import CheckpointError

log = logging.getLogger(__name__)

DESCRIPTOR = "megascale.json"
_NAME = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(checkpoint_root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints under `checkpoint_root`, oldest first, as (step, path)."""
    if not checkpoint_root.is_dir():
        return []
    found = []
    for path in checkpoint_root.iterdir():
        match = _NAME.match(path.name)
        if match and (path / DESCRIPTOR).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def read_descriptor(path: Path) -> dict[str, Any]:
    """The step, model config and time recorded in a committed checkpoint."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint: {path} does not exist or is not a directory")
    try:
        return json.loads((path / DESCRIPTOR).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"checkpoint: {path} has no readable {DESCRIPTOR} ({err}); it is incomplete "
            f"or not a megascale checkpoint"
        ) from None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _dcp(operation, state: dict[str, Any], path: Path) -> None:
    """dcp.save / dcp.load over the default process group, or alone in a single-process run."""
    with warnings.catch_warnings():  # DCP warns when it runs without a process group, as intended then
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        operation(state, checkpoint_id=str(path), no_dist=not _distributed())


def save_checkpoint_dir(final: Path, state: dict[str, Any], descriptor: dict[str, Any]) -> Path:
    """Write `state` with DCP to a temporary sibling of `final`, add the descriptor, rename into place.

    Collective in a multi-process job: every rank writes its shards; rank 0 prepares the staging
    directory and commits it, between barriers."""
    staging = final.parent / f".{final.name}.tmp"
    if _is_main():
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    _dcp(dcp.save, state, staging)
    _barrier()
    if _is_main():
        (staging / DESCRIPTOR).write_text(json.dumps({"saved_at": time.time(), **descriptor}, indent=2))
        if final.exists():  # a re-save of the same step (e.g. after a resume) replaces it whole
            shutil.rmtree(final)
        os.replace(staging, final)
    _barrier()
    return final


class Checkpointer:
    """Saves and restores a dict of Stateful objects under <run_dir>/checkpoints/step-NNNNNNNN."""

    def __init__(self, checkpoint_root: str | Path, keep: int):
        self.root = Path(checkpoint_root)
        self.keep = keep

    def latest(self) -> Path | None:
        checkpoints = list_checkpoints(self.root)
        return checkpoints[-1][1] if checkpoints else None

    def save(self, step: int, state: dict[str, Any], descriptor: dict[str, Any]) -> Path:
        """Write `state` for `step` and commit it atomically; blocking. Returns the committed path."""
        started = time.perf_counter()
        final = save_checkpoint_dir(self.root / step_dir_name(step), state, {"step": step, **descriptor})
        log.info("checkpoint: saved step %d to %s in %.2f s", step, final, time.perf_counter() - started)
        self._prune()
        return final

    def load(self, path: Path, state: dict[str, Any]) -> dict[str, Any]:
        """Load `path` into `state` in place (Stateful values get load_state_dict). Returns its descriptor."""
        descriptor = read_descriptor(path)
        try:
            _dcp(dcp.load, state, path)
        except Exception as err:  # DCP wraps storage/shape problems in several exception types
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"checkpoint: cannot load {path}: {first_line}") from err
        return descriptor

    def _prune(self) -> None:
        if not _is_main():
            return
        checkpoints = list_checkpoints(self.root)
        for _, path in checkpoints[: max(0, len(checkpoints) - self.keep)]:
            shutil.rmtree(path, ignore_errors=True)
