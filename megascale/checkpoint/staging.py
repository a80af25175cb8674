"""Who owns a staging directory in host memory, and removing the ones whose owners are all gone.

Stage 1 of a checkpoint lives in host memory (/dev/shm): each rank's snapshot buffer, and snapshots waiting
for stage 2. On a real model that is the node's whole share of the training state, so a directory left by
a job that died (an executor or driver killed, a node rebooted into the same tmpfs) must not stay. Names
say which job a directory was for, not whether that job still runs; so every process that writes there
leaves an owner record (`<name>.owner`: pid, the process's start time and the boot it ran in, which pid
reuse cannot fake), and a directory is stale when none of its owners is alive. An executor removes stale
ones when it starts (and adopts its own node's, whose snapshots it then persists); `megascale clean`
removes them on demand.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

BASE = "MEGASCALE_STAGING_BASE"  # where megascale-* directories go (default /dev/shm, else the temp dir)
OWNER_SUFFIX = ".owner"
# A directory with no owner record yet may be one a process has just made: left alone this long.
UNOWNED_GRACE_S = 60.0


def staging_base() -> Path:
    """Host memory where there is some to write (/dev/shm), else the temporary directory."""
    if os.environ.get(BASE):
        return Path(os.environ[BASE])
    memory = Path("/dev/shm")
    return memory if memory.is_dir() and os.access(memory, os.W_OK) else Path(tempfile.gettempdir())


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), or None if there is no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]) if fields[0] not in ("Z", "X") else None  # field 22 of stat: starttime


def process_identity(pid: int | None = None) -> dict[str, Any]:
    """What names a process unambiguously on this host: its pid, start time and boot."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "start": _start_ticks(pid), "boot": _boot_id(), "host": socket.gethostname()}


def is_alive(identity: dict[str, Any]) -> bool:
    """Whether the process `identity` names still runs (a reused pid has another start time)."""
    if identity.get("boot") != _boot_id():
        return False
    start = _start_ticks(int(identity["pid"]))
    return start is not None and start == identity.get("start")


def claim(directory: Path, name: str) -> None:
    """Record this process as an owner of `directory` (made if missing), as `<name>.owner`."""
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".{name}{OWNER_SUFFIX}.tmp"
    temporary.write_text(json.dumps(process_identity()))
    os.replace(temporary, directory / f"{name}{OWNER_SUFFIX}")


def owners(directory: Path) -> list[dict[str, Any]]:
    """The owner records anywhere under `directory`."""
    found = []
    for path in directory.rglob(f"*{OWNER_SUFFIX}"):
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(path.read_text()))
    return found


def in_use(directory: Path) -> bool:
    """Whether a live process owns `directory`, or it is too new to have an owner record yet."""
    records = owners(directory)
    if not records:
        with contextlib.suppress(OSError):
            return time.time() - directory.stat().st_mtime < UNOWNED_GRACE_S
        return False
    return any(is_alive(record) for record in records)


def bytes_held(directory: Path) -> int:
    """The memory the files under `directory` take (their allocated blocks: tmpfs holds no holes)."""
    total = 0
    for path in directory.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_blocks * 512
    return total


def stale(base: Path | None = None) -> list[Path]:
    """Staging directories (`megascale-*/<one per node or run>`) under `base` that no live process owns."""
    base = staging_base() if base is None else base
    found = []
    for job in sorted(base.glob("megascale-*")):
        if job.is_dir() and not job.is_symlink():
            found += [path for path in sorted(job.iterdir()) if path.is_dir() and not in_use(path)]
    return found


def remove_stale(base: Path | None = None, keep: Path | None = None) -> list[tuple[Path, int]]:
    """Remove the stale staging directories under `base` (not `keep`), and job directories left empty;
    returns each removed directory with the bytes it held."""
    removed = []
    for path in stale(base):
        if keep is not None and path == keep:
            continue
        size = bytes_held(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append((path, size))
        with contextlib.suppress(OSError):  # not empty: another node's or run's directory is in it
            path.parent.rmdir()
    return removed
