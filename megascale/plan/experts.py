"""A mixture-of-experts layer on one device: its GEMMs, its other operators and its all-to-alls, by how the
layout spreads it (`Layout.moe_tp`, `Layout.ep`; docs/planning.md, "Mixture of experts"). Experts split
over ranks run at the busiest rank's pace (`busiest_rank_load`); the grouped GEMMs' rate and the other
operators' share of their time were measured on an H100 (docs/gpu.md#6-kernel-efficiency-at-the-planners-
shapes); the all-to-alls hide behind the experts' GEMMs as far as the overlap lets them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from megascale.config import ModelConfig, OverlapConfig
from megascale.models.flops import expert_params
from megascale.models.moe import expert_dim_of
from megascale.plan.comm import all_to_all_seconds
from megascale.plan.hardware import HardwareProfile
from megascale.plan.job import RECOMPUTES, Job, Layout

# Chunks an overlapped all-to-all is cut into, as megascale's tensor-parallel overlap cuts its collectives
# (`parallel.overlap.tp_chunks`); the first one's transfer is always exposed.
EP_OVERLAP_CHUNKS = OverlapConfig().tp_chunks


@dataclass(frozen=True)
class MoEWork:
    """One MoE layer (without its attention), one micro-batch, forward + backward, on one device."""

    gemm_s: float  # router, routed experts (their grouped GEMMs) and shared experts
    expert_gemm_s: float  # the part of gemm_s an all-to-all can overlap (routed experts)
    other_ops_s: float  # the layer's other operators: routing, slots sorted, gathered and scattered back
    all_to_all_s: float  # dispatch and combine, forward and backward (and recomputation)
    forward_all_to_all_s: float  # the forward's share of all_to_all_s


def is_moe(model: ModelConfig) -> bool:
    return model.moe.experts > 0


def moe_layers(model: ModelConfig) -> int:
    return model.n_layers - model.moe.dense_layers if is_moe(model) else 0


def tokens_in(job: Job, layout: Layout) -> float:
    """Tokens entering the router on one device: its sequence share under "ep", else the micro-batch."""
    tokens = layout.micro_batch * layout.local_seq_len(job)
    return tokens / layout.tp if layout.experts_over_tp else tokens


def slots_computed(job: Job, layout: Layout) -> float:
    """Routed token slots one device's experts compute (evenly loaded experts)."""
    return tokens_in(job, layout) * job.model.moe.top_k


def expert_width(job: Job, layout: Layout) -> int:
    """Hidden size of each expert as one device holds it."""
    width = expert_dim_of(job.model)
    return width // layout.tp if layout.moe_tp == "split" else width


@functools.cache
def expected_max_of_normals(count: int) -> float:
    """E[max of `count` independent standard normals] (1.42 for 8), by integration."""
    step = 1e-3

    def cdf(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    points = [(i + 0.5) * step for i in range(int(10 / step))]
    return sum((1 - cdf(x) ** count) - cdf(-x) ** count for x in points) * step


def busiest_rank_load(job: Job, layout: Layout) -> float:
    """Slots the busiest rank of the expert group computes in a layer and micro-batch, over the mean (1 where
    every rank computes a share of every slot): each token picks top_k of E experts, a rank's count is
    hypergeometric, and the busiest of ep exceeds the mean by E[max of ep normals] standard deviations; a
    capacity caps it."""
    ranks = layout.ep
    if ranks == 1:
        return 1.0
    moe, share = job.model.moe, 1 / ranks
    without_replacement = (moe.experts - moe.top_k) / max(1, moe.experts - 1)
    per_token_variance = moe.top_k * share * (1 - share) * without_replacement
    spread = math.sqrt(ranks * tokens_in(job, layout) * per_token_variance / (1 - share))
    load = 1 + expected_max_of_normals(ranks) * spread / slots_computed(job, layout)
    return min(load, moe.capacity_factor) if moe.capacity_factor else load


def layout_problem(job: Job, layout: Layout) -> str | None:
    """Why this MoE layout (or its recomputation) cannot run or is not modelled, or None."""
    model = job.model
    if layout.recompute not in RECOMPUTES:
        return f"recompute {layout.recompute!r} is not one of {', '.join(RECOMPUTES)}"
    if layout.recompute == "op" and (is_moe(model) or layout.attention == "sp"):
        return "recompute 'op' (torchtitan's selective op checkpointing) is modelled for dense blocks only"
    if layout.moe_tp not in ("split", "whole", "ep"):
        return f"moe_tp {layout.moe_tp!r} is not one of split, whole, ep"
    if layout.attention not in ("tp", "sp"):
        return f"attention {layout.attention!r} is not one of tp, sp"
    if not is_moe(model):
        return "ep > 1 needs an MoE model" if layout.ep > 1 or layout.experts_over_tp else None
    if layout.experts_over_tp and layout.ep % layout.tp:
        return (
            f"moe_tp 'ep' puts the experts over the tp ranks: ep {layout.ep} must be a multiple of tp "
            f"{layout.tp}"
        )
    if layout.experts_over_tp and layout.dp % (layout.ep // layout.tp):
        return f"moe_tp 'ep': ep {layout.ep} / tp {layout.tp} must divide dp {layout.dp}"
    if layout.experts_over_tp and layout.tp > 1 and layout.attention == "tp" and not layout.sequence_parallel:
        return "moe_tp 'ep' needs the sequence split over the tp ranks (sequence parallelism)"
    if not layout.experts_over_tp and layout.fsdp_ranks % layout.ep:
        context = f" x cp {layout.cp}" if layout.cp > 1 else ""
        return f"ep {layout.ep} must divide dp {layout.dp}{context}"
    if model.moe.experts % layout.ep:
        return f"{model.moe.experts} experts do not split over {layout.ep} ranks"
    if layout.moe_tp == "split" and expert_dim_of(model) % layout.tp:
        return f"expert hidden size {expert_dim_of(model)} does not split over tp {layout.tp}"
    return None


def moe_work(job: Job, layout: Layout, profile: HardwareProfile, gemm_seconds) -> MoEWork:
    """The MoE layer of one block; `gemm_seconds(m, k, n)` times one [m, k] x [k, n] GEMM on the roofline.
    The routed experts run as grouped GEMMs, at the profile's fraction of the rate of one expert's GEMM,
    and the layer's other operators add the profile's share of their time (both measured on an H100);
    both, and the all-to-all, at the pace of the busiest rank's slots (`busiest_rank_load`)."""
    model, moe = job.model, job.model.moe
    projections = 3 if model.mlp == "swiglu" else 2
    width = expert_width(job, layout)
    local_experts = moe.experts // layout.ep
    load = busiest_rank_load(job, layout)
    slots = slots_computed(job, layout) * load
    per_expert = slots / local_experts
    # Forward GEMM, then backward's two of the same size, for each projection of each local expert.
    expert_gemm_s = local_experts * projections * 3 * gemm_seconds(per_expert, model.dim, width)
    expert_gemm_s /= profile.grouped_gemm_efficiency
    tokens = tokens_in(job, layout)
    router_tokens = tokens / layout.tp if layout.moe_tp == "split" and layout.sequence_parallel else tokens
    router_s = 3 * gemm_seconds(router_tokens, model.dim, moe.experts)
    shared_s = 0.0
    if moe.shared_experts:
        shared_width = moe.shared_experts * width
        shared_s = projections * 3 * gemm_seconds(tokens, model.dim, shared_width)
    nbytes = job.precision.activation_bytes
    exchanges = layout.forward_passes(job) + 1  # dispatch + combine per pass: forward(s), backward
    stride = 1 if layout.experts_over_tp else layout.tp
    one_s = all_to_all_seconds(slots * model.dim * nbytes, layout.ep, stride, profile)
    return MoEWork(
        gemm_s=expert_gemm_s + router_s + shared_s,
        expert_gemm_s=expert_gemm_s,
        other_ops_s=profile.moe_operator_overhead * expert_gemm_s,
        all_to_all_s=2 * exchanges * one_s,
        forward_all_to_all_s=2 * one_s,
    )


def exposed_all_to_all_seconds(work: MoEWork, overlap: str, block_s: float) -> float:
    """What of the layer's all-to-alls stays on the critical path: all without overlap; with it ("both") the
    first chunk and what outlasts the expert GEMMs beside it; under "batch" (Megatron-Core's
    overlap_moe_expert_parallel_comm) the forward's behind another micro-batch's backward (two thirds of
    `block_s`), the backward's behind its forward."""
    if overlap == "none" or not work.all_to_all_s:
        return work.all_to_all_s
    if overlap == "batch":
        backward_exchanges_s = work.all_to_all_s - work.forward_all_to_all_s
        forward_exposed_s = max(0.0, work.forward_all_to_all_s - 2 * block_s / 3)
        return forward_exposed_s + max(0.0, backward_exchanges_s - block_s / 3)
    hidden_s = work.all_to_all_s
    return min(hidden_s, hidden_s / EP_OVERLAP_CHUNKS + max(0.0, hidden_s - work.expert_gemm_s))


def moe_block_params(job: Job, layout: Layout) -> tuple[float, float]:
    """(an MoE block's layer outside the routed experts, the routed experts) one device holds."""
    model, moe = job.model, job.model.moe
    expert = expert_params(model)
    split = layout.tp if layout.moe_tp == "split" else 1
    routed = moe.experts * expert / split / layout.ep
    return model.dim * moe.experts + moe.shared_experts * expert / split, routed


def expert_data_parallel(layout: Layout) -> tuple[int, int]:
    """(ranks holding the same experts, their stride): the routed experts' data-parallel group."""
    if layout.experts_over_tp:  # ep / tp data-parallel ranks' tp groups hold different experts
        return layout.dp // (layout.ep // layout.tp), layout.ep
    return layout.fsdp_ranks // layout.ep, layout.tp * layout.ep


def moe_activation_bytes(job: Job, layout: Layout, weighted_activation: bool = False) -> float:
    """Activations one MoE layer keeps per micro-batch on one device: each slot's input, output (unless
    `weighted_activation`) and expert projections, the shared experts' per token."""
    if layout.recompute == "full":
        return 0.0
    model, moe = job.model, job.model.moe
    width = expert_width(job, layout)
    nbytes = job.precision.activation_bytes
    per_slot = (1 if weighted_activation else 2) * model.dim + 3 * width
    per_token = (3 * moe.shared_experts * width + model.dim) if moe.shared_experts else 0
    return nbytes * (slots_computed(job, layout) * per_slot + tokens_in(job, layout) * per_token)
