"""Expert parallelism (MegaScale-MoE's parallelism for the FFN): each MoE layer's routed experts are split
over the 'ep' ranks of the expert mesh, and every token slot goes to its expert's rank and back by
all-to-all.

The MoE layer (models/moe.py) sorts its token slots by expert and hands them, with each expert's count, to
its experts module. Under expert parallelism that module
1. exchanges the per-expert counts with the other ep ranks (an all-to-all of `experts` integers),
2. sends each rank the slots of its experts (an all-to-all with uneven splits; its backward sends the
   gradients back the same way),
3. regroups what arrived by local expert and computes it with one grouped GEMM per projection,
4. returns the outputs to the slots' ranks, in the order they were sent.
The router, the shared experts and the rest of the block are data-parallel as in a dense model.

Weights: each stacked expert tensor [experts, ...] becomes a DTensor sharded on dim 0 over 'ep' (a
checkpoint or an export sees the whole tensor) and is sharded again by FSDP over 'edp', the remaining
dp_shard / ep ranks, in an FSDP unit of its own inside the block's. An expert's gradient is summed over
the tokens of every ep rank (the all-to-all's backward brings them), so it is scaled by 1/ep before that
unit's reduce-scatter averages it over edp: the mean over all data-parallel ranks' losses, as for every
other gradient (FSDP2's gradient divide factor would do it in the reduce-scatter, but as a pre-multiplied
sum, which gloo does not have). With parallel.moe_tp = "ep" the ep dimension is ep x tp ranks, the tp
ranks of one data-parallel rank each sending the slots of its own part of the sequence: the tokens of ep
batches, so the scale stays 1/ep.

Payload precision (`wire`, parallel.ep_comm_dtype): float32; bfloat16, a cast; or float8_e4m3fn,
MegaScale-MoE's FP8 communication (§5), for the dispatch and the combine, forward and backward alike. An
fp8 payload is quantized row by row in blocks of up to 128 channels, each scaled by amax(block) / 448 (the
largest e4m3 number) into e4m3's range, and dequantized to the compute dtype on arrival, so that what
follows (the grouped GEMMs, the sums of the gradients) runs in that dtype. The paper scales the
forward per token and the backward per 128 channels; here both directions use blocks of 128, which is per
token for rows of up to 128 channels. gloo takes no float8 tensor ("Invalid scalar type"), so a row
travels as bytes: its fp8 values, then its blocks' float32 scales, in the same row of one uint8
all-to-all (no second exchange for the scales): a quarter of float32's bytes plus 4 per block.

Why by hand: torch has the collectives and DTensor but no expert-parallel style (torchtitan's is not part
of torch), its autograd-aware all-to-all is in the private functional collectives, and it has fp8 casts
but no scaled fp8 collective (its scaled fp8 is for matmuls, `torch._scaled_mm`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from megascale.models.moe import GroupedExperts, MoE, grouped_mlp
from megascale.parallel.tensor import local_shard

FP8_BLOCK = 128  # channels that share one scale in an fp8 payload's row
_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max  # 448


def quantize_fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows [n, dim] -> uint8 [n, dim + 4 * ceil(dim / FP8_BLOCK)]: each row's fp8 values, its blocks of
    up to FP8_BLOCK channels scaled into e4m3's range by amax(block) / 448 (1 for a block of zeros), then
    those blocks' float32 scales, as bytes."""
    rows = rows.float()
    amax = torch.stack([block.abs().amax(1) for block in rows.split(FP8_BLOCK, 1)], 1)
    scales = torch.where(amax > 0, amax / _FP8_MAX, 1.0)
    per_channel = scales.repeat_interleave(FP8_BLOCK, 1)[:, : rows.shape[1]]
    values = (rows / per_channel).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
    return torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], 1)


def dequantize_fp8_rows(payload: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows [n, dim] in `dtype` that `quantize_fp8_rows` packed into `payload`."""
    values = payload[:, :dim].contiguous().view(_FP8).float()
    scales = payload[:, dim:].contiguous().view(torch.float32)
    return (values * scales.repeat_interleave(FP8_BLOCK, 1)[:, :dim]).to(dtype)


def _encode(rows: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """`rows` [n, dim] as they travel: cast to `wire`, or as the bytes of their fp8 quantization."""
    return quantize_fp8_rows(rows) if wire == _FP8 else rows.to(wire).contiguous()


def _decode(payload: torch.Tensor, wire: torch.dtype, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fp8_rows(payload, dim, dtype) if wire == _FP8 else payload.to(dtype)


class _InFlight:
    """An asynchronous all-to-all between its issue and its wait: how it was issued, and the rows arriving in
    their wire's encoding."""

    received: list[int]
    sent: list[int]
    group: dist.ProcessGroup
    wire: torch.dtype
    work: dist.Work
    arriving: torch.Tensor


def _issue(
    rows: torch.Tensor, received: list[int], sent: list[int], group: dist.ProcessGroup, wire: torch.dtype
) -> _InFlight:
    """Starts sending `rows` [sum(sent), dim] encoded for `wire`, `sent[r]` of them to the group's rank r
    in order, and receiving `received[r]` rows from each; not blocking (`_wait` finishes it)."""
    flight = _InFlight()
    flight.received, flight.sent, flight.group, flight.wire = received, sent, group, wire
    payload = _encode(rows.detach(), wire)  # the gradient comes back by `_Wait`'s backward
    flight.arriving = payload.new_empty(sum(received), payload.shape[1])
    work = dist.all_to_all_single(flight.arriving, payload, received, sent, group=group, async_op=True)
    assert work is not None  # async_op
    flight.work = work
    return flight


def _wait(flight: _InFlight, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows [sum(received), dim] in `dtype` that `flight` brings, once arrived (blocking)."""
    flight.work.wait()
    return _decode(flight.arriving, flight.wire, dim, dtype)


class _Returning:
    """The gradient's exchange of one `_Wait`: issued by its backward, waited for by `_WaitForGradient`'s."""

    flight: _InFlight


class _Wait(torch.autograd.Function):
    """The rows that `flight`, issued from `rows`, brings, once arrived; the backward sends the gradient
    back the same way, in the same precision. The exchange's autograd node is its wait, with the sent rows
    as input, because what travels (fp8's bytes) cannot carry a gradient. Without `returning` the backward
    waits for the gradient's exchange itself; with it, it only issues it and hands an unfilled tensor to
    the `_WaitForGradient` node on `rows`, which waits: the nodes autograd runs in between (another
    chunk's expert GEMMs) overlap the transfer."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, flight: _InFlight, returning: _Returning | None = None
    ) -> torch.Tensor:
        ctx.received, ctx.sent, ctx.group, ctx.wire = flight.received, flight.sent, flight.group, flight.wire
        ctx.returning = returning
        return _wait(flight, rows.shape[1], rows.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        back = _issue(grad, ctx.sent, ctx.received, ctx.group, ctx.wire)
        if ctx.returning is None:
            return _wait(back, grad.shape[1], grad.dtype), None, None
        ctx.returning.flight = back
        return grad.new_empty(sum(ctx.sent), grad.shape[1]), None, None  # filled by _WaitForGradient


class _WaitForGradient(torch.autograd.Function):
    """Identity; in the backward, the gradient that `returning`'s exchange brings back, once arrived. Put
    on the rows a `_Wait` sends, it comes before that `_Wait` in the forward and so after it in the
    backward, with whatever autograd runs between them."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, returning: _Returning) -> torch.Tensor:
        ctx.returning = returning
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, unfilled: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _wait(ctx.returning.flight, unfilled.shape[1], unfilled.dtype), None


def _exchange_start(
    rows: torch.Tensor,
    received: list[int],
    sent: list[int],
    group: dist.ProcessGroup,
    wire: torch.dtype,
    overlap_backward: bool,
) -> tuple[torch.Tensor, _InFlight, _Returning | None]:
    """Issue the exchange of `rows`; (the rows to hand its `_Wait`, the flight, the gradient's return when
    the backward overlaps it)."""
    returning = _Returning() if overlap_backward else None
    if returning is not None:
        rows = _WaitForGradient.apply(rows, returning)
    return rows, _issue(rows, received, sent, group, wire), returning


class _ScaleGradient(torch.autograd.Function):
    """Identity; the gradient times `scale` in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _chunk_counts(counts: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    """Each expert's slots dealt into `chunks` consecutive runs, as even as can be: the counts per chunk."""
    return [counts // chunks + (index < counts % chunks).to(counts.dtype) for index in range(chunks)]


def _chunk_slots(counts: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    """The positions, in slots sorted by expert, of each chunk's slots (sorted by expert in turn)."""
    starts = counts.cumsum(0) - counts
    positions, offset = [], torch.zeros_like(counts)
    for part in _chunk_counts(counts, chunks):
        first = (starts + offset).repeat_interleave(part)
        within = torch.arange(int(part.sum()), device=counts.device) - (
            part.cumsum(0) - part
        ).repeat_interleave(part)
        positions.append(first + within)
        offset = offset + part
    return positions


class ExpertParallelExperts(GroupedExperts):
    """GroupedExperts holding this rank's share of the experts (its `__class__` after
    `apply_expert_parallel`); forward takes and returns all experts' slots, as GroupedExperts does.

    The slots go in `chunks` chunks (each expert's slots dealt evenly): every chunk's dispatch is issued
    at once, and each chunk's expert compute runs while the later chunks' dispatches and the earlier
    chunks' combines are in flight; in the backward, each chunk's returning gradients travel while the
    other chunk's expert GEMMs run backward. The payload travels in `wire` precision."""

    ep_group: dist.ProcessGroup
    data_ranks: int = 1  # data-parallel ranks whose batches the ep group's tokens are
    chunks: int = 1
    wire: torch.dtype | None = None

    @torch.compiler.disable
    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [slots, dim] sorted by expert, `counts[e]` slots for expert e (all experts) -> [slots, dim]."""
        group, wire = self.ep_group, self.wire or x.dtype
        ranks = dist.get_world_size(group)
        local = counts.numel() // ranks
        by_source = torch.empty_like(counts)
        dist.all_to_all_single(by_source, counts, group=group)
        by_source = by_source.view(ranks, local)  # slots each rank sends to each of this rank's experts
        # Summed over every ep rank's tokens; FSDP then averages over edp: over all dp ranks in all.
        weights = [
            _ScaleGradient.apply(local_shard(w), 1 / self.data_ranks) if w is not None else None
            for w in (self.w1, self.w3, self.w2)
        ]
        positions = _chunk_slots(counts, self.chunks) if self.chunks > 1 else [None]
        chunk_counts = _chunk_counts(counts, self.chunks)
        arriving = _chunk_counts(by_source, self.chunks)
        overlap = self.chunks > 1  # the backward's exchanges overlap the other chunks' GEMMs too
        dispatches = []
        for where, mine, theirs in zip(positions, chunk_counts, arriving):
            sent = mine.view(ranks, local).sum(1).tolist()
            received = theirs.sum(1).tolist()
            payload = x if where is None else x[where]
            dispatches.append(_exchange_start(payload, received, sent, group, wire, overlap))
        # Arrivals come grouped by source rank, then by expert; sorted by these keys (expert, then source)
        # each expert's slots are one run for the grouped GEMM.
        keys = torch.arange(local).repeat(ranks) * ranks + torch.arange(ranks).repeat_interleave(local)
        keys = keys.to(counts.device)
        combines = []
        for (payload, flight, returning), theirs in zip(dispatches, arriving):
            arrived = _Wait.apply(payload, flight, returning)
            order = keys.repeat_interleave(theirs.flatten()).argsort(stable=True)
            computed = grouped_mlp(arrived[order], theirs.sum(0), *weights)  # type: ignore[arg-type]
            computed = computed[order.argsort()]
            combines.append(_exchange_start(computed, flight.sent, flight.received, group, wire, overlap))
        results = [_Wait.apply(*combine) for combine in combines]
        if positions[0] is None:
            return results[0]
        output = results[0].new_zeros(x.shape[0], results[0].shape[1])
        for where, result in zip(positions, results):
            output = output.index_copy(0, where, result)
        return output


def apply_expert_parallel(
    part: nn.Module,
    expert_mesh: DeviceMesh,
    *,
    data_ranks: int,
    reshard: bool,
    chunks: int,
    wire: torch.dtype | None,
    gathers: MixedPrecisionPolicy | None = None,
) -> set[nn.Parameter]:
    """Every MoE layer of `part`, in place: its experts split over expert_mesh['ep'] (whose tokens are
    those of `data_ranks` data-parallel ranks' batches) and FSDP-sharded over expert_mesh['edp'],
    replicated over its 'dp_replicate' when it has one (HSDP; `reshard`: freed after forward, as ZeRO-3
    does; gathered as `gathers` says, as the blocks are); the slots travel in `chunks` chunks, in `wire`
    precision (None: their own). Collective over the expert mesh; apply before the blocks' FSDP, on
    identical models. Where no other rank holds the same experts there is nothing for FSDP to shard or
    reduce: the experts' parameters are returned, for the blocks' FSDP to leave alone, instead of being
    wrapped in a unit of one rank (which would gather and free them every micro-batch for nothing)."""
    ep_mesh = expert_mesh["ep"]
    names = expert_mesh.mesh_dim_names or ()
    data_dims = ("dp_replicate", "edp") if "dp_replicate" in names else "edp"  # HSDP, or FSDP
    rank, ranks = ep_mesh.get_local_rank(), ep_mesh.size()
    data_mesh = expert_mesh[data_dims]
    alone: set[nn.Parameter] = set()
    for module in part.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            mine = param.detach().chunk(ranks)[rank].clone()
            sharded = DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(sharded))
        experts.__class__ = ExpertParallelExperts
        parallel = cast(ExpertParallelExperts, experts)
        parallel.ep_group, parallel.chunks, parallel.wire = ep_mesh.get_group(), chunks, wire
        parallel.data_ranks = data_ranks
        if data_mesh.size() == 1:
            alone.update(experts.parameters())
        else:
            fully_shard(
                experts,
                mesh=data_mesh,
                reshard_after_forward=reshard,
                mp_policy=gathers or MixedPrecisionPolicy(),
            )
    return alone
