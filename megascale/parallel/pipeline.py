"""Pipeline parallelism: cut the model into stages by layers and run them with torch.distributed.pipelining.

A stage is a copy of the model that keeps only its own layers; the first stage keeps the embedding, the
last the final norm and output layer (and computes the loss). Keeping the model's own class and names means
checkpoints stay keyed by the same parameter names in every layout. With virtual stages (interleaved 1F1B)
rank r of a pp-rank pipeline holds stages r, r + pp, r + 2 pp, ... (the "looped" placement of Megatron's
interleaved schedule), which shrinks the bubble by the number of chunks per rank (paper §2). The zero-bubble
schedules (ZB-V, DualPipeV) hold two stages per rank in a V instead: rank r holds stages r and 2 pp - 1 - r,
so rank 0 holds the first stage and the last, and a micro-batch turns around on the last rank without a
transfer; they split each backward into the input gradient (on the critical path) and the weight gradient
(deferred into what would be the bubble).

torch.distributed.pipelining provides the stages, the p2p exchange and the schedules; this module adds the
layer split (uniform, or balanced by parameter count: `megascale/layout.py`, which the planner prices
stages with too) and the mapping from our config words to schedules.
Every rank builds the whole model first and then drops what it does not own, so initialisation is identical
to a single process's; a model larger than host memory would need meta-device initialisation (not yet).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import (
    FORWARD,
    OVERLAP_F_B,
    RECV_F,
    RESHARD,
    SEND_F,
    UNSHARD,
    PipelineScheduleMulti,
    _Action,
    _PipelineSchedule,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from megascale.layout import split_layers
from megascale.parallel.pipeline_overlap import overlap_schedule


def stage_layer_ranges(model: nn.Module, num_stages: int, split: str, *, blocks: str) -> list[range]:
    """The layers of each stage: equal counts ('uniform') or balanced by parameter count ('params')."""
    layers = list(model.get_submodule(blocks).children())
    if split == "uniform":
        return split_layers([1] * len(layers), num_stages)
    if split != "params":
        raise ValueError(f"pipeline split must be 'uniform' or 'params', got {split!r}")
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    outside = [(name, p) for name, p in model.named_parameters() if id(p) not in in_layers]
    first_extra = sum(p.numel() for name, p in outside if "embeddings" in name)
    last_extra = sum(p.numel() for name, p in outside if "embeddings" not in name)
    return split_layers(layer_params, num_stages, first_extra, last_extra)


class _EvaluatedForwardOnly:
    """A V schedule whose evaluation runs only its forwards. torch 2.13's runtime keeps a V schedule's
    input-gradient actions in `eval` and fails at the first one, handing a gradient from one of the
    rank's stages to the other. Its forwards and their transfers alone, in the order the step runs them,
    are a schedule that cannot wait longer than the step's."""

    pipeline_order_with_comms: dict[int, list[_Action]]

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        forwards = {
            rank: [
                part
                for action in actions
                for part in (
                    action.sub_actions or () if action.computation_type == OVERLAP_F_B else (action,)
                )
                if part.computation_type in _FORWARD_ONLY
            ]
            for rank, actions in self.pipeline_order_with_comms.items()
        }
        self._training_order, self._evaluation_order = self.pipeline_order_with_comms, forwards

    def eval(self, *args: Any, **kwargs: Any) -> Any:
        self.pipeline_order_with_comms = self._evaluation_order
        try:
            return super().eval(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.pipeline_order_with_comms = self._training_order


_FORWARD_ONLY = (FORWARD, SEND_F, RECV_F, UNSHARD, RESHARD)


class _ScaledOnce(PipelineScheduleMulti):
    """Gradients divided by the micro-batches once a parameter, after the step's last backward. torch's
    V schedules divide each stage's own after that stage's last backward, so a parameter the rank's two
    stages share (tied embeddings) twice, the first time before the other stage has added its part."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **{**kwargs, "scale_grads": False})

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> None:
        super()._step_microbatches(*args, **kwargs)
        if self._has_backward:  # a training step (eval clears it)
            shared = {id(param): param for stage in self._stages for param in stage.submod.parameters()}
            for param in shared.values():
                if param.grad is not None:
                    param.grad.div_(self._n_microbatches)


class _ZBV(_EvaluatedForwardOnly, _ScaledOnce, ScheduleZBVZeroBubble):
    pass


class _DualPipeV(_EvaluatedForwardOnly, _ScaledOnce, ScheduleDualPipeV):
    pass


V_SCHEDULES = {"zbv": _ZBV, "dualpipev": _DualPipeV}  # config.parallel.V_SCHEDULES


def build_stage_module(
    model: nn.Module,
    layer_range: range,
    *,
    first: bool,
    last: bool,
    blocks: str,
    first_stage_modules: tuple[str, ...],
    last_stage_modules: tuple[str, ...],
) -> nn.Module:
    """A copy of `model` keeping layers in `layer_range`; modules named in first/last_stage_modules are
    set to None outside the first/last stage (the model's forward skips a None module)."""
    stage = copy.deepcopy(model)
    container = stage.get_submodule(blocks)
    for name in [
        name for index, (name, _) in enumerate(container.named_children()) if index not in layer_range
    ]:
        delattr(container, name)
    for names, keep in ((first_stage_modules, first), (last_stage_modules, last)):
        for name in names:
            if not keep and getattr(stage, name, None) is not None:
                setattr(stage, name, None)
    return stage


def build_schedule(
    stage_modules: list[nn.Module],
    stage_ids: list[int],
    num_stages: int,
    *,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    group: ProcessGroup,
    overlap: bool = False,
) -> tuple[_PipelineSchedule, list[PipelineStage]]:
    """The pipeline schedule running this rank's stages, and the stages. Gradients are scaled by
    1/microbatches, so the step's gradient is that of the mean loss over micro-batches, as with gradient
    accumulation. 1F1B schedules run with their communication decoupled when `overlap` (and in
    lock-step when not: pipeline_overlap.py); GPipe has no steady phase to overlap and runs as it is."""
    stages = [
        PipelineStage(module, stage_id, num_stages, device, group=group)
        for module, stage_id in zip(stage_modules, stage_ids)
    ]
    if schedule in V_SCHEDULES:  # on torch's runtime: receives posted early, sends waited on late
        v_schedule = V_SCHEDULES[schedule](
            cast(list[_PipelineStageBase], stages), n_microbatches=microbatches, loss_fn=loss_fn
        )
        return v_schedule, stages
    if schedule != "gpipe":
        return overlap_schedule(stages, schedule, microbatches, loss_fn, overlap), stages
    if len(stages) != 1:
        raise ValueError(f"pipeline schedule {schedule!r} runs one stage per rank, got {len(stages)}")
    return ScheduleGPipe(stages[0], n_microbatches=microbatches, loss_fn=loss_fn), stages
