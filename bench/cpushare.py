"""Emulated devices for bench/overlap.py: each rank gets an equal, fixed share of the machine's cores.

With more ranks than cores (four on this project's two), Linux gives a core to whichever rank can run: a
rank waiting in a collective lends its core to another rank, and a rank waits for a peer that was
descheduled for someone else's time slice. Neither happens to GPUs, which compute for one rank each, and
together they make most of a 4-rank layout's "exposed communication" waits that no overlap can hide. Here
every rank runs in a CFS bandwidth cgroup of its own (cgroup v1 `cpu` controller), capped at cores / ranks
of a core (`cpu.cfs_quota_us` of 1 ms, the smallest, per `cpu.cfs_period_us` of ranks / cores ms): a slower
device per rank, which idles while its rank waits, as a GPU does. Within a period a rank is still
descheduled once it has used its share, so a peer can wait for it for up to a period.

Needs root and the cgroup v1 `cpu` controller at /sys/fs/cgroup/cpu (a cgroup v2 machine is not handled:
`available()` says so and the bench runs without shares).
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
QUOTA_US = 1000  # the smallest quota CFS bandwidth control takes


def available() -> str | None:
    """None when shares can be set up here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if not (CPU_CGROUP / "cpu.cfs_quota_us").is_file():
        return "needs the cgroup v1 cpu controller at /sys/fs/cgroup/cpu"
    return None


class CpuShares:
    """One cgroup per rank, each capped at `cores / ranks` of a core; `add` puts a process in one."""

    def __init__(self, tag: str, ranks: int, cores: int):
        self.groups = [CPU_CGROUP / f"megascale-{tag}-rank{rank}" for rank in range(ranks)]
        self.quota_us, self.period_us = QUOTA_US, round(QUOTA_US * ranks / cores)

    def create(self) -> None:
        for group in self.groups:
            group.mkdir(exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(self.period_us))
            (group / "cpu.cfs_quota_us").write_text(str(self.quota_us))

    def add(self, rank: int, pid: int) -> None:
        """Move process `pid`, all its threads and what it starts later, into rank's cgroup. (A shell
        moving itself before it execs would not do: `ip netns exec` mounts a /sys without the cgroups.)"""
        (self.groups[rank] / "cgroup.procs").write_text(str(pid))

    def describe(self) -> str:
        share = self.quota_us / self.period_us
        return f"each rank capped at {share:.2f} of a core ({self.quota_us} us per {self.period_us} us)"

    def remove(self) -> None:
        """Remove the cgroups (their processes must have exited)."""
        for group in self.groups:
            if group.is_dir():
                group.rmdir()
