"""A parallel layout's arithmetic, without torch: how ranks are ordered into the mesh, which layers each
pipeline stage holds and which stages each pipeline rank holds.

The trainer (`megascale.parallel`) builds its mesh and cuts the model with these, and the planner
(`megascale.plan`) places ranks and prices the busiest pipeline rank with the same ones, so a layout costs
in the plan what it costs in training; neither layer imports the other.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from megascale.config.parallel import V_SCHEDULES

# Mesh dimensions outermost first, by parallel.rank_order (named innermost first, like the rank numbering
# reads: adjacent ranks differ in the first-named dimension). dp_replicate and dp_shard stay adjacent.
MESH_ORDERS = {
    "tp-dp-pp": ("pp", "dp_replicate", "dp_shard", "tp"),
    "tp-pp-dp": ("dp_replicate", "dp_shard", "pp", "tp"),
}


def split_layers(
    weights: Sequence[float], num_stages: int, first_extra: float = 0, last_extra: float = 0
) -> list[range]:
    """Contiguous layer ranges, one per stage: the heaviest stage as light as possible, and among such
    splits the most even one (least sum of squared stage weights).

    `weights[i]` is layer i's cost; `first_extra` / `last_extra` are what the first / last stage carry
    besides layers (embedding; norm and output layer). Every stage gets at least one layer. With equal
    weights and no extras this is the uniform split, the earlier stages taking the remainder.
    """
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} stages (each needs one layer)")
    if not first_extra and not last_extra and len(set(weights)) == 1:  # what the programme below finds
        base, remainder = divmod(n, num_stages)
        ends = [0, *itertools.accumulate(base + (stage < remainder) for stage in range(num_stages))]
        return [range(start, end) for start, end in zip(ends, ends[1:])]
    prefix = [0, *itertools.accumulate(weights)]

    def cost(stage: int, start: int, end: int) -> float:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == num_stages - 1 else 0)
        return prefix[end] - prefix[start] + extra

    def partition(combine: Callable[[float, float], float], limit: float) -> tuple[float, list[range]]:
        """Dynamic programme over (stages used, layers placed); stages heavier than `limit` are barred.
        Ties go to the latest cut, which leaves the extra layers of an even split to earlier stages."""
        best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
        cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
        best[0][0] = 0
        for stage in range(1, num_stages + 1):
            for end in range(stage, n - (num_stages - stage) + 1):
                for start in range(stage - 1, end):
                    weight = cost(stage - 1, start, end)
                    candidate = combine(best[stage - 1][start], weight)
                    if weight <= limit and candidate <= best[stage][end]:
                        best[stage][end], cut[stage][end] = candidate, start
        ranges, end = [], n
        for stage in range(num_stages, 0, -1):
            ranges.append(range(cut[stage][end], end))
            end = cut[stage][end]
        return best[num_stages][n], ranges[::-1]

    heaviest, _ = partition(max, math.inf)
    return partition(lambda total, weight: total + weight**2, heaviest)[1]


def stage_ids_of(pp_rank: int, pp: int, virtual_stages: int, schedule: str = "1f1b") -> list[int]:
    """The stages rank `pp_rank` holds: pp_rank, pp_rank + pp, ... (looped placement), or pp_rank and
    2 pp - 1 - pp_rank for the V schedules."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + chunk * pp for chunk in range(virtual_stages)]
