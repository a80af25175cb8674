"""Run a function on N local ranks joined by a gloo process group, forked from the bench's process after
`import torch` (no process group exists yet, which is what makes forking safe): N ranks start in a
fraction of a second. A rank's exception, or a hang past the timeout, raises here; every rank is joined
or killed by pid before this returns.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def _rank_main(
    fn: Callable[..., Any], rank: int, world: int, init_file: str, results: Any, args: tuple
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 (reported to the parent, which stops the run)
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """fn(rank, world, *args) on every rank; the ranks' return values in rank order."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            context.Process(target=_rank_main, args=(fn, rank, world, init_file, results, args))
            for rank in range(world)
        ]
        for proc in procs:
            proc.start()
        outcomes: dict[int, Any] = {}
        try:
            for _ in range(world):
                try:
                    rank, status, value = results.get(timeout=timeout_s)
                except queue.Empty:
                    raise TimeoutError(f"ranks gave no result within {timeout_s:.0f} s") from None
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                outcomes[rank] = value
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return [outcomes[rank] for rank in range(world)]
