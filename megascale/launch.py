"""`megascale train --nproc N`: start N local training processes through torchrun's own machinery.

torch.distributed.elastic's `elastic_launch` is what `torchrun --standalone` runs: a c10d rendezvous on a
free local port, one agent supervising the workers and the environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT) that `init_process_group` reads. Each worker runs `python -m megascale.cli train` with
the user's arguments, so running under `torchrun` (or srun starting torchrun per node) directly is the same
code path. This module only builds the launch config and reports a failed worker in one line; and, for
`megascale launch`, the line the job ends with (`outcome`), read from the driver's events and the metrics.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from megascale.observe.events import read_events
from megascale.observe.metrics import read_metrics

LAUNCHER_VARIABLES = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")


def under_launcher() -> bool:
    """True inside a worker started by torchrun / elastic (which sets these for every worker)."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def launch_local(nproc: int, worker_args: list[str]) -> int:
    """Run `python -m megascale.cli <worker_args>` on `nproc` local processes; the job's exit status.

    A failed worker's own output (with its error line) has already been printed; the status returned is
    its exit code, so a config error in the workers still exits 2. SIGINT/SIGTERM to the launcher reach
    the workers, which save a checkpoint and exit; the launcher then exits 0, as a single process does."""
    # Split the cores between the workers unless the user chose (torchrun would pin every worker to 1).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # Workers create their own store instead of reusing the agent's: restarts then never read a
    # previous attempt's addresses (../shared/pytorch-on-cpu.md, trap 2).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"megascale-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.5,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "megascale.cli", *worker_args)
    except SignalException as err:
        # The agent has passed the signal on and waited for the workers, which checkpoint and exit 0.
        print(
            f"stopped by {signal.Signals(err.sigval).name}: the workers were told to save and exit",
            file=sys.stderr,
        )
        return 0
    except ChildFailedError as err:
        rank, failure = first_cause(err.failures)
        print(
            f"error: rank {rank} of {nproc} exited with status {failure.exitcode} (its output is above)",
            file=sys.stderr,
        )
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def first_cause(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The failure to report of a launch's failed workers (by rank): one that exited by itself, before one
    killed by a signal, before one the agent terminated (SIGTERM) because another had failed; the lowest
    rank among equals. The lowest rank alone once reported rank 0's SIGTERM (-15) when rank 1 had exited
    with a config error (2), so the launch exited 1 instead of 2."""

    def rank_of_cause(item: tuple[int, ProcessFailure]) -> tuple[int, int]:
        rank, failure = item
        stopped_by_agent = failure.exitcode == -signal.SIGTERM
        return (0 if failure.exitcode > 0 else 2 if stopped_by_agent else 1), rank

    return min(failures.items(), key=rank_of_cause)


def outcome(run_dir: Path, steps: int, status: int) -> str:
    """The line `megascale launch` ends with: how the job ended (the driver's last decision in
    events.jsonl, or its exit `status` if it wrote none), the last logged step of `steps` with its loss
    and validation loss (metrics.jsonl), and the run directory."""
    events = read_events(run_dir)
    starts = [index for index, event in enumerate(events) if event["event"] == "driver"]
    ends = [e for e in events[starts[-1] if starts else 0 :] if e["event"] in ("done", "stopped", "give_up")]
    records = read_metrics(run_dir)
    last = records[-1] if records else None
    end = ends[-1]["event"] if ends else None
    if end == "done":
        state = "done" if last and last["step"] >= steps else "stopped at training.stop_at_step"
    elif end == "stopped":
        state = "stopped by signal, resumable"
    elif end == "give_up":
        state = f"gave up ({ends[-1]['reason']})"
    else:
        state = f"ended with status {status}"
    if last is None:
        return f"{state}: no step logged; run directory {run_dir}"
    val = f", val loss {_figure(last['val_loss'])}" if "val_loss" in last else ""
    return f"{state}: step {last['step']}/{steps}, loss {_figure(last['loss'])}{val}; run directory {run_dir}"


def _figure(value: float | str) -> str:
    """A loss as metrics.jsonl holds it: a number, or 'nan'/'inf' as text."""
    return f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else str(value)
