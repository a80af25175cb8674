"""Data parallelism with FSDP2 (`fully_shard`): ZeRO-3, a ZeRO-2-like mode, HSDP, and MegaScale's overlap.

Each transformer block is its own FSDP unit, so its parameters are all-gathered just before its forward
and its gradients reduce-scattered just after its backward (the per-chunk schedule of paper §3.2); the
root unit holds the embedding, final norm and output layer. `reshard_after_forward=False` keeps a block's
gathered parameters from forward to backward: ZeRO-2's traffic (one all-gather per step) at the cost of
holding them. A 2-D mesh (dp_replicate, dp_shard) gives HSDP: shard inside a group, replicate across.

Overlap (`parallel.overlap.dp`, paper §3.2): FSDP2 overlaps on an accelerator by issuing all-gathers on a
second stream, but without streams (CPU, gloo) each all-gather blocks where it is issued. So every unit's
all-gather is made asynchronous and issued one unit ahead, in the order the computation consumes them
(forward: root, block 0, 1, ...; backward: the reverse), and waited for only in the pre-forward or
pre-backward of the unit that needs it; the step's first all-gather is issued before its batch is
fetched (`issue_first_all_gathers`), so it overlaps data loading. FSDP2 provides the prefetch hooks; this
module only decides the units, the mode and the order. The gradient reduce-scatter is still blocking on
CPU (FSDP2 issues it synchronously without streams); on an accelerator FSDP2 runs it on its own stream
(untested here: no GPU).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard


def apply_fsdp(
    model: nn.Module, dp_mesh: DeviceMesh, *, blocks: str, zero_stage: int, overlap: bool = False
) -> None:
    """Shard `model` in place over `dp_mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP). Collective over
    the data-parallel group; apply after tensor parallelism, on identical models."""
    reshard_after_forward = zero_stage == 3
    units = list(model.get_submodule(blocks).children())
    for index, block in enumerate(units):
        # The last block's backward runs first: resharding it after forward would only gather it again.
        last = index == len(units) - 1
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward and not last)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    if overlap:
        prefetch_one_unit_ahead(model, units)


def prefetch_one_unit_ahead(root: FSDPModule, units: list[FSDPModule]) -> None:
    """Asynchronous all-gathers, each issued as the unit before it (in consumption order) begins."""
    root._set_unshard_async_op(True)  # private in torch 2.13: the only switch to async pre-forward gathers
    order = [root, *units]
    for before, after in zip(order, order[1:]):
        before.set_modules_to_forward_prefetch([after])
    for later, earlier in zip(units[::-1], units[::-1][1:]):
        later.set_modules_to_backward_prefetch([earlier])


def issue_first_all_gathers(parts: list[nn.Module]) -> None:
    """Start each part's root all-gather now (before the batch is fetched); FSDP waits for it in the part's
    pre-forward. Parts that are not FSDP units (no data parallelism) are left alone."""
    for part in parts:
        if isinstance(part, FSDPModule):
            part.unshard(async_op=True)
