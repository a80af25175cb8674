"""The forked ranks of tests/parallel/multiprocess.py start clean of what the test process had running."""

import torch._inductor.config
from torch._inductor.async_compile import AsyncCompile

from tests.parallel.multiprocess import run_ranks


def _submit_a_build(rank: int, world_size: int) -> int:
    return AsyncCompile.pool().submit(lambda: rank + 1).result(timeout=10)


def test_a_rank_runs_compile_builds_after_the_test_process_ran_its_own(monkeypatch):
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 2)  # a pool even on one core
    # The parent's inductor thread pool, with idle threads a forked child would not have.
    assert AsyncCompile.pool().submit(lambda: 0).result(timeout=10) == 0
    assert run_ranks(_submit_a_build, 2, timeout_s=60) == [1, 2]
