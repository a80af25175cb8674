"""Placement: TP inside a node, DP before PP (paper §2), numbered exactly as ParallelDims numbers ranks."""

import numpy as np
import pytest

from megascale.layout import MESH_ORDERS
from megascale.plan.hardware import PROFILES
from megascale.plan.job import Layout
from megascale.plan.placement import choose_rank_order, place, rank_coordinates
from tests.plan.paper import LAYOUT_175B

A100 = PROFILES["a100"]


@pytest.mark.parametrize("order", list(MESH_ORDERS))
def test_coordinates_match_the_device_mesh_numbering(order):
    layout = Layout(tp=2, pp=3, dp=4)
    sizes = {"pp": 3, "dp_replicate": 1, "dp_shard": 4, "tp": 2}
    names = MESH_ORDERS[order]
    mesh = np.arange(24).reshape([sizes[name] for name in names])  # DeviceMesh lays ranks out row-major
    for rank, where in enumerate(rank_coordinates(layout, order)):
        index = {"pp": where["pp"], "dp_replicate": 0, "dp_shard": where["dp"], "tp": where["tp"]}
        assert mesh[tuple(index[name] for name in names)] == rank


def test_tp_groups_stay_inside_a_node_and_dp_inside_a_pod_when_it_fits():
    layout = Layout(dp=16, **LAYOUT_175B)  # 1,024 GPUs: 128 nodes, 2 pods of 64
    placement = place(layout, A100, "tp-dp-pp")
    assert placement.nodes_spanned["tp"] == 1
    assert placement.pods_spanned["dp"] == 1  # a DP group is 16 nodes: one pod
    by_rank = placement.coordinates
    for rank in range(0, len(by_rank), 8):  # every node holds exactly one whole TP group
        assert {where["tp"] for where in by_rank[rank : rank + 8]} == set(range(8))
        assert len({(where["pp"], where["dp"]) for where in by_rank[rank : rank + 8]}) == 1


def test_the_paper_layout_at_12288_gpus_builds_dp_groups_before_pp():
    placement = choose_rank_order(Layout(dp=192, **LAYOUT_175B), A100)
    assert placement.rank_order == "tp-dp-pp"
    other = place(Layout(dp=192, **LAYOUT_175B), A100, "tp-pp-dp")
    assert placement.pods_spanned["dp"] < other.pods_spanned["dp"]
    assert "--parallel.rank_order=tp-dp-pp" in placement.describe()


def test_expert_parallel_groups_are_consecutive_data_parallel_ranks():
    """ParallelDims splits dp_shard as (edp, ep), ep innermost: with tp 2, ep 4 of dp 8 reaches 8
    consecutive ranks, one node; with ep 8, two nodes."""
    four, eight = (place(Layout(tp=2, dp=8, ep=ep, moe_tp="whole"), A100, "tp-dp-pp") for ep in (4, 8))
    assert four.nodes_spanned["ep"] == 1 and eight.nodes_spanned["ep"] == 2
    assert "EP groups span 1 node(s)" in four.describe()
    assert "ep" not in place(Layout(tp=2, dp=8), A100, "tp-dp-pp").nodes_spanned


def test_context_parallel_rings_are_adjacent_data_parallel_ranks_as_parallel_dims_numbers_them():
    """dp_shard holds dp x cp ranks, cp innermost (ParallelDims' (batch, cp) reshape): with tp 2 a ring of
    4 is 8 consecutive ranks, one node, while the DP group (the weights' FSDP group) is all dp x cp."""
    layout = Layout(tp=2, dp=2, cp=4)
    for rank, where in enumerate(rank_coordinates(layout, "tp-dp-pp")):
        assert rank == (where["dp"] * 4 + where["cp"]) * 2 + where["tp"]
    placement = choose_rank_order(layout, A100)
    assert placement.nodes_spanned["cp"] == 1 and placement.nodes_spanned["dp"] == 2
    assert "CP groups span 1 node(s)" in placement.describe()
    assert "cp" not in place(Layout(tp=2, dp=8), A100, "tp-dp-pp").nodes_spanned


def test_beside_context_parallelism_an_expert_parallel_group_is_consecutive_dp_shard_ranks():
    """The trainer splits experts over dp_shard, which holds the cp ranks: with tp 2, dp 4 x cp 2 and ep 4
    a group is 4 consecutive dp_shard ranks (ranks 0, 2, 4, 6 for tp rank 0), one node; with ep 8, two."""
    placement = place(Layout(tp=2, dp=4, cp=2, ep=4, moe_tp="whole"), A100, "tp-dp-pp")
    assert placement.nodes_spanned["ep"] == 1  # not dp ranks 0-3 with both cp ranks each: 2 nodes
    assert place(Layout(tp=2, dp=4, cp=2, ep=8, moe_tp="whole"), A100, "tp-dp-pp").nodes_spanned["ep"] == 2
