"""Barrier-free group creation (paper §3.5): the same mesh as torch's `init_device_mesh`, built with no
global barrier, each group created by its members only."""

import os

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megascale.parallel.dims import MESH_ORDERS, ParallelDims
from tests.parallel.multiprocess import run_ranks

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")
REAL_BARRIER = distributed_c10d._store_based_barrier


def _record_barriers(barriers: list[int]):
    """Counts every store barrier run from now on (its number of participants), and turns on the barrier
    torch runs after each group's creation (off by default since torch 2.1), as older torch always did."""

    def counting_barrier(rank, store, group_name, rendezvous_count, timeout, **kwargs):
        barriers.append(rendezvous_count)
        return REAL_BARRIER(rank, store, group_name, rendezvous_count, timeout, **kwargs)

    distributed_c10d._store_based_barrier = counting_barrier
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1"


def _groups_and_sums(rank, world_size, rank_order):
    torch_dims, dims = (
        ParallelDims(pp=2, dp_replicate=1, dp_shard=2, tp=2, rank_order=rank_order) for _ in "ab"
    )
    torch_barriers, own_barriers = [], []
    _record_barriers(torch_barriers)
    torch_mesh = torch_dims.build_mesh("cpu", timeout_s=30, barrier_free=False)
    _record_barriers(own_barriers)
    own_mesh = dims.build_mesh("cpu", timeout_s=30)
    sums = {}
    for name in DIM_NAMES:
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=own_mesh[name].get_group())
        sums[name] = int(total.item())
    ranks = {
        kind: {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in DIM_NAMES}
        for kind, mesh in (("torch", torch_mesh), ("own", own_mesh))
    }
    return {
        "ranks": ranks,
        "mesh_equal": torch.equal(torch_mesh.mesh, own_mesh.mesh),
        "names": own_mesh.mesh_dim_names,
        "coordinates": (torch_dims.coordinates(), dims.coordinates()),
        "sums": sums,
        "torch_barriers": torch_barriers,
        "own_barriers": own_barriers,
    }


def test_member_only_groups_form_the_torch_mesh_without_a_global_barrier():
    for rank_order in ("tp-dp-pp", "tp-pp-dp"):
        results = run_ranks(_groups_and_sums, 8, rank_order, timeout_s=60)
        for rank, result in enumerate(results):
            assert result["mesh_equal"] and result["names"] == MESH_ORDERS[rank_order]
            assert result["ranks"]["own"] == result["ranks"]["torch"], (rank, result["ranks"])
            assert result["coordinates"][0] == result["coordinates"][1]
            for name, members in result["ranks"]["own"].items():
                assert rank in members and result["sums"][name] == sum(members), (rank, name)
            # torch: one barrier of all 8 ranks for each of its groups, member or not: 4 pp, 8 dp_replicate
            # (size 1), 4 dp_shard, 4 tp.
            assert result["torch_barriers"] == [8] * 20, result["torch_barriers"]
            # own: one barrier per group this rank is in, among that group's members only.
            assert sorted(result["own_barriers"]) == [1, 2, 2, 2], result["own_barriers"]
