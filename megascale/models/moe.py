"""Mixture-of-experts feed-forward layer, single-device (docs/moe.md): a top-k router, routed experts
computed as one grouped GEMM, optional shared experts, and the two ways of keeping the experts' load even.

Routing: each token's router scores (a softmax over the experts, or each expert's sigmoid as in
DeepSeek-V3) pick its `top_k` experts; the chosen scores, normalised to sum to 1 when asked (always for
sigmoid scores) and times `route_scale`, weigh the experts' outputs. A per-expert bias, added to the scores
for the choice only, is DeepSeek-V3's auxiliary-loss-free balancing: `update_bias` moves it toward an even
load after each step from the load counted over the step. The load-balancing loss (Switch Transformer:
E * sum_i f_i * P_i, f the share of token slots routed to expert i, P its mean score) reaches the
gradients through `AuxLoss`: it adds nothing to the forward output and seeds the loss's gradient in the
backward (Megatron-LM's way), so it needs no path of its own to the loss and works on any pipeline stage.
It is computed per sequence and averaged (DeepSeek-V3's sequence-wise form), so that it is the same
objective however a step's sequences are split into micro-batches and data-parallel ranks.

Compute: token slots are sorted by expert (a stable sort keeps token order within an expert) and every
expert's slice is multiplied by its weights in one `torch._grouped_mm` (torch's grouped GEMM, the kernel
torchtitan uses; it runs on CPU too), then put back in token order and summed with the weights. Dropless
by default; with `capacity_factor`, an expert takes at most ceil(factor * seq_len * top_k / experts) slots
of each sequence (GShard's capacity, one group per sequence, so that what is dropped does not depend on
how sequences are batched), in token order, and the rest are dropped (their output is zero: the residual
carries them).

The layer may be given only a part of each sequence (its `sequences`, `WholeSequences` by default): the
tensor-parallel ranks each route their own part when the experts are split over them, and the
context-parallel ranks their slices of every sequence. The per-sequence counts behind capacity and the
balancing loss then come from all parts, so what is dropped and the loss are those of whole sequences;
the parallel code supplies how the counts are exchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megascale.config import ModelConfig
from megascale.models.feed_forward import FeedForward, ffn_dim_of

# Inside `training_step` (the micro-batch forwards of a step): the auxiliary losses' weight; else None.
_aux_loss_scale: float | None = None


@contextlib.contextmanager
def training_step(aux_loss_scale: float = 1.0) -> Iterator[None]:
    """Inside, forwards are a training step's micro-batches: their expert loads are counted (for the bias
    update) and their auxiliary losses weigh `aux_loss_scale` in the backward: 1/micro-batches where the
    caller divides the main loss by the number of micro-batches before its backward, 1 where the gradients
    are divided afterwards. Forwards outside (evaluation; a pipeline schedule's shape inference) count
    nothing and add no auxiliary loss."""
    global _aux_loss_scale
    previous, _aux_loss_scale = _aux_loss_scale, aux_loss_scale
    try:
        yield
    finally:
        _aux_loss_scale = previous


class AuxLoss(torch.autograd.Function):
    """Identity on `output`; in the backward, `loss` gets the gradient `scale` (its weight in the
    objective), so the auxiliary loss is minimised with the main one without being added to it."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.scale), None


def expert_dim_of(cfg: ModelConfig) -> int:
    """Each expert's hidden size: model.moe.expert_dim, else the dense layer's."""
    return cfg.moe.expert_dim if cfg.moe.expert_dim is not None else ffn_dim_of(cfg)


class WholeSequences:
    """The layer's input holds whole sequences: each count over a sequence's tokens is already complete.
    A layer given a part of each sequence gets an object with the same methods that exchanges them."""

    parts = 1  # ranks each sequence is split over, each holding as many of its tokens
    pieces = 1  # contiguous runs of the sequence this rank's part is made of, in token order
    # How much this part's terms of the balancing loss weigh: 1 where the ranks' gradients are summed,
    # `parts` where they are averaged (the ranks are data-parallel ranks too).
    loss_weight = 1

    def total(self, counts: torch.Tensor) -> torch.Tensor:
        """`counts` over this part of each sequence -> over the whole sequences (no gradient)."""
        return counts

    def before(self, counts: torch.Tensor) -> torch.Tensor:
        """`counts` [..., pieces] over each piece of this part of each sequence -> over the whole
        sequence's tokens before each piece, in token order."""
        return torch.zeros_like(counts)


class Router(nn.Module):
    """Scores every token against every expert and picks `top_k`."""

    expert_bias: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.score, self.route_scale = moe.top_k, moe.score, moe.route_scale
        self.normalize = moe.normalize_weights or moe.score == "sigmoid"
        self.gate = nn.Linear(cfg.dim, moe.experts, bias=False)
        # Added to the scores for the choice only (auxiliary-loss-free balancing); saved with the model.
        self.register_buffer("expert_bias", torch.zeros(moe.experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, dim] -> the chosen experts' weights [tokens, k] and indices [tokens, k], and every
        expert's score [tokens, experts] (float32)."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        chosen = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.normalize and self.top_k == 1:
            # s / s is exactly 1 and its derivative 0; computed through autograd, that derivative is
            # rounding noise, which Adam scales up to full-size router updates that differ by layout.
            # w * 0 + 1 is 1 with an exactly-zero gradient (the router still has one, and optimizer state).
            weights = weights * 0 + 1
        elif self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.route_scale, chosen, scores


class GroupedExperts(nn.Module):
    """`experts` SwiGLU or GeLU MLPs with stacked weights, computed by grouped GEMMs over token slots sorted
    by expert."""

    def __init__(self, cfg: ModelConfig, experts: int):
        super().__init__()
        hidden = expert_dim_of(cfg)
        self.gated = cfg.mlp == "swiglu"
        self.w1 = nn.Parameter(torch.empty(experts, cfg.dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, cfg.dim, hidden)) if self.gated else None
        self.w2 = nn.Parameter(torch.empty(experts, hidden, cfg.dim))

    # Left out of torch.compile: torch 2.13's meta kernel of the grouped GEMM takes only bfloat16 (CUDA's
    # rule), so tracing a float32 one fails; the rest of a compiled block is compiled around it.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [slots, dim], sorted by expert, `counts[e]` slots for expert e -> [slots, dim]."""
        return grouped_mlp(x, counts, self.w1, self.w3, self.w2)


def grouped_mlp(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None, w2: torch.Tensor
) -> torch.Tensor:
    """Experts' MLPs (SwiGLU with `w3`, else GeLU) on slots `x` sorted by expert, `counts[e]` for expert e,
    with stacked weights w1, w3 [experts, dim, hidden] and w2 [experts, hidden, dim]."""
    ends = counts.cumsum(0).to(torch.int32)
    device = x.device.type
    # Autocast does not cover the grouped GEMM: its operands are cast here as autocast casts a matmul's.
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w1.dtype

    def grouped(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(inputs.to(dtype), weight.to(dtype), offs=ends)

    up = grouped(x, w1)
    middle = F.silu(up) * grouped(x, w3) if w3 is not None else F.gelu(up, approximate="tanh")
    return grouped(middle, w2)


class MoE(nn.Module):
    """The feed-forward layer of an MoE block: routed experts (+ shared experts), [batch, seq, dim] in and
    out."""

    load: torch.Tensor
    dropped: torch.Tensor
    balance: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k = moe.experts, moe.top_k
        self.capacity_factor, self.aux_loss_coeff = moe.capacity_factor, moe.aux_loss_coeff
        self.bias_update_rate = moe.bias_update_rate
        self.sequences = WholeSequences()
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg, moe.experts)
        self.shared = (
            FeedForward(cfg, hidden=expert_dim_of(cfg) * moe.shared_experts) if moe.shared_experts else None
        )
        # Token slots each expert took since the last `update_bias` (training only), dropped slots, and the
        # balancing loss's sum and count of forwards (with aux_loss_coeff).
        self.register_buffer("load", torch.zeros(moe.experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.register_buffer("balance", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        output = self._routed(flat, *self.router(flat), seq).view(batch, seq, dim).to(x.dtype)
        if self.shared is not None:
            output = output + self.shared(x)
        return output

    # Left out of torch.compile: how many slots each expert gets changes every step, and so do the shapes
    # from here to the combine; compiled, each new count is a recompilation and each data-dependent size a
    # graph break. The router and the shared experts before and after it are compiled with the block.
    @torch.compiler.disable
    def _routed(
        self, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, scores: torch.Tensor, seq: int
    ) -> torch.Tensor:
        """The routed experts' output for tokens `flat` [tokens, dim] routed as `chosen` with `weights`,
        [tokens, dim], the step's load counted and the balancing loss attached (training)."""
        dim = flat.shape[-1]
        slots = chosen.flatten()
        order = slots.argsort(stable=True)  # slot positions grouped by expert, in token order
        routed_counts = torch.bincount(slots, minlength=self.num_experts)
        order, counts = self._within_capacity(order, slots[order], routed_counts, seq)
        routed = self.experts(flat[order // self.top_k], counts)
        output = routed.new_zeros(slots.numel(), dim).index_copy(0, order, routed)
        output = (output.view(-1, self.top_k, dim) * weights.unsqueeze(-1).to(output.dtype)).sum(dim=1)
        if _aux_loss_scale is None or not self.training:
            return output
        # Counted once per forward: not again when activation checkpointing recomputes it in the backward.
        if torch._C._current_graph_task_id() == -1:
            with torch.no_grad():
                self.load += routed_counts.to(self.load.dtype)
                self.dropped += slots.numel() - order.numel()
        if self.aux_loss_coeff and torch.is_grad_enabled():  # the recomputation builds the same graph
            batch = flat.shape[0] // seq
            loss, value = self.balance_loss(scores.view(batch, seq, -1), chosen.view(batch, seq, -1))
            if torch._C._current_graph_task_id() == -1:
                with torch.no_grad():
                    self.balance += torch.stack([value, torch.ones_like(value)])
            output = AuxLoss.apply(output, loss, self.aux_loss_coeff * _aux_loss_scale)
        return output

    def _within_capacity(
        self, order: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots (`order`, sorted by expert: `experts`) the experts compute and how many each: all of
        them when dropless, else each expert's first `capacity` slots of each sequence, in token order."""
        if self.capacity_factor is None:
            return order, counts
        whole = seq_len * self.sequences.parts
        capacity = math.ceil(self.capacity_factor * whole * self.top_k / self.num_experts)
        # Sorted by expert in token order, each (expert, sequence, piece) triple's slots are one run, after
        # the pair's slots in the sequence's tokens before the piece.
        per_sequence, pieces = seq_len * self.top_k, self.sequences.pieces
        sequences = order.numel() // per_sequence
        piece = order % per_sequence * pieces // per_sequence
        runs = (experts * sequences + order // per_sequence) * pieces + piece
        run_sizes = torch.bincount(runs, minlength=self.num_experts * sequences * pieces)
        earlier = self.sequences.before(run_sizes.view(-1, pieces)).flatten()
        starts = run_sizes.cumsum(0) - run_sizes - earlier
        keep = torch.arange(order.numel(), device=order.device) - starts[runs] < capacity
        kept = order[keep]
        return kept, torch.bincount(experts[keep], minlength=self.num_experts)

    def balance_loss(self, scores: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Switch Transformer's E * sum_i f_i * P_i per sequence, averaged over the sequences: f_i the
        share of the sequence's token slots routed to expert i, P_i its mean score over the sequence
        (sigmoid scores normalised per token first). scores [batch, seq, experts], chosen [batch, seq, k]
        of this part of each sequence -> (this part's terms of the loss, whose gradient is this part's
        scores' share of the whole loss's, times `sequences.loss_weight`; the whole loss's value, no
        gradient). Of whole sequences, both are the loss."""
        if self.router.score == "sigmoid":
            scores = scores / scores.sum(dim=-1, keepdim=True)
        batch, seq, k = chosen.shape
        counts = scores.new_zeros(batch, self.num_experts)
        counts.scatter_add_(1, chosen.reshape(batch, seq * k), scores.new_ones(batch, seq * k))
        summed = scores.sum(dim=1)
        whole = seq * self.sequences.parts
        counts, summed_whole = self.sequences.total(torch.cat([counts, summed.detach()], 1)).split(
            self.num_experts, 1
        )
        share = counts / (whole * k)
        loss = self.num_experts * (share * summed / whole).sum(dim=1).mean() * self.sequences.loss_weight
        value = self.num_experts * (share * summed_whole / whole).sum(dim=1).mean()
        return loss, value

    @torch.no_grad()
    def update_bias(self) -> None:
        """After a step: every expert's routing bias moves `bias_update_rate` toward the mean load (the load
        counted since the last call, summed over the data-parallel ranks by the caller), then the count
        starts again."""
        if self.bias_update_rate:
            self.router.expert_bias += self.bias_update_rate * torch.sign(self.load.mean() - self.load)
        self.load.zero_()
        self.balance.zero_()
