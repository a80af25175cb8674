"""Gradient clipping by the global norm, the same for one process and for any sharding of the model."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from megascale.parallel.tensor import full_tensor


class _NormOverMeshHint(logging.Filter):
    """Drops DTensor's hint, logged by every rank, that reducing a norm over a 2-D or 3-D mesh (FSDP x TP,
    HSDP x TP) takes one all-reduce per mesh dimension: for the one scalar a step reduces that costs
    nothing, and every rank still gets the same value (the reductions run in the same order on all)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not ("_NormPartial" in str(record.args) and "sequential" in str(record.msg))


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_NormOverMeshHint())


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by the device mesh they are DTensors on, plain tensors in a group of their own:
    foreach kernels take tensors of one kind, and without sequence parallelism a tensor-parallel model
    holds both (replicated norms stay plain), on one or two meshes (FSDP's alone, FSDP's x TP's)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(getattr(tensor, "device_mesh", None), []).append(tensor)
    return list(groups.values())


def clip_by_global_norm(
    params: Iterable[nn.Parameter], max_norm: float | None, stage_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The gradients' global L2 norm over every shard (TP and FSDP gradients are DTensors, whose norm is
    reduced over their mesh) and every pipeline stage (`stage_group`: each stage holds different
    parameters, so their squares are summed), clipping them to `max_norm` when it is given: a sharded run
    clips exactly as one process would. Returns the norm before clipping."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    groups = _by_mesh(grads)
    if len(groups) <= 1:
        norm = full_tensor(torch.nn.utils.get_total_norm(grads, foreach=True))
    else:
        mesh_squares = [
            full_tensor(torch.nn.utils.get_total_norm(group, foreach=True)) ** 2 for group in groups
        ]
        norm = torch.stack(mesh_squares).sum().sqrt()
    if stage_group is not None:
        squares = norm**2
        dist.all_reduce(squares, group=stage_group)
        norm = squares.sqrt()
    if max_norm is not None:
        for group in _by_mesh([p for p in params if p.grad is not None]):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm
