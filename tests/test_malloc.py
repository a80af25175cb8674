"""The CPU process's allocator keeps the pages of freed tensors for the next ones (megascale/malloc.py)."""

import os
import resource

import pytest
import torch

from megascale.malloc import keep_freed_memory


@pytest.mark.skipif(
    not (os.confstr_names.get("CS_GNU_LIBC_VERSION") and os.confstr("CS_GNU_LIBC_VERSION")),
    reason="glibc only",
)
def test_freed_tensor_memory_is_reused_without_page_faults(monkeypatch):
    """A CPU run keeps the pages of freed tensors: glibc would map a 64 MiB tensor afresh each time (16,384
    page faults) and unmap it when freed. Malloc settings the process was started with are left alone."""
    for name in [name for name in os.environ if name.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    with monkeypatch.context() as started_with_its_own:
        started_with_its_own.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
        assert not keep_freed_memory()
    assert keep_freed_memory()
    for _ in range(16):  # the heap grows to its steady size (freed chunks merge after a few rounds)
        torch.ones(1 << 24)  # 64 MiB, freed at once
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        torch.ones(1 << 24)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before < 1_000
