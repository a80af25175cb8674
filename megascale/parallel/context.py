"""Context parallelism's attention: each of the cp ranks holds a slice of every sequence, and causal
attention over the whole sequence is computed by passing keys and values around the ring of ranks.

Load balance. Under causal masking the last positions attend to the most keys, so contiguous slices would
leave the last rank with most of the work. The sequence is cut into 2 x cp chunks and rank r holds chunk r
and its mirror, chunk 2cp-1-r (`chunk_positions`): every rank then has the same number of (query, key)
pairs to compute.

The ring. Attention takes cp steps. At step i a rank holds the keys and values of rank (r - i) mod cp; the
next step's are sent to the following rank and received from the preceding one (point-to-point, one
message of keys and values stacked) while the current step's blocks are computed: the transfer is hidden
behind the compute, which is the point of the ring. A block is computed per pair of chunks (the rank's two
query chunks against the two key chunks it holds), pairs with no visible key skipped, with the mask made
from the positions' global indices (causal, and the sliding window when set), in float32; the blocks are
merged by their log-sum-exp (the online softmax of FlashAttention and Ring Attention). Grouped-query
attention reads each kv head for its group of query heads without copying.

Memory. The forward keeps only this rank's queries, keys, values, output and log-sum-exp, O(seq / cp): no
block's scores and no other rank's keys. The backward sends the keys and values around the ring again
(again behind the blocks), recomputes each block's scores from the saved log-sum-exp (FlashAttention's
backward) and sends each key chunk's gradient along with it, summed on the way, back to its rank after the
last step. The gradients travel behind the blocks too: a step computes its share of the held keys' gradient
while the sum of the steps before arrives, and adds it after.

Why by hand: torch's context parallelism (`torch.distributed.tensor.experimental.context_parallel` and its
ring of `_templated_ring_attention`) dispatches only CUDA's SDPA kernels (flash, memory-efficient, cuDNN),
so it does not run on this CPU, and it has no sliding window. The blocks here are explicit matmuls and a
softmax, which run anywhere; on an accelerator a fused kernel returning the log-sum-exp would be faster
(untested on GPU).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megascale.models.attention import WholeSequenceAttention
from megascale.models.llama import Attention
from megascale.models.moe import MoE
from megascale.parallel.tensor import SequenceShards


def chunk_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions rank `rank` of `cp` holds of a sequence of `seq_len`: chunk `rank` of the
    2 x cp equal chunks, then its mirror, chunk 2cp-1-rank. `seq_len` must divide by 2 x cp."""
    chunk = seq_len // (2 * cp)
    front = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    back = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([front, back])


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's slice of `tensor` along its sequence dimension `dim` (`chunk_positions`' order)."""
    return tensor.index_select(dim, chunk_positions(tensor.shape[dim], cp, rank, tensor.device))


class _InFlight:
    """A tensor on its way around the ring: the requests, and where it arrives."""

    works: list[dist.Work]
    arriving: torch.Tensor


def _neighbours(group: dist.ProcessGroup) -> tuple[int, int]:
    """The global ranks after and before this one in the ring of `group`."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return (
        dist.get_global_rank(group, (rank + 1) % size),
        dist.get_global_rank(group, (rank - 1) % size),
    )


def _issue(tensor: torch.Tensor, group: dist.ProcessGroup) -> _InFlight:
    """Start sending `tensor` to the next rank and receiving the previous rank's; not blocking."""
    after, before = _neighbours(group)
    flight = _InFlight()
    flight.arriving = torch.empty_like(tensor)
    works = [
        dist.isend(tensor.contiguous(), after, group=group),
        dist.irecv(flight.arriving, before, group=group),
    ]
    flight.works = [work for work in works if work is not None]
    return flight


def _wait(flight: _InFlight) -> torch.Tensor:
    for work in flight.works:
        work.wait()
    return flight.arriving


def _exchange(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`tensor` sent to the next rank, the previous rank's received (blocking)."""
    return _wait(_issue(tensor, group))


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[queries, keys]: key j is visible to query i (causal, within the window)."""
    seen = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    return seen


def _any_visible(q_start: int, k_start: int, chunk: int, window: int | None) -> bool:
    """Whether some key of the chunk from `k_start` is visible to some query of the chunk from `q_start`
    (in plain integers: deciding it from the position tensors would wait for an accelerator)."""
    if k_start > q_start + chunk - 1:
        return False
    return window is None or k_start + chunk - 1 > q_start - window


def _scores(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q [b, kv, group, sq, d] against k [b, kv, sk, d] -> masked scores [b, kv, group, sq, sk]."""
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    return scores.masked_fill(~visible, -math.inf)


class _Ring:
    """The geometry of one ring attention call: the ranks, the chunks and which pairs of them to compute."""

    def __init__(self, group: dist.ProcessGroup, local: int, window: int | None, device: torch.device):
        self.group, self.window = group, window
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.chunk = local // 2
        seq_len = local * self.cp
        self.q_positions = chunk_positions(seq_len, self.cp, self.rank, device).split(self.chunk)
        self.k_positions = [
            chunk_positions(seq_len, self.cp, (self.rank - step) % self.cp, device).split(self.chunk)
            for step in range(self.cp)
        ]

    def starts(self, rank: int) -> tuple[int, int]:
        """Where the two chunks `rank` holds begin in the sequence (`chunk_positions`)."""
        return rank * self.chunk, (2 * self.cp - 1 - rank) * self.chunk

    def pairs(self, step: int):
        """(query chunk, key chunk, visibility mask) of every pair with a visible key at `step`."""
        source = (self.rank - step) % self.cp
        for index, q_start in enumerate(self.starts(self.rank)):
            for part, k_start in enumerate(self.starts(source)):
                if _any_visible(q_start, k_start, self.chunk, self.window):
                    q_pos, k_pos = self.q_positions[index], self.k_positions[step][part]
                    yield index, part, _visible(q_pos, k_pos, self.window)

    def query(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        """Query chunk `index` of a [b, kv, group, local, ...] tensor."""
        return tensor[:, :, :, index * self.chunk : (index + 1) * self.chunk]

    def key(self, tensor: torch.Tensor, part: int) -> torch.Tensor:
        """Key chunk `part` of a [..., local, d] tensor (keys and values stacked in front)."""
        return tensor[..., part * self.chunk : (part + 1) * self.chunk, :]


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring, scale: float, overlap: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [b, kv, group, local, d], its log-sum-exp [b, kv, group, local]), without autograd."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)
    held = torch.stack([k, v])  # travels as one message
    for step in range(ring.cp):
        last = step == ring.cp - 1
        flight = _issue(held, ring.group) if overlap and not last else None  # behind this step's blocks
        for index, part, visible in ring.pairs(step):
            scores = _scores(ring.query(q, index), ring.key(held[0], part), visible, scale)
            block_lse = torch.logsumexp(scores, dim=-1)
            weights = torch.exp(scores - torch.where(torch.isfinite(block_lse), block_lse, 0.0)[..., None])
            block_out = weights @ ring.key(held[1], part).unsqueeze(2)
            before, rows = ring.query(lse, index), ring.query(out, index)
            merged = torch.logaddexp(before, block_lse)
            safe = torch.where(torch.isfinite(merged), merged, 0.0)
            kept = torch.where(torch.isfinite(before), torch.exp(before - safe), 0.0)[..., None]
            added = torch.where(torch.isfinite(block_lse), torch.exp(block_lse - safe), 0.0)[..., None]
            rows.copy_(rows * kept + block_out * added)
            before.copy_(merged)
        if not last:
            held = _wait(flight) if flight is not None else _exchange(held, ring.group)
    return out, lse


def _ring_backward(
    grad: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    ring: _Ring,
    scale: float,
    overlap: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v from the output's: the keys and values go around the ring again, each
    block's scores recomputed from the saved log-sum-exp (FlashAttention's backward), and each key chunk's
    gradient travels with it, back to its rank after the last step. With `overlap` the gradients summed by
    the ranks before arrive while this step's blocks compute theirs, and are added after."""
    q, k, v, out, lse = saved
    delta = (grad * out).sum(-1)  # rowsum(dO o O): the softmax's backward term
    grad_q = torch.zeros_like(q)
    held = torch.stack([k, v])
    summed: _InFlight | None = None  # the held keys' and values' gradients the ranks before summed
    for step in range(ring.cp):
        last = step == ring.cp - 1
        flight = _issue(held, ring.group) if overlap and not last else None
        if summed is not None and not overlap:
            held_grad = _wait(summed)
        else:  # this step's share of the held keys' and values' gradients
            held_grad = torch.zeros_like(held)
        for index, part, visible in ring.pairs(step):
            q_chunk, grad_chunk = ring.query(q, index), ring.query(grad, index)
            keys, values = ring.key(held[0], part), ring.key(held[1], part)
            scores = _scores(q_chunk, keys, visible, scale)
            weights = torch.exp(scores - ring.query(lse, index)[..., None])
            ring.key(held_grad[1], part).add_(torch.einsum("bhgqk,bhgqd->bhkd", weights, grad_chunk))
            grad_weights = torch.einsum("bhgqd,bhkd->bhgqk", grad_chunk, values)
            grad_scores = weights * (grad_weights - ring.query(delta, index)[..., None]) * scale
            ring.query(grad_q, index).add_(torch.einsum("bhgqk,bhkd->bhgqd", grad_scores, keys))
            ring.key(held_grad[0], part).add_(torch.einsum("bhgqk,bhgqd->bhkd", grad_scores, q_chunk))
        if summed is not None and overlap:
            held_grad += _wait(summed)
        summed = _issue(held_grad, ring.group)  # on to the rank holding these keys next (or home)
        if not last:
            held = _wait(flight) if flight is not None else _exchange(held, ring.group)
    assert summed is not None
    home = _wait(summed)
    return grad_q, home[0], home[1]


class _RingAttention(torch.autograd.Function):
    """Ring attention with FlashAttention's memory: the forward keeps only this rank's queries, keys,
    values, output and log-sum-exp; the backward sends the keys and values around again."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: dist.ProcessGroup,
        window: int | None,
        overlap: bool,
    ) -> torch.Tensor:
        ctx.ring = _Ring(group, q.shape[3], window, q.device)
        ctx.scale, ctx.overlap = 1.0 / math.sqrt(q.shape[-1]), overlap
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _ring_forward(q, k, v, ctx.ring, ctx.scale, overlap)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with torch.autocast(grad.device.type, enabled=False):
            grads = _ring_backward(grad.float(), ctx.saved_tensors, ctx.ring, ctx.scale, ctx.overlap)
        return (*grads, None, None, None)


@torch.compiler.disable  # its sends and receives, traced, become tensors without a wait (torch 2.13)
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    window: int | None = None,
    overlap: bool = True,
) -> torch.Tensor:
    """Causal attention of this rank's queries q [batch, heads, local, head_dim] over the keys and values
    k, v [batch, kv_heads, local, head_dim] of every rank of `group`, each rank's sequence slice laid out as
    `chunk_positions` says. Returns [batch, heads, local, head_dim] in q's dtype. With `overlap`, the next
    step's keys and values travel while this step's blocks are computed; without, between the steps."""
    batch, heads, local, head_dim = q.shape
    grouped = q.float().view(batch, k.shape[1], heads // k.shape[1], local, head_dim)
    out = _RingAttention.apply(grouped, k.float(), v.float(), group, window, overlap)
    return out.view(batch, heads, local, head_dim).to(q.dtype)


class RingAttention(WholeSequenceAttention):
    """The core of an attention layer under context parallelism (`apply_context_parallel`): its input is
    this rank's slice of each sequence, at `chunk_positions`, attended over the whole ring."""

    def __init__(self, group: dist.ProcessGroup, overlap: bool = True):
        self.group, self.overlap = group, overlap
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        return chunk_positions(seq * self.cp, self.cp, self.rank, device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, window, self.overlap)


class ContextShards(SequenceShards):
    """An MoE layer's view of sequences split over the cp ranks: this rank holds two pieces of each, chunks
    r and 2cp-1-r (`chunk_positions`). Counts are summed over the ring (as over a TP group), and the counts
    before a piece are those of every chunk ahead of it in the sequence, whichever rank holds it. The ranks
    are data-parallel ranks too (their gradients are averaged), so this part's balancing-loss terms weigh cp
    times."""

    pieces = 2

    def __init__(self, group: dist.ProcessGroup):
        super().__init__(group)
        self.loss_weight = self.parts

    def before(self, counts: torch.Tensor) -> torch.Tensor:
        held = [torch.empty_like(counts) for _ in range(self.parts)]
        dist.all_gather(held, counts.detach().contiguous(), group=self.group)
        # Every chunk's counts in sequence order: rank q holds chunks q and 2cp-1-q.
        chunks = torch.cat([torch.stack(held)[:, :, 0], torch.stack(held).flip(0)[:, :, 1]])
        ahead = chunks.cumsum(0) - chunks
        return torch.stack([ahead[self.rank], ahead[2 * self.parts - 1 - self.rank]], dim=-1)


def apply_context_parallel(part: nn.Module, group: dist.ProcessGroup, overlap: bool = True) -> None:
    """Every attention layer of `part`, in place, attends over the ring of `group`'s ranks, each holding
    its slice of the sequences (the step hands the model `shard_sequence`'s slices); `overlap`: the ring's
    transfers behind its compute. Every MoE layer counts its routing over the whole sequences."""
    for module in part.modules():
        if isinstance(module, Attention):
            module.core = RingAttention(group, overlap)
        elif isinstance(module, MoE):
            module.sequences = ContextShards(group)
