"""Self-check diagnostics an executor runs on its node after a fault (paper §4.3): is this node fit to
rejoin? A matmul checked against float64 and timed, a memory pattern test, and an all-to-all among as
many local processes as the node trains with, timed.

A node fails when a result is wrong, or when a rate falls below `min_speed_ratio` of what is expected
of it: the figure in the config when one is set (`resilience.expected_gflops`, `expected_alltoall_gbps`),
else the median over the nodes diagnosed with it (the driver compares them, `slower_than_peers`), so a
node markedly slower than its peers is evicted as a straggler would be. The all-reduce with neighbour
nodes, which needs two nodes at a time, is in links.py.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

from megascale.resilience.inject import active_faults

RATES = {"matmul_gflops": "expected_gflops", "alltoall_gbps": "expected_alltoall_gbps"}


def _matmul_check(size: int = 256, repeats: int = 8, seconds: float = 0.3) -> tuple[bool, float]:
    """(correct, GFLOP/s) of float32 matmuls on one thread: the best of timed rounds over `seconds`, so
    that a moment of contention (other processes on the node) is not taken for a slow node."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator, dtype=torch.float64)
    b = torch.randn(size, size, generator=generator, dtype=torch.float64)
    exact = a @ b
    a32, b32 = a.float(), b.float()
    correct = torch.allclose((a32 @ b32).double(), exact, rtol=1e-4, atol=1e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best, deadline, rounds = 0.0, time.perf_counter() + seconds, 0
        while rounds < 5 or time.perf_counter() < deadline:
            started = time.perf_counter()
            for _ in range(repeats):
                a32 @ b32
            best = max(best, 2 * size**3 * repeats / (time.perf_counter() - started) / 1e9)
            rounds += 1
    finally:
        torch.set_num_threads(threads)
    return bool(correct), best


def _memory_check(megabytes: int = 64) -> bool:
    import torch

    count = megabytes * (1 << 20) // 8
    pattern = torch.arange(count, dtype=torch.int64)
    copy = pattern.clone()
    return bool(torch.equal(copy, pattern) and int(copy[-1]) == count - 1)


def _alltoall_worker(rank: int, world: int, init_file: str, megabytes: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        send = torch.full((megabytes * (1 << 20) // 4,), float(rank))
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send)  # warm-up: connections made
        dist.barrier()
        started = time.perf_counter()
        for _ in range(rounds):
            dist.all_to_all_single(receive, send)
        seconds = time.perf_counter() - started
        chunk = send.numel() // world
        correct = all(bool((receive[i * chunk : (i + 1) * chunk] == i).all()) for i in range(world))
        # Bytes each rank sent to others per second (the bus bandwidth of an all-to-all).
        rate = torch.tensor([send.numel() * 4 * (world - 1) / world * rounds / seconds / 1e9, float(correct)])
        dist.all_reduce(rate, op=dist.ReduceOp.MIN)
        if rank == 0:
            with open(f"{init_file}.result", "w") as file:
                file.write(f"{rate[0].item()} {rate[1].item()}")
    finally:
        dist.destroy_process_group()


def _alltoall_check(
    nproc: int, megabytes: int = 8, rounds: int = 4, timeout_s: float = 90.0
) -> tuple[bool, float]:
    """(correct, GB/s) of an all-to-all among `nproc` fresh local processes (gloo)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as directory:
        init_file = os.path.join(directory, "init")
        context = mp.start_processes(
            _alltoall_worker,
            args=(nproc, init_file, megabytes, rounds),
            nprocs=nproc,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    return False, 0.0
        except Exception:  # noqa: BLE001 (a worker failed: the check fails)
            return False, 0.0
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        gbps, correct = open(f"{init_file}.result").read().split()
    return float(correct) == 1.0, float(gbps)


def run_self_check(node: str, command: dict[str, Any]) -> dict[str, Any]:
    """{'passed': bool, 'checks': {...}, 'reason': str | None} for this node. `timing_s` in the command: how
    long the matmul rate is measured (0: five rounds, where no rate will be compared)."""
    correct, gflops = _matmul_check(seconds=float(command.get("timing_s", 0.3)))
    memory_ok = _memory_check()
    checks: dict[str, Any] = {
        "matmul_correct": correct,
        "matmul_gflops": round(gflops, 2),
        "memory_ok": memory_ok,
    }
    nproc = int(command.get("nproc_per_node", 1))
    alltoall_ok = True
    if nproc > 1 and command.get("bandwidth", True):
        alltoall_ok, gbps = _alltoall_check(nproc)
        checks.update(alltoall_correct=alltoall_ok, alltoall_gbps=round(gbps, 3))
    reason = None
    if not correct:
        reason = "matmul result differs from the float64 reference"
    elif not memory_ok:
        reason = "memory pattern test failed"
    elif not alltoall_ok:
        reason = f"all-to-all among {nproc} local processes failed or returned wrong data"
    else:
        reason = _below(checks, {rate: command.get(key) for rate, key in RATES.items()}, command, "expected")
    node_index = int(node.rsplit("-", 1)[-1]) if node.rsplit("-", 1)[-1].isdigit() else -1
    for fault in active_faults(command.get("inject"), int(command.get("attempt", 0))):
        if fault.kind == "diagnose_fail" and int(fault.get("node", -2)) == node_index:
            reason = "injected failure (resilience.inject diagnose_fail)"
    return {"passed": reason is None, "checks": checks, "reason": reason}


def _below(
    checks: dict[str, Any], expected: dict[str, float | None], command: dict[str, Any], what: str
) -> str | None:
    min_ratio = float(command.get("min_speed_ratio", 0.5))
    for rate, figure in expected.items():
        if figure and rate in checks and checks[rate] < min_ratio * figure:
            return f"{rate} = {checks[rate]}, below {min_ratio:.2f} x the {what} {figure:.3g}"
    return None


def slower_than_peers(results: dict[str, dict[str, Any]], min_speed_ratio: float) -> dict[str, str]:
    """Nodes whose matmul or all-to-all rate is below `min_speed_ratio` x the median of all nodes
    diagnosed together (three or more: with two, which one is slow is not knowable), with the reason."""
    slow = {}
    for rate in RATES:
        figures = {
            node: result["checks"][rate] for node, result in results.items() if rate in result["checks"]
        }
        if len(figures) < 3:
            continue
        median = statistics.median(figures.values())
        for node, figure in figures.items():
            if figure < min_speed_ratio * median and node not in slow:
                slow[node] = (
                    f"{rate} = {figure}, below {min_speed_ratio:.2f} x the median of the nodes {median:.3g}"
                )
    return slow
