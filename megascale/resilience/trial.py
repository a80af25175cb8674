"""The job a rehearsal does faults to (`megascale rehearse` and its soak), and what a fault needs of it:
a small `megascale launch` job, its processes, its progress, its checkpoints, and what it leaves behind.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from megascale.checkpoint.manifest import list_checkpoints
from megascale.checkpoint.staging import bytes_held, staging_base
from megascale.observe.metrics import read_metrics
from megascale.resilience.client import attempt_reports

STEPS, EVERY = 20, 4
# The rehearsal's job: small enough for a laptop, long enough that every fault lands mid-run.
JOB = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.attention.n_heads=4",
    "--model.attention.n_kv_heads=2",
    "--model.max_seq_len=32",
    "--data.seq_len=32",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=1",
    f"--training.steps={STEPS}",
    "--training.val_every=1000",
    "--training.log_every=1",
    f"--checkpoint.every={EVERY}",
    "--metrics.progress=false",
    "--metrics.tensorboard=false",
    "--metrics.hang_dump_s=2",
    "--resilience.nodes=2",
    "--resilience.nproc_per_node=2",
    "--resilience.heartbeat_interval_s=0.5",
    "--resilience.heartbeat_timeout_s=20",
    "--resilience.comm_flat_timeout_s=5",
    "--resilience.diagnose_bandwidth=false",
    "--parallel.timeout_s=300",
]
JOB_TIMEOUT_S = 400.0


class Job:
    """One row's `megascale launch`, and what a fault needs of it: its processes and its progress."""

    def __init__(self, work: Path, name: str, args: list[str]):
        self.run_dir = work / name
        shutil.rmtree(self.run_dir, ignore_errors=True)  # an earlier rehearsal's
        (work / f"{name}.console.log").unlink(missing_ok=True)
        self.args = [*args, f"--training.run_dir={self.run_dir}"]
        locations = [arg.split("=", 1)[1] for arg in args if arg.startswith("--checkpoint.location=")]
        self.checkpoint_root = locations[-1] if locations else str(self.run_dir / "checkpoints")
        self.work = work
        self.proc: subprocess.Popen  # the newest launch's
        self.launches: list[float] = []  # when each `megascale launch` of the row started
        self.exit_codes: list[int] = []

    def launch(self, *extra: str) -> None:
        command = [sys.executable, "-m", "megascale.cli", "launch", *self.args, *extra]
        log = open(self.run_dir.parent / f"{self.run_dir.name}.console.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.work)
        log.close()
        self.launches.append(time.time())

    def wait(self, timeout_s: float = JOB_TIMEOUT_S) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.exit_codes.append(code)
        return code

    def report(self, step: int, rank: int | None = None, timeout_s: float = 180.0) -> dict[str, Any]:
        """Until a rank (`rank`, else any) of the newest attempt reports `step` or later; that report."""
        deadline = time.time() + timeout_s
        while True:
            attempts = [int(path.name.split("-")[1]) for path in self.run_dir.glob("nodes/*/attempt-*")]
            for number, report in attempt_reports(self.run_dir, max(attempts, default=0)).items():
                if rank in (None, number) and report["step"] >= step:
                    return report
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"{self.run_dir.name}: no rank reached step {step}")
            time.sleep(0.05)

    def executor_pid(self, node: str) -> int:
        (pid,) = [pid for pid, line in processes_naming(self.run_dir) if f"--node\0{node}\0" in line]
        return pid

    def newest_checkpoint(self, after: int, timeout_s: float = 60.0) -> str:
        """The newest committed checkpoint once one of a step after `after` is committed."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            found = list_checkpoints(self.checkpoint_root)
            if found and found[-1][0] > after:
                return found[-1][1]
            time.sleep(0.1)
        raise RuntimeError(f"{self.run_dir.name}: no checkpoint after step {after} was committed")


def processes_naming(path: Path) -> list[tuple[int, str]]:
    """Live processes whose command line names `path`: (pid, the command line, NUL-separated)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(path) in line:
            found.append((int(cmdline.parent.name), line))
    return found


def losses(run_dir: Path) -> dict[int, float]:
    """The last logged loss of every step (a restarted attempt logs its recomputed steps again)."""
    return {record["step"]: record["loss"] for record in read_metrics(run_dir) if "loss" in record}


def staged_bytes(before: set[Path]) -> int:
    """Bytes held by megascale staging directories made since `before` was listed."""
    return sum(bytes_held(path) for path in set(staging_base().glob("megascale-*")) - before)
