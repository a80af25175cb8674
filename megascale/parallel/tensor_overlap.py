"""Tensor-parallel overlap (paper §3.2, Fig. 3): the sequence all-gather fused into the column-parallel
GEMMs and the reduce-scatter into the row-parallel GEMM, pipelined over sequence chunks, in the MLP and
around attention.

With sequence parallelism an MLP all-gathers its input's sequence shards, runs w1 / w3 (column-parallel),
the activation and w2 (row-parallel), and reduce-scatters the partial sums back to sequence shards; done
one after another, every byte of both collectives is exposed. Each position of an MLP is computed alone,
so the work splits into chunks of the sequence: chunk i's all-gather is in flight while chunk i-1 is
computed, and chunk i-1's reduce-scatter while chunk i is, so only the first all-gather and the last
reduce-scatter are exposed. The backward does the same with the roles swapped (the gradient's all-gather,
then the input gradient's reduce-scatter). Rows of a gathered chunk stay in rank-major order from the
all-gather to the reduce-scatter, which hands each rank back exactly its own positions.

Attention needs the whole sequence between its projections, so there the chunks meet twice: the q/k/v
projections of chunk i-1 are computed while chunk i's all-gather is in flight (the gathered chunks are then
put back in sequence order for the attention), and the output projection of chunk i while chunk i-1's
reduce-scatter is; the backward swaps the roles as in the MLP.

DTensor's `ColwiseParallel` / `RowwiseParallel` still shard the weights (and FSDP shards them further);
this module only replaces the MLP's and the attention's forward with autograd functions over the local
shards.
torch's own fused "async TP" needs CUDA symmetric memory; here the collectives are gloo's (or NCCL's)
asynchronous ones, and on an accelerator they would run on the communication stream (untested: no GPU).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle


def all_gather_rows(chunk: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """Start gathering every rank's `chunk` [b, ...] into [ranks * b, ...] (rank-major)."""
    chunk = chunk.contiguous()
    gathered = chunk.new_empty((dist.get_world_size(group) * chunk.shape[0], *chunk.shape[1:]))
    return gathered, dist.all_gather_single(gathered, chunk, group=group, async_op=True)


def reduce_scatter_rows(rows: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """Start summing `rows` [ranks * b, ...] over the ranks, each keeping its own block [b, ...]."""
    rows = rows.contiguous()
    mine = rows.new_empty((rows.shape[0] // dist.get_world_size(group), *rows.shape[1:]))
    return mine, dist.reduce_scatter_single(mine, rows, group=group, async_op=True)


def _finished(pending: list[tuple[torch.Tensor, dist.Work]]) -> list[torch.Tensor]:
    for _, work in pending:
        work.wait()
    return [tensor for tensor, _ in pending]


class _ChunkedMLP(torch.autograd.Function):
    """local [b, s/tp, d] -> [b, s/tp, d]: w2(activate(w1 x, w3 x)) over the whole sequence, chunked."""

    @staticmethod
    def forward(ctx: Any, local, group, chunks, activate, w1, w3, w2):
        ctx.group, ctx.activate = group, activate
        ctx.autocast = _autocast_state(local.device.type)
        gathers = [all_gather_rows(chunk, group) for chunk in local.chunk(chunks, dim=1)]  # all in flight
        reduces, saved = [], []
        for full, work in gathers:
            work.wait()
            up, gate = full @ w1.T, (full @ w3.T if w3 is not None else None)
            reduces.append(reduce_scatter_rows(activate(up, gate) @ w2.T, group))
            saved += [full, up, gate]
        ctx.save_for_backward(w1, w3, w2, *saved)
        return torch.cat(_finished(reduces), dim=1)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        w1, w3, w2, *saved = ctx.saved_tensors
        chunks = len(saved) // 3
        grads: dict[str, Any] = {
            "w1": torch.zeros_like(w1),
            "w3": torch.zeros_like(w3) if w3 is not None else None,
        }
        grads["w2"] = torch.zeros_like(w2)
        gathers = [all_gather_rows(chunk, ctx.group) for chunk in grad_out.chunk(chunks, dim=1)]
        reduces = []
        with torch.autocast(**ctx.autocast):
            for index, (grad_rows, work) in enumerate(gathers):
                full, up, gate = saved[3 * index : 3 * index + 3]
                work.wait()
                with torch.enable_grad():  # the activation's own backward, recomputed from its saved inputs
                    up = up.detach().requires_grad_()
                    gate = gate.detach().requires_grad_() if gate is not None else None
                    hidden = ctx.activate(up, gate)
                inputs = [up] if gate is None else [up, gate]
                grads["w2"] += _outer(grad_rows, hidden.detach())
                d_inputs = torch.autograd.grad(hidden, inputs, grad_rows @ w2)
                grads["w1"] += _outer(d_inputs[0], full)
                d_full = d_inputs[0] @ w1
                if w3 is not None:
                    grads["w3"] += _outer(d_inputs[1], full)
                    d_full = d_full + d_inputs[1] @ w3
                reduces.append(reduce_scatter_rows(d_full, ctx.group))
            d_local = torch.cat(_finished(reduces), dim=1)
        return d_local, None, None, None, grads["w1"], grads["w3"], grads["w2"]


def _in_sequence(chunk_rows: list[torch.Tensor], ranks: int) -> torch.Tensor:
    """Gathered chunks [ranks * b, c_i, n] (rank-major; rank r's own positions of chunk i) -> [b, s, n]: the
    sequence in order (rank 0's shard, chunk by chunk, then rank 1's, ...)."""
    blocks = [rows.chunk(ranks, dim=0) for rows in chunk_rows]
    return torch.cat([blocks[chunk][rank] for rank in range(ranks) for chunk in range(len(blocks))], dim=1)


def _in_chunk_rows(sequence: torch.Tensor, ranks: int, sizes: list[int]) -> list[torch.Tensor]:
    """The inverse of `_in_sequence`: [b, s, n] -> per chunk i, [ranks * b, sizes[i], n]."""
    pieces = sequence.split(sizes * ranks, dim=1)
    chunks = len(sizes)
    return [torch.cat([pieces[rank * chunks + i] for rank in range(ranks)], dim=0) for i in range(chunks)]


class _GatherProject(torch.autograd.Function):
    """local [b, s/tp, d] -> per weight, [b, s, out]: the sequence all-gathered chunk by chunk, each chunk
    projected by the column-parallel weights while the next one arrives."""

    @staticmethod
    def forward(ctx: Any, local, group, chunks, *weights):
        ctx.group, ctx.autocast = group, _autocast_state(local.device.type)
        pieces = local.chunk(chunks, dim=1)
        ctx.sizes = [piece.shape[1] for piece in pieces]
        gathers = [all_gather_rows(piece, group) for piece in pieces]  # all in flight
        projected: list[list[torch.Tensor]]
        projected, saved = [[] for _ in weights], []
        for full, work in gathers:
            work.wait()
            for outputs, weight in zip(projected, weights):
                outputs.append(full @ weight.T)
            saved.append(full)
        ctx.save_for_backward(*weights, *saved)
        ctx.weights = len(weights)
        ranks = dist.get_world_size(group)
        return tuple(_in_sequence(outputs, ranks) for outputs in projected)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        tensors = ctx.saved_tensors  # read once: under activation checkpointing each read unpacks them
        weights, saved = tensors[: ctx.weights], tensors[ctx.weights :]
        ranks = dist.get_world_size(ctx.group)
        grad_rows = [_in_chunk_rows(grad, ranks, ctx.sizes) for grad in grads]
        weight_grads = [torch.zeros_like(weight) for weight in weights]
        reduces = []
        with torch.autocast(**ctx.autocast):
            for index, full in enumerate(saved):
                d_full = None
                for weight, weight_grad, rows in zip(weights, weight_grads, grad_rows):
                    weight_grad += _outer(rows[index], full)
                    d_full = rows[index] @ weight if d_full is None else d_full + rows[index] @ weight
                assert d_full is not None  # there are weights (q, k and v)
                reduces.append(reduce_scatter_rows(d_full, ctx.group))  # while the next chunk computes
            d_local = torch.cat(_finished(reduces), dim=1)
        return d_local, None, None, *weight_grads


class _ProjectScatter(torch.autograd.Function):
    """[b, s, in] (whole sequence, this rank's heads) -> local [b, s/tp, d]: each chunk projected by the
    row-parallel weight and its partial sums reduce-scattered while the next chunk is projected."""

    @staticmethod
    def forward(ctx: Any, sequence, group, chunks, weight):
        ctx.group, ctx.autocast = group, _autocast_state(sequence.device.type)
        ranks = dist.get_world_size(group)
        ctx.sizes = [
            piece.shape[1] for piece in sequence[:, : sequence.shape[1] // ranks].chunk(chunks, dim=1)
        ]
        rows = _in_chunk_rows(sequence, ranks, ctx.sizes)
        reduces = [reduce_scatter_rows(chunk @ weight.T, group) for chunk in rows]
        ctx.save_for_backward(weight, *rows)
        return torch.cat(_finished(reduces), dim=1)

    @staticmethod
    def backward(ctx: Any, grad_local: torch.Tensor):
        weight, *rows = ctx.saved_tensors
        gathers = [all_gather_rows(piece, ctx.group) for piece in grad_local.chunk(len(rows), dim=1)]
        weight_grad, d_rows = torch.zeros_like(weight), []
        with torch.autocast(**ctx.autocast):
            for chunk, (grad_rows, work) in zip(rows, gathers):
                work.wait()
                weight_grad += _outer(grad_rows, chunk)
                d_rows.append(grad_rows @ weight)
        return _in_sequence(d_rows, dist.get_world_size(ctx.group)), None, None, weight_grad


def _outer(grad: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight gradient [out, in] from output gradients and inputs [..., out] / [..., in]."""
    return grad.flatten(0, -2).T @ inputs.flatten(0, -2)


def _autocast_state(device_type: str) -> dict[str, Any]:
    """The forward's autocast, to run the backward under the same."""
    return {
        "device_type": device_type,
        "dtype": torch.get_autocast_dtype(device_type),
        "enabled": torch.is_autocast_enabled(device_type),
    }


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _chunked_forward(module: Any, group: ProcessGroup, chunks: int, x: torch.Tensor) -> torch.Tensor:
    """The MLP module's forward: its input is the residual stream's sequence shard (a DTensor Shard(1)
    from the sequence-parallel norm, or its local tensor); returns the local output shard, as
    `RowwiseParallel` would."""
    w3 = module.w3.weight if module.w3 is not None else None
    return _ChunkedMLP.apply(
        _local(x),
        group,
        chunks,
        module.activate,
        _local(module.w1.weight),
        _local(w3),
        _local(module.w2.weight),
    )


def _chunked_attention_forward(
    module: Any, group: ProcessGroup, chunks: int, x: torch.Tensor, *args: Any
) -> torch.Tensor:
    """An attention module's forward (`wo(mix(wq x, wk x, wv x, ...))`) on the residual stream's sequence
    shard, its projections chunked around the sequence's gather and scatter; the local output shard."""
    weights = [_local(getattr(module, name).weight) for name in ("wq", "wk", "wv")]
    q, k, v = _GatherProject.apply(_local(x), group, chunks, *weights)
    return _ProjectScatter.apply(module.mix(q, k, v, *args), group, chunks, _local(module.wo.weight))


class ChunkedSequenceParallelAttention(ParallelStyle):
    """For a "projected_mixer" module under sequence parallelism: its forward, chunked and overlapped. The
    weights are sharded by the colwise / rowwise styles of its projections, which have no bias."""

    def __init__(self, chunks: int):
        super().__init__()
        self.chunks = chunks

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module.forward = functools.partial(
            _chunked_attention_forward, module, device_mesh.get_group(), self.chunks
        )
        return module


class ChunkedSequenceParallelMLP(ParallelStyle):
    """For a "position_wise_mlp" module under sequence parallelism: its forward, chunked and overlapped.
    The weights are sharded by the colwise / rowwise styles of its linear layers."""

    def __init__(self, chunks: int):
        super().__init__()
        self.chunks = chunks

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module.forward = functools.partial(_chunked_forward, module, device_mesh.get_group(), self.chunks)
        return module
