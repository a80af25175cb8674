"""Topology-aware placement: which global rank holds which (pipeline, data, context, tensor) coordinate,
and on which node and pod (MegaScale, arXiv:2402.15627 §2, §3.6).

Ranks fill nodes in order and nodes fill pods; TP is innermost, inside a node. Of the rank orders the
trainer accepts (`megascale.layout.MESH_ORDERS`) the one whose context-parallel rings, then data-parallel
groups, then pipelines span the fewest pods and nodes wins, ties going to the paper's tp-dp-pp: DP moves
every gradient and weight in synchronised bursts, PP activations spread over the step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from megascale.layout import MESH_ORDERS
from megascale.plan.hardware import HardwareProfile
from megascale.plan.job import Layout


@dataclass(frozen=True)
class Placement:
    """A rank order, every rank's coordinates, and how far each kind of group reaches."""

    rank_order: str
    coordinates: list[dict[str, int]]  # indexed by global rank: {"pp", "dp", "cp", "tp", "node", "pod"}
    nodes_spanned: dict[str, int]  # the most nodes any group of each kind (tp, dp, pp, cp, ep) touches
    pods_spanned: dict[str, int]

    def describe(self) -> str:
        parts = [
            f"{kind.upper()} groups span {self.nodes_spanned[kind]} node(s) "
            f"in {self.pods_spanned[kind]} pod(s)"
            for kind in self.nodes_spanned
        ]
        return f"rank order {self.rank_order} (--parallel.rank_order={self.rank_order}): " + "; ".join(parts)


def rank_coordinates(layout: Layout, rank_order: str) -> list[dict[str, int]]:
    """Each global rank's (pp, dp, cp, tp), as ParallelDims numbers its mesh: dp_shard holds dp x cp, cp
    innermost."""
    sizes = {"pp": layout.pp, "dp_replicate": 1, "dp_shard": layout.fsdp_ranks, "tp": layout.tp}
    names = MESH_ORDERS[rank_order]
    coordinates = []
    for index in itertools.product(*(range(sizes[name]) for name in names)):  # row-major: rank order
        where = dict(zip(names, index))
        batch, ring = divmod(where["dp_shard"], layout.cp)
        coordinates.append({"pp": where["pp"], "dp": batch, "cp": ring, "tp": where["tp"]})
    return coordinates


def place(layout: Layout, profile: HardwareProfile, rank_order: str) -> Placement:
    """Put `layout`'s ranks on nodes and pods in `rank_order`."""
    coordinates = rank_coordinates(layout, rank_order)
    per_pod = profile.devices_per_node * profile.nodes_per_pod
    for rank, where in enumerate(coordinates):
        where["node"], where["pod"] = rank // profile.devices_per_node, rank // per_pod
    ep_beyond_tp = layout.ep > (layout.tp if layout.experts_over_tp else 1)  # not just the tp group
    kinds = ["tp", "dp", "pp"] + (["cp"] if layout.cp > 1 else []) + (["ep"] if ep_beyond_tp else [])
    nodes, pods = {}, {}
    for kind in kinds:
        groups: dict[tuple[int, ...], list[dict[str, int]]] = {}
        for where in coordinates:
            groups.setdefault(_group_key(where, kind, layout), []).append(where)
        nodes[kind] = max(len({where["node"] for where in group}) for group in groups.values())
        pods[kind] = max(len({where["pod"] for where in group}) for group in groups.values())
    return Placement(rank_order, coordinates, nodes, pods)


def _group_key(where: dict[str, int], kind: str, layout: Layout) -> tuple[int, ...]:
    """What the ranks of one group of `kind` share: their other coordinates (a DP group: stage and tp rank; an
    expert-parallel group: ep consecutive dp_shard indices, or ep / tp data-parallel indices' tp groups)."""
    if kind == "ep" and layout.experts_over_tp:
        return where["pp"], where["dp"] // (layout.ep // layout.tp)
    if kind == "ep":
        return where["pp"], where["tp"], (where["dp"] * layout.cp + where["cp"]) // layout.ep
    if kind == "dp":
        return where["pp"], where["tp"]
    return tuple(where[name] for name in ("pp", "dp", "cp", "tp") if name != kind)


def choose_rank_order(layout: Layout, profile: HardwareProfile) -> Placement:
    """The order whose CP rings, then DP groups, then PP groups span the fewest pods, then nodes; ties go to
    MegaScale §2's tp-dp-pp."""

    def cost(placement: Placement) -> tuple[int, ...]:
        return tuple(
            count
            for kind in ("cp", "dp", "pp")
            if kind in placement.nodes_spanned
            for count in (placement.pods_spanned[kind], placement.nodes_spanned[kind])
        )

    candidates = [place(layout, profile, order) for order in MESH_ORDERS]  # tp-dp-pp first: wins ties
    return min(candidates, key=cost)
