"""`megascale train --nproc N`: start N local training processes through torchrun's own machinery.

torch.distributed.elastic's `elastic_launch` is what `torchrun --standalone` runs: a c10d rendezvous on a
free local port, one agent supervising the workers and the environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT) that `init_process_group` reads. Each worker runs `python -m megascale.cli train` with
the user's arguments, so running under `torchrun` (or srun starting torchrun per node) directly is the same
code path. This module only builds the launch config and reports a failed worker in one line.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

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
