"""Bytes one device holds at its peak: weights, gradients and optimizer state by ZeRO stage
(arXiv:1910.02054), and activations counted tensor by tensor as Korthikanti et al. count a GPT block's
(arXiv:2205.05198 §4) or as megascale's own model saves them, for the micro-batches in flight on the first
stage (docs/planning.md, "The model").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megascale.config import head_dim_of
from megascale.models.attention import attends_in_float32
from megascale.models.feed_forward import ffn_dim_of
from megascale.models.flops import attention_params, matmul_params_per_layer
from megascale.plan.compute import linear_shapes
from megascale.plan.context import ring_buffer_bytes
from megascale.plan.experts import expert_data_parallel, moe_activation_bytes, moe_block_params, moe_layers
from megascale.plan.job import Features, Job, Layout
from megascale.plan.stages import most_blocks


@dataclass(frozen=True)
class Memory:
    """Bytes per device at the step's peak, by what they hold."""

    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes


@dataclass(frozen=True)
class ParamGroup:
    """Parameters one device holds that `ranks` ranks `stride` apart keep copies of (ZeRO shards them)."""

    params: float
    ranks: int
    stride: int


def stage_param_groups(job: Job, layout: Layout) -> list[ParamGroup]:
    """Parameters of the heaviest stage on one device, by data-parallel group (routed experts apart)."""
    model = job.model
    layers = most_blocks(job, layout)
    moe_blocks = min(layers, moe_layers(model))  # the heaviest stage holds MoE blocks first
    split = layout.tp if layout.attention == "tp" else 1  # "sp" holds every weight whole
    dense_block = matmul_params_per_layer(model) + 2 * model.dim
    rest = (layers - moe_blocks) * dense_block / split + vocab_params(job, layout)
    groups = [ParamGroup(0.0, layout.fsdp_ranks * (layout.tp // split), split)]
    if moe_blocks:
        shared, routed = moe_block_params(job, layout)
        attention = (attention_params(model) + 2 * model.dim) / split
        rest += moe_blocks * (attention + shared)
        groups.append(ParamGroup(moe_blocks * routed, *expert_data_parallel(layout)))
    groups[0] = ParamGroup(rest, groups[0].ranks, groups[0].stride)
    return groups


def vocab_params(job: Job, layout: Layout) -> float:
    """The embedding's and output layer's parameters on the heaviest stage's device."""
    model = job.model
    split = layout.tp if layout.attention == "tp" else 1
    return model.vocab_size * model.dim * (1 if layout.pp > 1 or model.tie_embeddings else 2) / split


def gathered_bytes(job: Job, layout: Layout, groups: list[ParamGroup]) -> list[float]:
    """Bytes of each of `groups` as data parallelism gathers them (blocks at `block_gather_bytes`)."""
    precision, vocab = job.precision, vocab_params(job, layout)
    gathered = []
    for index, group in enumerate(groups):
        rest = vocab if index == 0 else 0.0
        gathered.append((group.params - rest) * precision.block_gather_bytes + rest * precision.weight_bytes)
    return gathered


def gathers_copies(job: Job, layout: Layout) -> bool:
    """Whether data parallelism gathers narrower copies than it holds (its masters then sharded)."""
    return job.precision.gathered_block_bytes is not None and layout.fsdp_ranks > 1


def stage_params(job: Job, layout: Layout) -> float:
    """Parameters of the heaviest pipeline stage on one device."""
    return sum(group.params for group in stage_param_groups(job, layout))


# The system the counts assume where none is named: FlashAttention, Megatron-LM's fused SwiGLU, bfloat16
# inputs kept for float8 layers, gradients in a buffer held through the step, float32 logits and gradient.
DEFAULT_SYSTEM = Features()


@dataclass(frozen=True)
class KeptPerToken:
    """What a block keeps for its backward per token (bytes at 2-byte activations), by what splits it."""

    split: float  # what only sequence parallelism splits over the tp ranks (else every rank keeps it)
    by_tp: float  # what every tp split divides (the heads', the ffn width's)
    mlp_split: float  # the MLP's share of `split`
    mlp_by_tp: float  # the MLP's share of `by_tp`


def block_bytes_per_token(job: Job, features: Features = DEFAULT_SYSTEM) -> KeptPerToken:
    """What a block keeps for its backward per token, tensor by tensor for its shape, as Korthikanti et al.
    count a GPT block's 34 sbh (arXiv:2205.05198 §4): split only by sequence parallelism, the norms' and
    column-parallel layers' inputs and dropout's masks; split by tp, q, k, v, the attention's output and
    the MLP's ffn-wide tensors; float8 inputs at a byte where the system keeps them so."""
    model = job.model
    h, head = model.dim, head_dim_of(model)
    q, kv = model.attention.n_heads * head, model.attention.n_kv_heads * head
    serial = model.block != "parallel"
    masks = (2 if job.dropout else 0) * h  # a byte an element
    inputs = 2 if serial else 1  # norms, and the inputs the column-parallel layers read
    float8_copies = features.float8_keeps_inputs and job.fp8
    linear_input = 1 if float8_copies else 2  # bytes a linear layer's kept input takes
    ffn_tensors = (3 if features.elementwise != "eager" else 4) if model.mlp == "swiglu" else 2
    # ... the last of them is the input of the MLP's row-parallel layer
    mlp_by_tp = (2 * (ffn_tensors - 1) + linear_input) * ffn_dim_of(model)
    return KeptPerToken(
        split=(2 + linear_input) * h * inputs + masks,
        by_tp=2 * (q + kv) + 2 * kv + (3 if float8_copies else 2) * q + mlp_by_tp,
        mlp_split=(linear_input * h if serial else 0) + masks / 2,
        mlp_by_tp=mlp_by_tp,
    )


def activation_bytes_per_block(
    job: Job, layout: Layout, moe: bool = False, features: Features = DEFAULT_SYSTEM
) -> float:
    """Activations one block keeps for its backward, per micro-batch, on one device (with `moe`, its MLP an
    MoE layer's), and materialised scores where the system keeps them (5as/h, 2as/h without dropout)."""
    s, b, t = layout.local_seq_len(job), layout.micro_batch, layout.tp
    scale = job.precision.activation_bytes / 2  # the counts are of 2-byte activations
    sharded = layout.sequence_parallel or layout.attention == "sp"
    if layout.recompute == "full":  # the block's input
        return s * b * job.model.dim * 2 * scale / (t if sharded else 1)
    if layout.recompute == "op":
        model = job.model
        op_kept = model.dim / (t if sharded else 1) + model.attention.n_heads * head_dim_of(model) / t
        op_kept += sum(n_out for _, n_out in linear_shapes(model, t)[0::2])  # as each rank computes them
        return s * b * op_kept * job.precision.activation_bytes
    kept = block_bytes_per_token(job, features)
    if moe:  # the MLP's own count is the MoE layer's (`moe_activation_bytes`)
        kept = KeptPerToken(kept.split - kept.mlp_split, kept.by_tp - kept.mlp_by_tp, 0.0, 0.0)
    per_token = kept.split / (t if sharded else 1) + kept.by_tp / t
    dense = s * b * per_token * scale
    if features.attention == "materialized" and layout.recompute == "none":
        dense += (5 if job.dropout else 2) * job.model.attention.n_heads * s * job.seq_len * b / t * scale
    return dense + moe_activation_bytes(job, layout, features.moe_weighted_activation) if moe else dense


def trainer_block_bytes(job: Job, layout: Layout, on_cpu: bool = False) -> float:
    """What one dense block of megascale's own model keeps for its backward, per micro-batch, on one device,
    tensor by tensor as its operators save them (tests/plan/test_memory.py counts them on the model)."""
    model, t = job.model, layout.tp
    if layout.recompute in ("selective", "op"):
        return activation_bytes_per_block(job, layout)
    tokens = layout.micro_batch * layout.local_seq_len(job)
    split_norms = t if layout.sequence_parallel else 1
    if layout.recompute == "full":
        return tokens * 4 * model.dim / split_norms  # the block's input
    cast = job.dtype == "bfloat16"  # autocast over float32 weights
    a = 2 if cast else 4
    hd, f = head_dim_of(model), ffn_dim_of(model)
    attention = (
        4 if cast and attends_in_float32("cpu" if on_cpu else "cuda", torch.bfloat16, hd, job.seq_len) else a
    )
    q, kv = model.attention.n_heads * hd, model.attention.n_kv_heads * hd
    norm = 4 * model.dim + (4 if model.norm == "rmsnorm" else 8)  # input; rstd (and mean)
    norms = 1 if model.block == "parallel" else 2
    swiglu = model.mlp == "swiglu"
    linear_inputs = (3 if cast else 1) + (2 if cast and swiglu else 1)
    per_token = norms * norm / split_norms + linear_inputs * a * model.dim
    per_token += attention * (2 * q + 2 * kv) / t + 4 * model.attention.n_heads / t
    per_token += (a * q if attention != a else 0) / t  # the output, cast back for the projection
    per_token += (4 if swiglu else 2) * a * f / t
    # Autocast's casts of the weights, kept by the graph; FSDP's gathered copies need none (and are counted
    # as weights, or freed after the forward under ZeRO-3).
    weight_casts = 2 * matmul_params_per_layer(model) / t if cast and not gathers_copies(job, layout) else 0.0
    return tokens * per_token + weight_casts


def micro_batches_in_flight(job: Job, layout: Layout) -> float:
    """Micro-batches whose activations the first stage holds at once."""
    m = layout.micro_batches(job)
    if layout.pp == 1:
        return 1.0
    in_flight = float(layout.pp)
    if layout.virtual_stages > 1 and not layout.zero_bubble:  # a V holds 1F1B's (Qi et al. 2024)
        in_flight *= 1 + (layout.pp - 1) / (layout.pp * layout.virtual_stages)
    return min(in_flight, m)


def memory_per_device(
    job: Job, layout: Layout, features: Features = DEFAULT_SYSTEM, on_cpu: bool = False
) -> Memory:
    """Peak bytes on the busiest device, as the system keeps its tensors (`Features`); `on_cpu`: the model
    picks its own kernels and offload fetches nothing ahead."""
    precision, zero = job.precision, layout.zero_stage
    groups = stage_param_groups(job, layout)

    def held(nbytes: int, sharded_from: int) -> float:
        return sum(g.params * nbytes / (g.ranks if zero >= sharded_from else 1) for g in groups)

    weights, grads = held(precision.weight_bytes, 3), held(precision.grad_bytes, 2)
    if gathers_copies(job, layout):  # float32 masters sharded, bfloat16 copies gathered whole below ZeRO-3
        weights = held(precision.weight_bytes, 1)
        if zero < 3:
            gathered = zip(groups, gathered_bytes(job, layout, groups))
            weights += sum(nbytes for group, nbytes in gathered if group.ranks > 1)
    optimizer = held(precision.optimizer_bytes, 1)
    blocks = most_blocks(job, layout)
    moe_blocks = min(blocks, moe_layers(job.model))
    if features.own_blocks:
        dense = trainer_block_bytes(job, layout, on_cpu)
    else:
        dense = activation_bytes_per_block(job, layout, False, features)
    per_micro_batch = (blocks - moe_blocks) * dense
    per_micro_batch += moe_blocks * activation_bytes_per_block(job, layout, True, features)
    in_flight = micro_batches_in_flight(job, layout)
    held_blocks = blocks * in_flight
    if layout.offload:
        held_blocks = offload_held_blocks(layout, blocks, in_flight, fetch_ahead=not on_cpu)
    working = 0.0
    if layout.recompute == "full":  # the block whose forward is recomputed holds all of it for its backward
        whole = dataclasses.replace(layout, recompute="none")
        moe = moe_blocks == blocks
        if features.own_blocks and not moe:
            working = trainer_block_bytes(job, whole, on_cpu)
        else:
            working = activation_bytes_per_block(job, whole, moe, features)
    tokens = layout.micro_batch * layout.local_seq_len(job)
    logits = features.loss_bytes_per_logit * tokens * job.model.vocab_size / layout.tp
    saved = per_micro_batch / blocks
    other = ring_buffer_bytes(job, layout)
    # Every gradient is there from the first backward on: held in a buffer, or made by an earlier micro-batch.
    if not features.grads_as_made or layout.pp > 1 or layout.micro_batches(job) > 1:
        return Memory(weights, grads, optimizer, saved * held_blocks + working + logits + other)
    block_grads = grads * (1 - vocab_params(job, layout) / sum(g.params for g in groups)) / blocks
    moments = backward_moments(layout, grads, block_grads, saved, working, blocks, fetch_ahead=not on_cpu)
    moments.append((saved * held_blocks + logits, 0.0))  # the loss: every forward done, no gradient yet
    at_peak, made = max(moments, key=sum)
    return Memory(weights, made, optimizer, at_peak + other)


def backward_moments(
    layout: Layout,
    grads: float,
    block_grads: float,
    saved: float,
    working: float,
    blocks: int,
    fetch_ahead: bool,
) -> list[tuple[float, float]]:
    """(activations held, gradients made) in each block's backward, last block first, of a step of one
    micro-batch without a pipeline; with offload, a block holds what it reads back and the block fetched
    ahead."""
    moments = []
    for block in reversed(range(blocks)):
        held = saved * (block + 1)
        if layout.offload:
            whole = block == blocks - 1 or fetch_ahead or layout.recompute == "full"
            ahead = fetch_ahead and block > 0
            held = saved * (whole + ahead)
        moments.append((held + working, grads - block_grads * block))
    return moments


def offload_held_blocks(layout: Layout, blocks: float, in_flight: float, fetch_ahead: bool) -> float:
    """Blocks' worth of activations held at the peak under offload: each chunk's last per micro-batch in
    flight, the block run, and on an accelerator the one fetched ahead."""
    kept = in_flight * layout.virtual_stages
    ahead = 1 if fetch_ahead and blocks > 2 * layout.virtual_stages else 0
    return min(blocks * in_flight, kept + ahead)
