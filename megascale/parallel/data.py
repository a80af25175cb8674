"""Data parallelism with FSDP2 (`fully_shard`): ZeRO-3, a ZeRO-2-like mode, and HSDP (replicate x shard).

Each transformer block is its own FSDP unit, so its parameters are all-gathered just before its forward
and its gradients reduce-scattered just after its backward (the per-chunk schedule of paper §3.2); the
root unit holds the embedding, final norm and output layer. `reshard_after_forward=False` keeps a block's
gathered parameters from forward to backward: ZeRO-2's traffic (one all-gather per step) at the cost of
holding them. A 2-D mesh (dp_replicate, dp_shard) gives HSDP: shard inside a group, replicate across.
FSDP2 provides all of it; this module only decides the units and the mode.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, blocks: str, zero_stage: int) -> None:
    """Shard `model` in place over `dp_mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP). Collective over
    the data-parallel group; apply after tensor parallelism, on identical models."""
    reshard_after_forward = zero_stage == 3
    units = list(model.get_submodule(blocks).children())
    for index, block in enumerate(units):
        # The last block's backward runs first: resharding it after forward would only gather it again.
        last = index == len(units) - 1
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward and not last)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
