"""Bytes one device holds at its peak: weights, gradients and optimizer state by ZeRO stage, activations.

Training state follows ZeRO (Rajbhandari et al. 2020): stage 1 shards the optimizer state over data
parallelism, stage 2 the gradients too, stage 3 the weights too (paper §2: MegaScale uses stage 2).
Activations per block follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Eqs. 1-3): s*b*h*(34 + 5*a*s/h) bytes at 2-byte activations, sequence parallelism
dividing everything by t. The attention-score term 5*a*s/h counts only where the scores are materialised
(no FlashAttention kernel, `megascale.plan.compute`) and not recomputed: a FlashAttention kernel keeps no
scores, and selective recomputation (Korthikanti et al.'s) drops exactly them. Full recomputation keeps
only each block's input; torchtitan's selective op checkpointing ("op") the block's input, the attention
kernel's output and the outputs of every other matmul (`megascale.plan.compute`). The pipeline's first stage
holds the most micro-batches in flight: pp of them under 1F1B, pp * (1 + (pp - 1)/(pp * v)) interleaved.
Context parallelism divides s by cp (each rank keeps its own positions' activations) and adds the ring's
messages in flight (`megascale.plan.context`); the weights' data-parallel group is dp x cp ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.config import head_dim_of
from megascale.models.flops import attention_params, matmul_params_per_layer
from megascale.plan.compute import linear_shapes
from megascale.plan.context import ring_buffer_bytes
from megascale.plan.experts import (
    expert_data_parallel,
    moe_activation_bytes,
    moe_block_params,
    moe_layers,
)
from megascale.plan.job import Job, Layout


@dataclass(frozen=True)
class Memory:
    """Bytes per device, by what they hold."""

    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes


@dataclass(frozen=True)
class ParamGroup:
    """Parameters one device holds that the same data-parallel group keeps copies of: `ranks` ranks,
    `stride` apart, which ZeRO shards them over and gradient synchronisation spans."""

    params: float
    ranks: int
    stride: int


def stage_param_groups(job: Job, layout: Layout) -> list[ParamGroup]:
    """Parameters of the heaviest pipeline stage on one device (with the embedding or the output layer),
    by data-parallel group: the routed experts, held by fewer ranks, apart from the rest."""
    model = job.model
    layers = model.n_layers / layout.pp
    moe_blocks = min(layers, moe_layers(model))  # the heaviest stage holds MoE blocks first
    vocab = model.vocab_size * model.dim * (1 if layout.pp > 1 or model.tie_embeddings else 2)
    split = layout.tp if layout.attention == "tp" else 1  # "sp" holds every weight whole
    dense_block = matmul_params_per_layer(model) + 2 * model.dim
    rest = ((layers - moe_blocks) * dense_block + vocab) / split
    groups = [ParamGroup(0.0, layout.fsdp_ranks * (layout.tp // split), split)]
    if moe_blocks:
        shared, routed = moe_block_params(job, layout)
        attention = (attention_params(model) + 2 * model.dim) / split
        rest += moe_blocks * (attention + shared)
        groups.append(ParamGroup(moe_blocks * routed, *expert_data_parallel(layout)))
    groups[0] = ParamGroup(rest, groups[0].ranks, groups[0].stride)
    return groups


def stage_params(job: Job, layout: Layout) -> float:
    """Parameters of the heaviest pipeline stage on one device."""
    return sum(group.params for group in stage_param_groups(job, layout))


def activation_bytes_per_block(
    job: Job, layout: Layout, moe: bool = False, materialized_scores: bool = False
) -> float:
    """Activations one block keeps for its backward, per micro-batch, on one device; with `moe`, a block
    whose MLP (19 of the 34 sbh) is a mixture-of-experts layer (`megascale.plan.experts`); with
    `materialized_scores`, attention without a FlashAttention kernel."""
    s, b, h, t = layout.local_seq_len(job), layout.micro_batch, job.model.dim, layout.tp
    scale = job.precision.activation_bytes / 2  # the formula counts 2-byte activations
    sharded = layout.sequence_parallel or layout.attention == "sp"
    if layout.recompute == "full":
        return s * b * h * 2 * scale / (t if sharded else 1)
    if layout.recompute == "op":
        model = job.model
        kept = h / (t if sharded else 1) + model.attention.n_heads * head_dim_of(model) / t
        kept += sum(n_out for _, n_out in linear_shapes(model, t)[0::2])  # as each rank computes them
        return s * b * kept * job.precision.activation_bytes
    dense = s * b * h * (34 / t if sharded else 10 + 24 / t) * scale
    if materialized_scores and layout.recompute == "none":
        dense += 5 * job.model.attention.n_heads * s * job.seq_len * b / t * scale
    return dense * 15 / 34 + moe_activation_bytes(job, layout) if moe else dense


def micro_batches_in_flight(job: Job, layout: Layout) -> float:
    """Micro-batches whose activations the first stage holds at once."""
    m = layout.micro_batches(job)
    if layout.pp == 1:
        return 1.0
    in_flight = float(layout.pp)
    if layout.virtual_stages > 1 and not layout.zero_bubble:  # a V holds 1F1B's (Qi et al. 2024)
        in_flight *= 1 + (layout.pp - 1) / (layout.pp * layout.virtual_stages)
    return min(in_flight, m)


def memory_per_device(job: Job, layout: Layout, materialized_scores: bool = False) -> Memory:
    """Peak bytes on the busiest device (`materialized_scores`: attention without a FlashAttention
    kernel)."""
    precision, zero = job.precision, layout.zero_stage
    groups = stage_param_groups(job, layout)

    def held(nbytes: int, sharded_from: int) -> float:
        return sum(g.params * nbytes / (g.ranks if zero >= sharded_from else 1) for g in groups)

    weights, grads = held(precision.weight_bytes, 3), held(precision.grad_bytes, 2)
    optimizer = held(precision.optimizer_bytes, 1)
    blocks = job.model.n_layers / layout.pp
    moe_blocks = min(blocks, moe_layers(job.model))
    activations = (blocks - moe_blocks) * activation_bytes_per_block(job, layout, False, materialized_scores)
    activations += moe_blocks * activation_bytes_per_block(job, layout, True, materialized_scores)
    activations *= micro_batches_in_flight(job, layout)
    tokens = layout.micro_batch * layout.local_seq_len(job)
    logits = 2 * 4 * tokens * job.model.vocab_size / layout.tp  # fp32, and its grad
    return Memory(weights, grads, optimizer, activations + logits + ring_buffer_bytes(job, layout))
