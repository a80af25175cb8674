"""Turn one plain model into this rank's share of a 3D-parallel one, in the order that composes.

Pipeline split first (which layers this rank holds), then per model part: tensor + sequence parallelism,
activation checkpointing, per-block compilation when asked, and FSDP last, over the data-parallel
sub-mesh (torchtitan's order: FSDP shards the DTensors that TP made, and wraps the checkpointed blocks).
The model code knows none of this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule

from megascale.config import ParallelConfig
from megascale.models import sharding
from megascale.parallel.activation import apply_activation_checkpointing
from megascale.parallel.data import apply_fsdp
from megascale.parallel.data_overlap import GradientReductions
from megascale.parallel.dims import ParallelDims
from megascale.parallel.pipeline import build_schedule, build_stage_module, stage_ids_of, stage_layer_ranges
from megascale.parallel.tensor import apply_tensor_parallel


@dataclass
class ParallelModel:
    """This rank's model parts (one per pipeline stage it holds, else the whole model) and their schedule."""

    parts: list[nn.Module]
    schedule: _PipelineSchedule | None  # None without pipeline parallelism
    stages: list[PipelineStage]  # the schedule's stages, one per part (none without pipeline parallelism)
    first_stage: bool  # holds the embedding: feeds the inputs
    last_stage: bool  # holds the output layer: computes the loss
    gradient_reductions: GradientReductions | None = None  # asynchronous reduce-scatters (DP overlap, CPU)

    def wait_for_gradients(self) -> None:
        """Before anything reads the gradients: the reduce-scatters still in flight have finished."""
        if self.gradient_reductions is not None:
            self.gradient_reductions.wait()


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    par: ParallelConfig,
    *,
    device: torch.device,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    compile_blocks: bool = False,
) -> ParallelModel:
    """Collective over the whole mesh: every rank calls it with an identical `model` (same weights)."""
    parts, schedule, stages, first, last = [model], None, [], True, True
    # Without streams (CPU) FSDP2's reduce-scatters block; made asynchronous here (parallel/data.py), but
    # not under a pipeline schedule: it scales the gradients as soon as FSDP2 has reduced them.
    async_reductions = (
        par.overlap.dp and device.type == "cpu" and dims.dp > 1 and dims.dp_replicate == 1 and dims.pp == 1
    )
    reductions = GradientReductions() if async_reductions else None
    if dims.pp > 1:
        num_stages = dims.pp * par.pp_virtual_stages
        ranges = stage_layer_ranges(model, num_stages, par.pp_split, blocks=sharding.BLOCKS)
        stage_ids = stage_ids_of(mesh["pp"].get_local_rank(), dims.pp, par.pp_virtual_stages)
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
        first, last = 0 in stage_ids, num_stages - 1 in stage_ids
    for part in parts:
        if dims.tp > 1:
            apply_tensor_parallel(
                part,
                mesh["tp"],
                blocks=sharding.BLOCKS,
                block_plan=sharding.BLOCK_PLAN,
                top_level_plan=sharding.TOP_LEVEL_PLAN,
                sequence_parallel=par.sequence_parallel,
                overlap_chunks=par.overlap.tp_chunks if par.overlap.tp else None,
            )
        apply_activation_checkpointing(part, blocks=sharding.BLOCKS, mode=par.activation_checkpoint)
        if compile_blocks:
            for block in part.get_submodule(sharding.BLOCKS).children():
                block.compile()
        if dims.dp > 1:
            apply_fsdp(
                part,
                dims.fsdp_mesh(mesh),
                blocks=sharding.BLOCKS,
                zero_stage=par.zero_stage,
                overlap=par.overlap.dp,
                reductions=reductions,
            )
    if dims.pp > 1:
        schedule, stages = build_schedule(
            parts,
            stage_ids,
            num_stages,
            schedule=par.pp_schedule,
            microbatches=microbatches,
            loss_fn=loss_fn,
            device=device,
            group=mesh["pp"].get_group(),
            overlap=par.overlap.pp,
        )
    return ParallelModel(
        parts=parts,
        schedule=schedule,
        stages=stages,
        first_stage=first,
        last_stage=last,
        gradient_reductions=reductions,
    )
