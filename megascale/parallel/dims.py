"""ParallelDims: the one owner of the 3D layout, its validation, the device mesh and every process group.

The layout is pp x dp_replicate x dp_shard x tp = world. Ranks are numbered with TP innermost (the fastest
links, inside a node), then data parallelism, then pipeline stages outermost (paper §2: DP groups are built
before PP groups so that DP traffic stays inside a pod); `parallel.rank_order = "tp-pp-dp"` swaps the outer
two. Which layouts are legal is degrees.py's: checked before any process group exists.

Group creation follows paper §3.5 (communicator set-up on 2,048 GPUs went from 1,047 s to under 5 s, in
part by dropping the global barrier that followed each group). `init_device_mesh` has every rank call
`new_group` for every group of every dimension, members or not, and with `TORCH_DIST_INIT_BARRIER=1`
(torch's behaviour before 2.1, an opt-in since) each call ends in a store barrier of the whole world:
O(groups) global barriers, O(n^2) store traffic. Here each rank creates only the groups it belongs to
(`use_local_synchronization=True`: non-members never hear of a group, and a barrier, if turned on, is
among its members), one dimension after another. So every member reaches a group with the same groups
behind it (torch names a member-only group after its ranks and that count), and no rank waits on a group
whose members are busy with another: the order removes the need for a barrier between groups. DeviceMesh
has no switch for member-only creation, so it wraps the groups (`DeviceMesh.from_group`). `bench/init.py`
measures the three ways side by side; this class decides the shape and names the sub-meshes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megascale.layout import MESH_ORDERS
from megascale.parallel.degrees import Degrees

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend  # the type of init_device_mesh's backend options


@dataclass
class ParallelDims(Degrees):
    """The layout's degrees (degrees.py: their rules) and, once `build_mesh` has run, the device mesh over
    them, which every question about this rank's place is answered from."""

    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _expert_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _context_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def build_mesh(
        self, device_type: str, timeout_s: float | None = None, *, barrier_free: bool = True
    ) -> DeviceMesh:
        """The 4-D mesh over pp, dp_replicate, dp_shard and tp, nested as `rank_order` says; its groups'
        collectives time out after `timeout_s` (DeviceMesh's own groups would otherwise take torch's
        30-minute default, not the default group's timeout).

        Every rank calls it once, right after `init_process_group` (or with the same process groups created
        before on every rank: a group's name counts them). With `barrier_free` (the default) a rank creates
        only its own groups, one per dimension, and takes part in no other rank's group creation;
        `barrier_free=False` is torch's `init_device_mesh`, kept for `bench/init.py` to compare against.

        Eager communicator set-up: gloo connects a group's members when the group is created, so there is
        nothing to start early on CPU. On an accelerator (untested: no accelerator here) the groups get
        the current device as `device_id`, which makes NCCL connect at creation rather than at the first
        collective; if the default group is already bound to a device, torch's own path is taken instead,
        as it splits the default communicator (ncclCommSplit needs every rank, members or not).
        """
        names = MESH_ORDERS[self.rank_order]
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        shape = tuple(sizes[name] for name in names)
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        bound_device = dist.distributed_c10d._get_default_group().bound_device_id
        if barrier_free and bound_device is None:
            self._mesh = self._mesh_of_own_groups(device_type, names, shape, timeout)
        else:
            self._mesh = self._torch_mesh(device_type, names, shape, timeout)
        if self.expert_ranks > 1:
            self._expert_mesh = self._mesh_of_own_groups(device_type, *self._expert_ranks(), timeout)
        if self.cp > 1:
            # This rank's dp_shard ranks as (batch, cp), cp innermost: a ring of adjacent ranks.
            ranks = self.sub_mesh("dp_shard").mesh.reshape(self.dp_shard // self.cp, self.cp)
            self._context_mesh = self._mesh_of_own_groups(device_type, ("batch", "cp"), ranks, timeout)
        return self._mesh

    def _expert_ranks(self) -> tuple[tuple[str, ...], torch.Tensor]:
        """The expert mesh's dimension names and ranks: this rank's dp_shard ranks as (edp, ep), ep
        innermost, so an expert-parallel group is adjacent ranks (inside a node, where the all-to-all is
        cheapest); with the experts over the tp ranks too, its ep dimension is (ep, tp), tp innermost;
        under HSDP, each replica's alike."""
        names = ("dp_replicate", "dp_shard", "tp") if self.experts_over_tp else ("dp_replicate", "dp_shard")
        shape = (self.dp_replicate, self.dp_shard // self.ep, self.expert_ranks)
        ranks = self.sub_mesh(*names).mesh.reshape(shape)
        if self.dp_replicate > 1:
            return ("dp_replicate", "edp", "ep"), ranks
        return ("edp", "ep"), ranks[0]

    @staticmethod
    def _torch_mesh(
        device_type: str, names: tuple[str, ...], shape: tuple[int, ...], timeout: timedelta | None
    ) -> DeviceMesh:
        """torch's `init_device_mesh`, every group bounded by `timeout`."""
        override: dict[int | str, str | Backend.Options | tuple[str, Backend.Options]] | None = None
        if timeout is not None and device_type == "cpu":
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, not in the stubs
            options._timeout = timeout
            override = {name: ("gloo", options) for name in names}
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)
        if timeout is not None and device_type != "cpu":  # untested: no accelerator here
            for name in names:
                dist.distributed_c10d._set_pg_timeout(timeout, mesh[name].get_group())
        return mesh

    @property
    def mesh(self) -> DeviceMesh | None:
        """The mesh `build_mesh` built; None in a one-process job, which has none."""
        if self._mesh is None and self.world_size > 1:
            raise RuntimeError(f"ParallelDims.mesh: build_mesh has not run for {self.describe()}")
        return self._mesh

    def sub_mesh(self, *names: str) -> DeviceMesh:
        """The mesh over some of its dimensions ('pp', 'dp_replicate', 'dp_shard', 'tp'), in mesh order;
        multi-process jobs only."""
        mesh = self.mesh
        if mesh is None:
            raise RuntimeError(f"ParallelDims.sub_mesh{names}: a one-process job has no mesh")
        return mesh[names[0] if len(names) == 1 else names]

    def expert_mesh(self) -> DeviceMesh:
        """The mesh (edp, ep) over this rank's dp_shard group (times its tp group with the experts over
        the tp ranks), (dp_replicate, edp, ep) under HSDP: the experts are split over 'ep' and their
        weights sharded by FSDP over 'edp' (and replicated over 'dp_replicate'); jobs with
        `expert_ranks` > 1 only."""
        if self._expert_mesh is None:
            raise RuntimeError(f"ParallelDims.expert_mesh: no expert mesh for {self.describe()}")
        return self._expert_mesh

    def context_group(self) -> dist.ProcessGroup:
        """This rank's ring of cp ranks, which split the sequences of one batch; jobs with cp > 1 only."""
        if self._context_mesh is None:
            raise RuntimeError(f"ParallelDims.context_group: no context mesh for {self.describe()}")
        return self._context_mesh["cp"].get_group()

    def context_rank(self) -> int:
        """This rank's index among its cp ranks: which chunks of each sequence it holds; 0 without cp."""
        return self.local_rank("dp_shard") % self.cp if self.mesh is not None else 0

    @staticmethod
    def _mesh_of_own_groups(
        device_type: str,
        names: tuple[str, ...],
        shape_or_ranks: tuple[int, ...] | torch.Tensor,
        timeout: timedelta | None,
    ) -> DeviceMesh:
        """This rank's group along each dimension (the ranks sharing all its other coordinates), created
        by their members only, dimension by dimension, and wrapped as the mesh `init_device_mesh` builds.
        The mesh is over the whole world in the given shape, or over the given tensor of ranks."""
        if isinstance(shape_or_ranks, torch.Tensor):
            ranks = shape_or_ranks
        else:
            ranks = torch.arange(dist.get_world_size()).reshape(shape_or_ranks)
        coordinate = [int(index) for index in (ranks == dist.get_rank()).nonzero()[0]]
        on_cpu = device_type == "cpu"
        device_id = None if on_cpu else torch.device(device_type, torch.accelerator.current_device_index())
        groups = []
        for dim, name in enumerate(names):
            line = tuple(slice(None) if other == dim else index for other, index in enumerate(coordinate))
            groups.append(
                dist.new_group(
                    ranks[line].tolist(),
                    timeout=timeout,
                    backend="gloo" if on_cpu else None,
                    use_local_synchronization=True,
                    group_desc=f"mesh_{name}",
                    device_id=device_id,
                )
            )
        return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)

    @staticmethod
    def checkpoint_group() -> dist.ProcessGroup:
        """A gloo group of all ranks for background checkpoint saves, whose collectives must not share a
        group with training's (they run concurrently, from another thread). Collective."""
        return dist.new_group(backend="gloo")

    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same state as this one (its DP replicas), or None without replicas:
        on recovery one of them reads the checkpoint and broadcasts it to the rest."""
        return self.sub_mesh("dp_replicate").get_group() if self.dp_replicate > 1 else None

    def local_rank(self, name: str) -> int:
        """This rank's index along one dimension; 0 in a one-process job."""
        return self.sub_mesh(name).get_local_rank() if self.mesh is not None else 0

    def coordinates(self) -> dict[str, int]:
        """This rank's place in the layout: pipeline stage, data-parallel rank, tensor-parallel rank, and
        with expert parallelism its expert-parallel rank (which experts it holds)."""
        place = {"pp": self.local_rank("pp"), "dp": self.dp_rank(), "tp": self.local_rank("tp")}
        if self.cp > 1:
            place["cp"] = self.context_rank()
        if self.expert_ranks > 1:
            place["ep"] = self.expert_mesh()["ep"].get_local_rank()
        return place

    def stage_of_ranks(self) -> list[int]:
        """The pipeline stage of every global rank, indexed by rank."""
        return self._index_of_ranks("pp")

    def ep_of_ranks(self) -> list[int]:
        """The expert-parallel rank of every global rank, indexed by rank: its dp_shard index modulo ep
        (the dp_shard ranks are laid out as (edp, ep), ep innermost), with the experts over the tp ranks
        too that times tp plus its tp index."""
        ep_index = [index % self.ep for index in self._index_of_ranks("dp_shard")]
        if not self.experts_over_tp:
            return ep_index
        return [ep * self.tp + tp for ep, tp in zip(ep_index, self._index_of_ranks("tp"))]

    def _index_of_ranks(self, name: str) -> list[int]:
        """Every global rank's index along the mesh dimension `name`, indexed by rank."""
        mesh = self.mesh
        if mesh is None:
            return [0]
        indices = [0] * mesh.mesh.numel()
        dim = list(mesh.mesh_dim_names or ()).index(name)
        for index, rank in zip(itertools.product(*map(range, mesh.mesh.shape)), mesh.mesh.flatten().tolist()):
            indices[rank] = index[dim]
        return indices

    def dp_rank(self) -> int:
        """Which of the step's dp batches this rank reads: its index among the dp_replicate x dp_shard
        ranks, the cp ranks of one ring counting once."""
        batches = self.dp_shard // self.cp
        return self.local_rank("dp_replicate") * batches + self.local_rank("dp_shard") // self.cp

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: 1-D (dp_shard), or 2-D (dp_replicate, dp_shard) for HSDP; replicas
        alone (dp_shard = 1) are HSDP with shards of one, which is plain data parallelism."""
        return self.sub_mesh(*(("dp_replicate",) if self.dp_replicate > 1 else ()), "dp_shard")
