"""Pipeline communication overlap (paper §3.2, Fig. 4): receives posted early, sends never waited on early.

A stage that issues a send and a receive together and waits for both (torch's 1F1B fuses the forward
send with the next backward receive, and the backward send with the next forward receive, then waits on
the pair) holds its send hostage to a receive that may come late, and its neighbour, waiting for that
send, idles in turn. MegaScale decouples them: every receive is posted as soon as its sender has
scheduled the matching compute, and waited on only right before the compute that consumes it; every
send is issued as soon as its data exists and waited on only at the end of the step.

torch's `_PipelineScheduleRuntime` (private in torch 2.13) executes exactly that from a schedule lowered to
explicit SEND/RECV actions, and `ScheduleInterleaved1F1B` already runs on it. This module runs 1F1B's
own compute order on it too (`parallel.overlap.pp = true`), and provides the lock-step baseline the
overlap is measured against (`false`): at each time step of the same order, the step's sends and
receives issued as one batch and waited on together (`PipelineScheduleMulti`'s executor, which torch's
interleaved schedule used before the runtime). Both take the schedule's compute order unchanged, so
they compute the same micro-batches in the same order and give the same losses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    _Action,
    _ComputationType,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

Order = dict[int, list[_Action | None]]  # per pipeline rank, its compute actions by time step


class _Overlapped(_PipelineScheduleRuntime):
    """A compute order run with early receives and late send waits."""

    def __init__(self, stages: list[PipelineStage], order: Order, microbatches: int, loss_fn: Callable):
        super().__init__(stages, microbatches, loss_fn=loss_fn)
        self.pipeline_order = order
        self._prepare_schedule_with_comms(order)


class _Lockstep(PipelineScheduleMulti):
    """A compute order run in lock-step: each time step's sends and receives batched and waited on.

    torch 2.13's `PipelineScheduleMulti` only scales a stage's gradients after its last backward and never
    calls the stage's gradient reduction, so a data-parallel stage would keep its unreduced gradients.
    Here each stage reduces, then scales, after the step's last compute, as the runtime's REDUCE_GRAD
    action does: both forms give the same bits."""

    def __init__(self, stages: list[PipelineStage], order: Order, microbatches: int, loss_fn: Callable):
        super().__init__(
            cast(list[_PipelineStageBase], stages),  # torch's stubs: a list of the base class (invariant)
            microbatches,
            loss_fn=loss_fn,
            scale_grads=False,  # scaled in the reduction
        )
        self.pipeline_order = order

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> None:
        super()._step_microbatches(*args, **kwargs)
        if self._has_backward:
            for stage in self._stages:
                stage.perform_reduce_grad(self._n_microbatches)


def one_f_one_b_order(pp: int, microbatches: int) -> Order:
    """Schedule1F1B's compute order on every rank, as it executes it: min(microbatches, pp - rank)
    forwards, then backward and forward alternating, then the remaining backwards. (torch's own
    `Schedule1F1B._get_pipeline_order` in 2.13 skips micro-batch 0 on the last rank.)"""
    forward, backward = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    order: Order = {}
    for rank in range(pp):
        warmup = min(microbatches, pp - rank)
        actions: list[_Action | None] = [_Action(rank, forward, mb) for mb in range(warmup)]
        for mb in range(microbatches):
            actions.append(_Action(rank, backward, mb))
            if warmup + mb < microbatches:
                actions.append(_Action(rank, forward, warmup + mb))
        order[rank] = actions
    return order


def overlap_schedule(
    stages: list[PipelineStage],
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    overlap: bool,
) -> _PipelineSchedule:
    """The 1F1B or interleaved-1F1B schedule of this rank's `stages`, with its communication decoupled
    (`overlap`) or in lock-step."""
    if schedule == "interleaved_1f1b":
        interleaved = ScheduleInterleaved1F1B(
            cast(list[_PipelineStageBase], stages), n_microbatches=microbatches, loss_fn=loss_fn
        )
        if overlap:
            return interleaved  # already on the runtime, receives posted as early as possible
        return _Lockstep(stages, interleaved.pipeline_order, microbatches, loss_fn)
    if schedule != "1f1b" or len(stages) != 1:
        raise ValueError(f"no overlapped form of pipeline schedule {schedule!r} with {len(stages)} stages")
    plain = Schedule1F1B(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    if not overlap:
        return plain  # torch's own 1F1B: each send waited on together with the next receive
    order = one_f_one_b_order(stages[0].num_stages, microbatches)
    return _Overlapped(stages, order, microbatches, loss_fn)
