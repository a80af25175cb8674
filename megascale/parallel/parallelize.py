"""Turn one plain model into this rank's share of a 3D-parallel one, in the order that composes.

Pipeline split first (which layers this rank holds), then per model part: tensor + sequence parallelism,
activation checkpointing, per-block compilation when asked, and FSDP last, over the data-parallel
sub-mesh (torchtitan's order: FSDP shards the DTensors that TP made, and wraps the checkpointed blocks).
The model code knows none of this.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from megascale.config import ParallelConfig
from megascale.layout import stage_ids_of
from megascale.models import sharding
from megascale.models.moe import MoE
from megascale.parallel.activation import apply_activation_checkpointing
from megascale.parallel.context import apply_context_parallel
from megascale.parallel.data import apply_fsdp, block_gathers
from megascale.parallel.data_overlap import GradientReductions
from megascale.parallel.dims import ParallelDims
from megascale.parallel.expert import apply_expert_parallel
from megascale.parallel.float8 import gather_float8_as_bytes
from megascale.parallel.offload import ActivationOffload, apply_activation_offload
from megascale.parallel.pipeline import build_schedule, build_stage_module, stage_layer_ranges
from megascale.parallel.step import ParallelModel, PipelinedModel
from megascale.parallel.tensor import apply_tensor_parallel, tied_parameters


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    par: ParallelConfig,
    *,
    device: torch.device,
    microbatches: int,
    autocast_dtype: torch.dtype | None = None,
    compile_blocks: bool = False,
    float8_all_gather: bool = False,
) -> ParallelModel:
    """Collective over the whole mesh (`dims.mesh`): every rank calls it with an identical `model` (same
    weights; its float8 layers already converted, parallel/float8.py). The result steps the model in this
    layout (parallel/step.py)."""
    # Without streams (CPU) FSDP2's reduce-scatters block; made asynchronous here (parallel/data.py), but
    # not under a pipeline schedule: it scales the gradients as soon as FSDP2 has reduced them; nor with
    # expert parallelism, whose experts are an FSDP unit inside each block's.
    async_reductions = (
        par.overlap.dp
        and device.type == "cpu"
        and dims.fsdp_ranks > 1
        and dims.dp_replicate == 1
        and dims.pp == 1
        and dims.expert_ranks == 1
    )
    reductions = GradientReductions() if async_reductions else None
    routed = any(isinstance(module, MoE) for module in model.modules())  # before a stage drops layers
    offload = ActivationOffload(device) if par.activation_offload else None  # one for all stages
    if dims.pp == 1:
        _shard(model, dims, par, compile_blocks, reductions, float8_all_gather, offload, autocast_dtype)
        return ParallelModel(
            [model],
            device=device,
            autocast_dtype=autocast_dtype,
            tensor_parallel=dims.tp > 1,
            gather_early=par.overlap.dp,
            zero1=par.zero_stage == 1,
            reductions=reductions,
            routing_groups=_routing_groups(dims),
            routed=routed,
            context=(dims.cp, dims.context_rank()),
        )
    num_stages = dims.pp * par.pp_virtual_stages
    stage_ids = stage_ids_of(dims.local_rank("pp"), dims.pp, par.pp_virtual_stages, par.pp_schedule)
    parts, shared = _stages(model, stage_ids, num_stages, par)
    for part in parts:
        _shard(
            part, dims, par, compile_blocks, reductions, float8_all_gather, offload, autocast_dtype, shared
        )
    group = dims.sub_mesh("pp").get_group()
    schedule = partial(
        build_schedule,
        parts,
        stage_ids,
        num_stages,
        schedule=par.pp_schedule,
        microbatches=microbatches,
        device=device,
        group=group,
        overlap=par.overlap.pp,
    )
    return PipelinedModel(
        parts,
        schedule=schedule,
        microbatches=microbatches,
        first_stage=0 in stage_ids,
        last_stage=num_stages - 1 in stage_ids,
        device=device,
        autocast_dtype=autocast_dtype,
        tensor_parallel=dims.tp > 1,
        gather_early=par.overlap.dp,
        zero1=False,  # the schedule syncs FSDP's gradients at each stage's last backward
        pipeline_group=group,
        whole=(list(shared), _data_groups(dims) if dims.fsdp_ranks > 1 else []),
        routing_groups=_routing_groups(dims),
        routed=routed,
        context=(dims.cp, dims.context_rank()),
    )


def _routing_groups(dims: ParallelDims) -> list[ProcessGroup]:
    """The groups of this rank whose ranks route other tokens through the same MoE layers: one per data
    dimension with more than one rank, and the tp group where each tp rank routes its own tokens."""
    sizes = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard}
    if dims.experts_over_tp:
        sizes["tp"] = dims.tp
    return [dims.sub_mesh(name).get_group() for name, size in sizes.items() if size > 1]


def _data_groups(dims: ParallelDims) -> list[ProcessGroup]:
    """The groups over which FSDP averages a gradient: its mesh's dimensions (two under HSDP)."""
    mesh = dims.fsdp_mesh()
    return [mesh.get_group(dim) for dim in range(mesh.ndim)]


def _stages(
    model: nn.Module, stage_ids: list[int], num_stages: int, par: ParallelConfig
) -> tuple[list[nn.Module], set[nn.Parameter]]:
    """This rank's pipeline stages, copies of `model` keeping only their layers, and the parameters two
    of them share."""
    ranges = stage_layer_ranges(model, num_stages, par.pp_split, blocks=sharding.BLOCKS)
    parts = [
        build_stage_module(
            model,
            ranges[stage_id],
            first=stage_id == 0,
            last=stage_id == num_stages - 1,
            blocks=sharding.BLOCKS,
            first_stage_modules=sharding.FIRST_STAGE,
            last_stage_modules=sharding.LAST_STAGE,
        )
        for stage_id in stage_ids
    ]
    return parts, _tie_across(parts, tied_parameters(model))


def _tie_across(parts: list[nn.Module], tied: list[list[str]]) -> set[nn.Parameter]:
    """A parameter the model shares between modules in two stages of this rank (the embedding and the
    output layer of a V schedule's first and last stage) is one parameter again: each stage is its own
    copy of the model. Its gradient then accumulates from both stages, as in one process. Stages on
    other ranks cannot share one (ParallelDims.validate refuses it). Returns the shared parameters:
    FSDP, which shards each stage on its own, leaves them whole."""
    shared = set()
    for names in tied:
        held = [(part, name) for part in parts for name in names if _holds(part, name)]
        for part, name in held[1:]:
            owner, _, attribute = name.rpartition(".")
            kept = held[0][0].get_parameter(held[0][1])
            part.get_submodule(owner).register_parameter(attribute, kept)
            shared.add(kept)
    return shared


def _holds(part: nn.Module, name: str) -> bool:
    owner, _, attribute = name.rpartition(".")
    try:
        return isinstance(getattr(part.get_submodule(owner), attribute, None), nn.Parameter)
    except AttributeError:  # a module this stage dropped (None) or never had
        return False


def _shard(
    part: nn.Module,
    dims: ParallelDims,
    par: ParallelConfig,
    compile_blocks: bool,
    reductions: GradientReductions | None,
    float8_all_gather: bool = False,
    offload: ActivationOffload | None = None,
    compute_dtype: torch.dtype | None = None,
    whole: AbstractSet[nn.Parameter] = frozenset(),
) -> None:
    """One model part, in place: tensor + sequence parallelism, context parallelism's ring attention,
    activation checkpointing, per-block compilation, activation offload, expert parallelism, FSDP (its
    blocks gathered in the compute precision, its float8 weights as bytes where the backend has no float8
    type). `whole` parameters are left whole: FSDP neither shards nor reduces them."""
    if dims.tp > 1:
        apply_tensor_parallel(
            part,
            dims.sub_mesh("tp"),
            blocks=sharding.BLOCKS,
            block_plan=sharding.BLOCK_PLAN,
            routed_block_plan=(
                sharding.ROUTED_OWN_TOKENS_BLOCK_PLAN if dims.experts_over_tp else sharding.ROUTED_BLOCK_PLAN
            ),
            top_level_plan=sharding.TOP_LEVEL_PLAN,
            sequence_parallel=par.sequence_parallel,
            overlap_chunks=par.overlap.tp_chunks if par.overlap.tp else None,
        )
    if dims.cp > 1:
        apply_context_parallel(part, dims.context_group(), overlap=par.overlap.cp)
    apply_activation_checkpointing(part, blocks=sharding.BLOCKS, mode=par.activation_checkpoint)
    if compile_blocks:
        for block in part.get_submodule(sharding.BLOCKS).children():
            block.compile()
    if offload is not None:
        apply_activation_offload(part, blocks=sharding.BLOCKS, offload=offload)
    alone: set[nn.Parameter] = set(whole)  # held whole (by FSDP too): shared with another stage
    if dims.expert_ranks > 1:
        alone |= apply_expert_parallel(
            part,
            dims.expert_mesh(),
            data_ranks=dims.ep,
            reshard=par.zero_stage == 3,
            chunks=2 if par.overlap.ep else 1,
            wire=getattr(torch, par.ep_comm_dtype),
            gathers=block_gathers(compute_dtype),
        )
    if dims.fsdp_ranks > 1:
        apply_fsdp(
            part,
            dims.fsdp_mesh(),
            blocks=sharding.BLOCKS,
            zero_stage=par.zero_stage,
            overlap=par.overlap.dp,
            reductions=reductions,
            ignored=alone,
            compute_dtype=compute_dtype,
        )
        if float8_all_gather and dist.get_backend(dims.fsdp_mesh().get_group(0)) == "gloo":
            gather_float8_as_bytes(list(part.modules()))
