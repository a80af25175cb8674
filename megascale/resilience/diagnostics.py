"""Self-check diagnostics an executor runs on its node after a fault (paper §4.3): is this node fit to
rejoin? A matmul checked against float64 and timed, and a memory pattern test. (The paper's intra-node
all-to-all and neighbour all-reduce bandwidth tests are not here yet.)

A node fails when a result is wrong, or when its matmul rate falls below `min_speed_ratio` of the
expected figure the driver sends (this machine's calibrated peak): a slow node is a straggler for the job.
"""

from __future__ import annotations

import time
from typing import Any

from megascale.resilience.inject import active_faults


def _matmul_check(size: int = 256, repeats: int = 8) -> tuple[bool, float]:
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator, dtype=torch.float64)
    b = torch.randn(size, size, generator=generator, dtype=torch.float64)
    exact = a @ b
    a32, b32 = a.float(), b.float()
    correct = torch.allclose((a32 @ b32).double(), exact, rtol=1e-4, atol=1e-3)
    started = time.perf_counter()
    for _ in range(repeats):
        a32 @ b32
    seconds = time.perf_counter() - started
    return bool(correct), 2 * size**3 * repeats / seconds / 1e9


def _memory_check(megabytes: int = 64) -> bool:
    import torch

    count = megabytes * (1 << 20) // 8
    pattern = torch.arange(count, dtype=torch.int64)
    copy = pattern.clone()
    return bool(torch.equal(copy, pattern) and int(copy[-1]) == count - 1)


def run_self_check(node: str, command: dict[str, Any]) -> dict[str, Any]:
    """{'passed': bool, 'checks': {...}, 'reason': str | None} for this node."""
    correct, gflops = _matmul_check()
    memory_ok = _memory_check()
    expected = command.get("expected_gflops")
    min_ratio = command.get("min_speed_ratio", 0.25)
    checks = {"matmul_correct": correct, "matmul_gflops": round(gflops, 2), "memory_ok": memory_ok}
    reason = None
    if not correct:
        reason = "matmul result differs from the float64 reference"
    elif not memory_ok:
        reason = "memory pattern test failed"
    elif expected and gflops < min_ratio * expected:
        reason = f"matmul at {gflops:.1f} GFLOP/s, below {min_ratio:.2f} x the expected {expected:.1f}"
    node_index = int(node.rsplit("-", 1)[-1]) if node.rsplit("-", 1)[-1].isdigit() else -1
    for fault in active_faults(command.get("inject"), int(command.get("attempt", 0))):
        if fault.kind == "diagnose_fail" and int(fault.get("node", -2)) == node_index:
            reason = "injected failure (resilience.inject diagnose_fail)"
    return {"passed": reason is None, "checks": checks, "reason": reason}
