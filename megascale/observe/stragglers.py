"""Stragglers: ranks whose compute is persistently slower than their peers' (paper §5.1's heat map).

In synchronous training the whole job runs at its slowest rank's pace, and every other rank's extra time
shows up as waiting in collectives; only the compute time tells which rank is slow. Every step, each rank's
compute seconds (from its timeline) travel in the all-reduce the step already makes for the loss, so rank 0
sees all of them at no extra cost. A rank is compared with the median of its peers: the other ranks doing
the same work (the same pipeline stage; all ranks without pipeline parallelism), over a window of steps,
so that one noisy step names no one.
"""

from __future__ import annotations

import collections
import statistics
from typing import Any


class StragglerDetector:
    """Feed it every rank's compute seconds each step; it names ranks slower than `ratio` x their peers'
    median over the last `window` steps (each rank's median too), once per episode: a named rank stays
    named until it is back below half that margin, so noise around the bar does not repeat the news."""

    def __init__(self, stage_of_rank: list[int], window: int, ratio: float):
        self.stage_of_rank = stage_of_rank
        self.window, self.ratio = window, ratio
        self.history: list[collections.deque] = [collections.deque(maxlen=window) for _ in stage_of_rank]
        self.named: set[int] = set()

    def observe(self, compute_s: list[float]) -> list[dict[str, Any]]:
        """New findings after this step: [{'rank', 'ratio', 'compute_s', 'peers_s'}]."""
        for history, seconds in zip(self.history, compute_s):
            history.append(seconds)
        if len(self.history[0]) < self.window or self.ratio <= 0:
            return []
        typical = [statistics.median(history) for history in self.history]
        findings = []
        for rank, mine in enumerate(typical):
            peers = [
                typical[other]
                for other, stage in enumerate(self.stage_of_rank)
                if other != rank and stage == self.stage_of_rank[rank]
            ] or [typical[other] for other in range(len(typical)) if other != rank]
            if not peers:
                continue
            peers_s = statistics.median(peers)
            if peers_s <= 0:
                continue
            if rank not in self.named and mine > self.ratio * peers_s:
                self.named.add(rank)
                findings.append(
                    {"rank": rank, "ratio": round(mine / peers_s, 3), "compute_s": mine, "peers_s": peers_s}
                )
            elif rank in self.named and mine < (1 + (self.ratio - 1) / 2) * peers_s:
                self.named.discard(rank)  # well below the bar again: a new episode may be reported
        return findings

    def stragglers(self) -> list[int]:
        return sorted(self.named)
