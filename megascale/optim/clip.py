"""Gradient clipping by the global norm, the same for one process and for any sharding of the model."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from megascale.parallel.tensor import full_tensor


def clip_by_global_norm(
    params: Iterable[nn.Parameter], max_norm: float | None, stage_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The gradients' global L2 norm over every shard (TP and FSDP gradients are DTensors, whose norm is
    reduced over their mesh) and every pipeline stage (`stage_group`: each stage holds different
    parameters, so their squares are summed), clipping them to `max_norm` when it is given: a sharded run
    clips exactly as one process would. Returns the norm before clipping."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    norm = full_tensor(torch.nn.utils.get_total_norm(grads, foreach=True))
    if stage_group is not None:
        squares = norm**2
        dist.all_reduce(squares, group=stage_group)
        norm = squares.sqrt()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm
