"""Stragglers: ranks whose compute is persistently slower than their peers' (paper §5.1's heat map).

In synchronous training the whole job runs at its slowest rank's pace, and every other rank's extra time
shows up as waiting in collectives; only the compute time tells which rank is slow. Every step, each rank's
compute seconds (from its timeline) travel in the all-reduce the step already makes for the loss, so rank 0
sees all of them at no extra cost. A rank is compared with the median of its peers: the other ranks doing
the same work (the same pipeline stage; all ranks without pipeline parallelism), over a window of steps,
so that one noisy step names no one.

Expert parallelism: a rank also computes the token slots routed to its experts (experts.py), which travel
in the same all-reduce, so a rank whose experts are popular computes more on any machine. The detector
expects of each rank the compute its load predicts: with f the routed experts' share of the compute at an
even load and λ a rank's load over the mean of its stage's ranks (over the window, median), a rank should
compute (1 - f + f λ) / (1 - f + f λ_peers) times its peers' median, λ_peers the median of its peers'
loads; that prediction, when above 1, raises the rank's bar. The rule:

- A rank is named a straggler only when its compute is above `ratio` x what its load predicts: slower than
  its routing explains, so the machine is slow. The finding gives the load and the part of the excess it
  accounts for.
- A rank above `ratio` x its peers whose excess its load explains is not named; it is reported once per
  episode as a routing imbalance. Named stragglers are the candidates for eviction
  (`resilience.evict_stragglers`), and another node would get the same experts and the same tokens; the
  imbalance is mended by balancing (`model.moe.bias_update_rate`, `aux_loss_coeff`), not by hardware.
- A light load never lowers a rank's bar: f is estimated (a share of FLOPs, low where the slots' shuffling
  also costs time), and an error there must not name a healthy rank.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Sequence
from typing import Any


class StragglerDetector:
    """Feed it every rank's compute seconds each step (and, with expert parallelism, every rank's expert
    load); it names ranks slower than `ratio` x their peers' median over the last `window` steps (each
    rank's median too), once per episode: a named rank stays named until it is back below half that margin,
    so noise around the bar does not repeat the news. `expert_share` is f above (0 without experts)."""

    def __init__(self, stage_of_rank: list[int], window: int, ratio: float, expert_share: float = 0.0):
        self.stage_of_rank = stage_of_rank
        self.window, self.ratio, self.expert_share = window, ratio, expert_share
        self.history: list[collections.deque] = [collections.deque(maxlen=window) for _ in stage_of_rank]
        self.loads: list[collections.deque] = [collections.deque(maxlen=window) for _ in stage_of_rank]
        self.named: set[int] = set()
        self.routed: set[int] = set()  # over the bar by their routing alone, reported once per episode

    def observe(self, compute_s: list[float], expert_slots: Sequence[float] = ()) -> list[dict[str, Any]]:
        """New findings after this step: [{'rank', 'ratio', 'compute_s', 'peers_s', 'straggler'}], with an
        expert load also 'load' (its experts' slots over its stage's mean) and 'explained' (the compute
        ratio that load accounts for). `straggler` is False for a routing imbalance (named by no one)."""
        for history, seconds in zip(self.history, compute_s):
            history.append(seconds)
        for loads, slots in zip(self.loads, expert_slots):
            loads.append(slots)
        if len(self.history[0]) < self.window or self.ratio <= 0:
            return []
        typical = [statistics.median(history) for history in self.history]
        load = self._load_over_mean()
        release = 1 + (self.ratio - 1) / 2  # well below the bar again: a new episode may be reported
        findings = []
        for rank, mine in enumerate(typical):
            peers = self._peers(rank)
            if not peers:
                continue
            peers_s = statistics.median(typical[other] for other in peers)
            if peers_s <= 0:
                continue
            over, explained = mine / peers_s, 1.0
            finding = {"rank": rank, "ratio": round(over, 3), "compute_s": mine, "peers_s": peers_s}
            if load is not None:
                explained = self._explained(load[rank], statistics.median(load[other] for other in peers))
                finding |= {"load": round(load[rank], 3), "explained": round(explained, 3)}
            if rank in self.named:
                if over < release * explained:
                    self.named.discard(rank)
            elif over > self.ratio * explained:
                self.named.add(rank)
                self.routed.discard(rank)
                findings.append({**finding, "straggler": True})
            elif over > self.ratio and rank not in self.routed:
                self.routed.add(rank)
                findings.append({**finding, "straggler": False})
            elif over < release:
                self.routed.discard(rank)
        return findings

    def stragglers(self) -> list[int]:
        return sorted(self.named)

    def _peers(self, rank: int) -> list[int]:
        """The other ranks of its pipeline stage; all other ranks when it has none there."""
        stage = self.stage_of_rank[rank]
        same = [other for other, s in enumerate(self.stage_of_rank) if other != rank and s == stage]
        return same or [other for other in range(len(self.stage_of_rank)) if other != rank]

    def _load_over_mean(self) -> list[float] | None:
        """Each rank's median expert load over the window, over the mean of its stage's ranks'; None
        without expert loads."""
        if len(self.loads[0]) < self.window:
            return None
        typical = [statistics.median(loads) for loads in self.loads]
        stage_mean = {
            stage: statistics.fmean(typical[r] for r, s in enumerate(self.stage_of_rank) if s == stage)
            for stage in set(self.stage_of_rank)
        }
        return [
            slots / stage_mean[stage] if stage_mean[stage] > 0 else 1.0
            for slots, stage in zip(typical, self.stage_of_rank)
        ]

    def _explained(self, mine: float, peers: float) -> float:
        """The compute over its peers' that a rank's expert load predicts, never below 1 (see the module
        docstring): (1 - f + f λ) / (1 - f + f λ_peers)."""
        dense = 1 - self.expert_share
        return max(1.0, (dense + self.expert_share * mine) / (dense + self.expert_share * peers))


def describe(finding: dict[str, Any], window: int, step: int) -> str:
    """The warning for a finding of `StragglerDetector.observe`. A straggler's begins 'straggler: rank R
    computes X.XXx' (report.STRAGGLER_LINE reads it); a routing imbalance's does not."""
    text = (
        f"rank {finding['rank']} computes {finding['ratio']:.2f}x the median of its peers "
        f"({finding['compute_s']:.4f} s against {finding['peers_s']:.4f} s per step over the {window} steps "
        f"to step {step})"
    )
    if not finding["straggler"]:
        return (
            f"routing imbalance: {text}; its experts took {finding['load']:.2f}x the mean load, which "
            f"accounts for {finding['explained']:.2f}x (routing imbalance, not the machine): not named a "
            "straggler"
        )
    if finding.get("load", 0.0) > 1.0:
        text += (
            f"; its experts took {finding['load']:.2f}x the mean load, which accounts for "
            f"{finding['explained']:.2f}x: the rest is the machine"
        )
    return f"straggler: {text}"
