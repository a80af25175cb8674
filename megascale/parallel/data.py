"""Data parallelism with FSDP2 (`fully_shard`): ZeRO-3, a ZeRO-2-like mode, HSDP and ZeRO-1.

Each transformer block is its own FSDP unit, so its parameters are all-gathered just before its forward
and its gradients reduce-scattered just after its backward (the per-chunk schedule of paper §3.2); the
root unit holds the embedding, final norm and output layer. `reshard_after_forward=False` keeps a block's
gathered parameters from forward to backward: ZeRO-2's traffic (one all-gather per step) at the cost of
holding them. A 2-D mesh (dp_replicate, dp_shard) gives HSDP: shard inside a group, replicate across.

ZeRO stage 1 (`parallel.zero_stage = 1`) is Megatron-LM's distributed optimizer, which MegaScale builds
on: parameters stay gathered and gradients whole over the step's micro-batches, reduce-scattered once at
the last (`sync_gradients`), so data-parallel traffic is one all-gather and one reduce-scatter a step
whatever the gradient accumulation; FSDP2 by default reduce-scatters every micro-batch.

Under bfloat16 compute each block is gathered as bfloat16 copies of its parameters (FSDP2's mixed precision,
as torchtitan and Megatron-LM's bf16 parameters do): half the bytes of the float32 masters, cast once a
gather instead of by autocast in every forward, with gradients reduced and accumulated in float32. The
root unit (embedding, final norm, output layer) is gathered in float32: the residual stream starts from the
embedding's rows, in float32 as on one process, and the embedding's gradient sums every token's in its
parameter's dtype. A bfloat16 matmul weight is what autocast would cast it to; the norms widen their gains
back to float32 (models/norm.py), so a block computes as on one process up to its norms' gains rounded.

MegaScale's overlap of data-parallel communication with compute is data_overlap.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from megascale.parallel.data_overlap import AsyncReduceScatter, GradientReductions, prefetch_one_unit_ahead


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    blocks: str,
    zero_stage: int,
    overlap: bool = False,
    reductions: GradientReductions | None = None,
    ignored: set[nn.Parameter] | None = None,
    compute_dtype: torch.dtype | None = None,
) -> None:
    """Shard `model` in place over `dp_mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP). Collective over
    the data-parallel group; apply after tensor parallelism, on identical models. With `reductions` (a
    1-D mesh only) the gradient reduce-scatters are asynchronous, waited for by `reductions.wait()`.
    `ignored` parameters are left as they are (held whole by the ranks that own them). The blocks are
    gathered in `compute_dtype` (None: their parameters' own)."""
    reshard_after_forward = zero_stage == 3
    units = list(model.get_submodule(blocks).children())
    for index, block in enumerate(units):
        # The last block's backward runs first: resharding it after forward would only gather it again.
        last = index == len(units) - 1
        fully_shard(
            block,
            mesh=dp_mesh,
            reshard_after_forward=reshard_after_forward and not last,
            ignored_params=ignored,
            mp_policy=block_gathers(compute_dtype),
        )
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    if overlap:
        prefetch_one_unit_ahead(cast(FSDPModule, model), cast(list[FSDPModule], units))
    if reductions is not None:
        if dp_mesh.ndim != 1:
            raise ValueError("asynchronous gradient reduce-scatters: HSDP's all-reduce reads them at once")
        skipped = {id(param) for param in ignored or ()}
        blocks_params = {id(param) for unit in units for param in unit.parameters()} | skipped
        root_params = [param for param in model.parameters() if id(param) not in blocks_params]
        unit_params = [[param for param in unit.parameters() if id(param) not in skipped] for unit in units]
        for unit, params in [*zip(units, unit_params), (model, root_params)]:
            cast(FSDPModule, unit).set_custom_reduce_scatter(AsyncReduceScatter(params, reductions))


def block_gathers(compute_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """How a block's FSDP unit gathers its parameters: as copies in `compute_dtype` where that is narrower
    than float32, their gradients reduced in float32; the forward's inputs left as they come (the residual
    stream stays float32)."""
    if compute_dtype is None or compute_dtype.itemsize >= 4:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


def sync_gradients(parts: Sequence[nn.Module], enabled: bool) -> None:
    """Whether the next backward reduce-scatters gradients and frees the gathered parameters (ZeRO-1:
    only the step's last micro-batch does). Parts that are not FSDP units are left alone."""
    for part in parts:
        if isinstance(part, FSDPModule):
            part.set_requires_gradient_sync(enabled)
            part.set_reshard_after_backward(enabled)
