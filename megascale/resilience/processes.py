"""What the control plane knows of processes beyond being their parent: how to watch one a killed
predecessor started (`AdoptedProcess`: an executor adopted by a new driver; `AdoptedTorchrun`: a torchrun
adopted by a new executor), how to kill a torchrun session whole, and which of its ranks died or stopped
while torchrun runs (`RankWatch`, from /proc).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from megascale.checkpoint.staging import is_alive
from megascale.host import children_alive, process_state
from megascale.resilience.client import read_progress


class AdoptedProcess:
    """A process a killed predecessor started: not our child, so it is watched by its identity (pid,
    start time, boot) rather than waited for. Offers what its users take of subprocess.Popen; the exit
    status of a process that is not our child cannot be read (returncode -1 once it is gone)."""

    def __init__(self, identity: dict[str, Any]):
        self.identity, self.pid = identity, int(identity["pid"])
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not is_alive(self.identity):
            self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if timeout is not None and deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.1)
        return code

    def send_signal(self, sig: signal.Signals) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


class AdoptedTorchrun(AdoptedProcess):
    """A torchrun a killed predecessor started: not this executor's child, so its exit status cannot be
    read. Once it is gone it counts as having succeeded when each of its ranks said its training loop
    ended by itself (`finished` in its last progress report), as having failed otherwise."""

    def __init__(self, identity: dict[str, Any], attempt_dir: Path):
        super().__init__(identity)
        self.attempt_dir = attempt_dir

    def poll(self) -> int | None:
        if self.returncode is None and super().poll() is not None:
            reports = read_progress(self.attempt_dir).values()
            self.returncode = 0 if reports and all(report.get("finished") for report in reports) else 1
        return self.returncode


def kill_session(proc: subprocess.Popen | AdoptedProcess) -> None:
    """SIGKILL torchrun's session, and each worker's own (torchrun starts workers as session leaders, so a
    hung worker would outlive its torchrun's group); then reap torchrun."""
    if proc.poll() is None:
        for group in [proc.pid, *children_alive(proc.pid)]:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


class RankWatch:
    """The attempt's ranks whose process died or stopped while their torchrun still runs, read from the pid
    in each rank's progress report and the process's state in /proc: a SIGKILL, a segmentation fault or
    an OOM kill shows at the next heartbeat, before torchrun notices and stops the node; a SIGSTOP or a
    debugger's stop, which passes every self-check, shows as a rank stopped without a step since."""

    def __init__(self) -> None:
        self.stopped_since: dict[str, tuple[float, int]] = {}  # rank -> (first seen stopped, its step)

    def read(self, progress: dict[int, dict[str, Any]], now: float) -> tuple[list[int], dict[str, float]]:
        """(ranks whose process is gone, {rank: seconds stopped without a step})."""
        lost, stopped = [], {}
        for rank, report in progress.items():
            if report.get("finished") or "pid" not in report:
                continue
            state = process_state(report["pid"])
            if state in (None, "Z", "X"):
                lost.append(int(rank))
            elif state in ("T", "t"):
                since, step = self.stopped_since.get(str(rank), (now, report["step"]))
                if step != report["step"]:
                    since, step = now, report["step"]
                self.stopped_since[str(rank)] = (since, step)
                stopped[str(rank)] = round(now - since, 2)
            else:
                self.stopped_since.pop(str(rank), None)
        return sorted(lost), stopped
