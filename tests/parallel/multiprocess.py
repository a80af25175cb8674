"""Run a function on N local ranks joined by a gloo process group, with a hard timeout.

Ranks are forked from the test process after `import torch` (no store or process group exists yet, which
is what makes forking safe), so N ranks start in a fraction of a second instead of seconds each. A rank's
exception, or a hang past the timeout, fails the calling test; every child is killed by pid either way.
"""

import gc
import multiprocessing
import os
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def _rank_main(fn, rank, world_size, init_file, results, args):
    renew_pools_after_fork()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 (reported to the parent, which fails the test)
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def renew_pools_after_fork() -> None:
    """Make the thread pools a forked child inherited usable; call it first thing in the child.

    torch marks its intra-op pool as corrupted in a forked child and rebuilds it at the next parallel
    operation, unguarded: the first such operations of two threads at once (the main thread's and an
    asynchronous checkpoint's writer) can see it half rebuilt ("Invalid thread pool!", as a quickstart
    line did). Setting the thread count rebuilds it here, before the child has a second thread.
    Inductor resets its process pool in a forked child but keeps the parent's thread pool, whose threads
    the child does not have: a build submitted to it waits forever (a compiling row of the parity matrix
    hung so in the suite); it is dropped for a fresh one."""
    torch.set_num_threads(torch.get_num_threads())
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        async_compile.AsyncCompile.pool.cache_clear()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """fn(rank, world_size, *args) on every rank; returns the ranks' return values in rank order."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            context.Process(target=_rank_main, args=(fn, rank, world_size, init_file, results, args))
            for rank in range(world_size)
        ]
        gc.freeze()  # the parent's objects: shared copy-on-write, and no rank's collection scans them
        for proc in procs:
            proc.start()
        gc.unfreeze()
        outcomes = {}
        try:
            for _ in range(world_size):
                rank, status, value = results.get(timeout=timeout_s)
                if status == "error":
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                outcomes[rank] = value
        finally:
            join_or_kill(procs)
    return [outcomes[rank] for rank in range(world_size)]


def join_or_kill(procs: list[multiprocessing.Process], timeout_s: float = 5.0) -> None:
    """Join each of the processes this test started, killing (by pid) any still alive after `timeout_s`."""
    for proc in procs:
        proc.join(timeout=timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
