"""Device time of one micro-batch's forward + backward through one block, from FLOPs and bytes
(docs/planning.md, "The model"): GEMMs on a roofline by shape, attention's score matmuls in the system's
kernel, element-wise work as passes through memory, recomputation as the forward again; under context
parallelism 1/cp of it. A CPU adds the host time it measured per block; a GPU's launches run ahead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megascale.config import ModelConfig, head_dim_of
from megascale.models.feed_forward import ffn_dim_of
from megascale.plan.experts import MoEWork
from megascale.plan.hardware import HardwareProfile
from megascale.plan.job import Job, Layout

# Passes over a hidden-size vector per token per block, forward + backward, by element-wise kernels, counted
# from Megatron-LM's GPT block (LayerNorm, bias + GeLU on the 4x-wide MLP activations, bias-dropout-add
# twice, their gradients: https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/legacy/model/
# transformer.py); fusing LayerNorm and GeLU with their neighbours (MegaScale, arXiv:2402.15627 §3.3) halves
# them.
ELEMENTWISE_PASSES_UNFUSED = 72
ELEMENTWISE_PASSES_FUSED = 36
# The share of those passes over the MLP's 4x-wide activations (bias + GeLU and its gradient), which
# tensor parallelism splits with the MLP's columns; the rest, over hidden-size vectors (the LayerNorms and
# bias-dropout-adds), every tp rank repeats unless sequence parallelism splits them too (Korthikanti et
# al. 2022, arXiv:2205.05198 §4.2.2). Counting elements read and written a token in the same block:
# unfused, bias + GeLU moves 32 hidden-sizes of the block's 62; fused, 20 of 40.
ELEMENTWISE_MLP_SHARE = 0.5
# Bytes an element moves, forward + backward, in each operator torch's eager mode runs for a torchtitan Llama
# block at 2-byte activations, counted from its model's operators (https://github.com/pytorch/torchtitan/
# blob/main/torchtitan/models/llama/model.py, December 2024): an RMSNorm of float32 operators or a LayerNorm
# kernel, per hidden element; RoPE's float32 complex multiply, per query and key element; SwiGLU or GeLU,
# per ffn element; two residual adds and the backward's fork sums, per hidden element; the attention's
# output laid back out, per query element.
EAGER_RMSNORM_BYTES = 36 + 70
EAGER_LAYERNORM_BYTES = 4 + 8
EAGER_ROPE_BYTES = 20 + 20
EAGER_SWIGLU_BYTES = 10 + 16
EAGER_GELU_BYTES = 4 + 6
EAGER_RESIDUAL_BYTES = 2 * (6 + 6)
EAGER_ATTENTION_OUTPUT_BYTES = 4 + 4
# FlashAttention-2 is "around 2x faster than FlashAttention" (Dao 2023, arXiv:2307.08691, abstract).
FLASH_ATTENTION_1_SPEED = 0.5
# Bytes moved per element of a materialised [heads, s, s] score square at 2-byte activations, counted from
# Megatron-LM's fused scale-mask-softmax and dropout (https://github.com/NVIDIA/Megatron-LM/blob/main/
# megatron/legacy/model/transformer.py, CoreAttention): forward, scores written 2, softmax 4, dropout and
# mask 5, second matmul's read 2; backward, 2 + 2 for the probabilities' gradient and read, dropout 5,
# softmax 6, the two matmuls' reads 4; the dropout's 5 each way only with dropout (`Job.dropout`).
MATERIALIZED_BYTES_FORWARD = 13
MATERIALIZED_BYTES_BACKWARD = 19
DROPOUT_SCORE_BYTES = 5


@dataclass(frozen=True)
class BlockTime:
    """Seconds of one micro-batch through one block on one device, forward + backward, by kind."""

    gemm_s: float
    attention_s: float
    elementwise_s: float
    host_s: float
    recompute_s: float

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.elementwise_s + self.host_s + self.recompute_s


@functools.cache
def element_bytes(dtype: str) -> int:
    """Bytes of an element of `dtype` ("float8": torch's float8_e4m3fn)."""
    return torch.empty(
        (), dtype=getattr(torch, "float8_e4m3fn" if dtype == "float8" else dtype)
    ).element_size()


def gemm_seconds(m: float, k: float, n: float, profile: HardwareProfile, dtype: str) -> float:
    """One [m, k] x [k, n] GEMM on the roofline (its FLOPs or its bytes) plus its launch and tail."""
    rate, element = gemm_rate(profile, dtype), element_bytes(dtype)
    memory_s = ((m * k + k * n) * element + m * n * max(element, 2)) / profile.hbm_bytes_per_s
    return max(2 * m * k * n / rate, memory_s) + profile.gemm_half_flops / rate


def gemm_rate(profile: HardwareProfile, dtype: str) -> float:
    """FLOP/s of a large GEMM: the library's best fraction of peak (a smaller one at the float8 peak)."""
    float8 = profile.float8_gemm_efficiency if dtype == "float8" else 1.0
    return profile.peak_flops(dtype) * profile.gemm_efficiency * float8


def gemm_compute_seconds(flops: float, profile: HardwareProfile, dtype: str) -> float:
    """A GEMM's FLOPs at the large-GEMM rate, plus the launch and tail every kernel pays."""
    return (flops + profile.gemm_half_flops) / gemm_rate(profile, dtype)


def attention_shapes(model: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """(in, out) features of the attention's q, k, v and output projections on one tensor-parallel rank."""
    head_dim = head_dim_of(model)
    q_out, kv_out = model.attention.n_heads * head_dim, model.attention.n_kv_heads * head_dim
    return [
        (model.dim, q_out // tp),
        (model.dim, kv_out // tp),
        (model.dim, kv_out // tp),
        (q_out // tp, model.dim),
    ]


def mlp_shapes(model: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """(in, out) features of a dense MLP's projections on one tensor-parallel rank."""
    ffn = ffn_dim_of(model)
    return [(model.dim, ffn // tp)] * (2 if model.mlp == "swiglu" else 1) + [(ffn // tp, model.dim)]


def linear_shapes(model: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """(in, out) features of each linear layer of one dense block as one tensor-parallel rank holds it."""
    return attention_shapes(model, tp) + mlp_shapes(model, tp)


def linear_gemms_seconds(
    shapes: list[tuple[int, int]], tokens: float, profile: HardwareProfile, dtype: str
) -> float:
    """Each layer's forward GEMM and the backward's two of the same shape, for `tokens` tokens."""
    return sum(3 * gemm_seconds(tokens, n_in, n_out, profile, dtype) for n_in, n_out in shapes)


def attention_linear_seconds(job: Job, layout: Layout, profile: HardwareProfile) -> float:
    """The attention's projections, forward + backward: heads split over tp, or ("sp") whole."""
    tokens = layout.micro_batch * layout.local_seq_len(job)
    if layout.attention == "sp":
        return linear_gemms_seconds(
            attention_shapes(job.model, 1), tokens / layout.tp, profile, job.linear_dtype
        )
    return linear_gemms_seconds(attention_shapes(job.model, layout.tp), tokens, profile, job.linear_dtype)


def block_time(
    job: Job,
    layout: Layout,
    profile: HardwareProfile,
    fused_kernels: bool,
    moe: MoEWork | None = None,
    attention_kernel: str = "flash",
    elementwise: str = "kernels",
) -> BlockTime:
    """One block, one micro-batch, forward + backward and recomputation, on one device; with `moe`, its MLP
    that MoE layer."""
    model, dtype = job.model, job.linear_dtype
    tokens = layout.micro_batch * layout.local_seq_len(job)
    gemm_s = attention_linear_seconds(job, layout, profile)
    if moe is not None:
        gemm_s += moe.gemm_s
    elif layout.attention == "sp":
        gemm_s += linear_gemms_seconds(mlp_shapes(model, 1), tokens / layout.tp, profile, dtype)
    else:
        gemm_s += linear_gemms_seconds(mlp_shapes(model, layout.tp), tokens, profile, dtype)
    kernel = "fused" if fused_kernels else attention_kernel
    attention_fwd_s, attention_bwd_s = attention_seconds(job, layout, profile, kernel)
    shard = layout.tp if layout.sequence_parallel or layout.attention == "sp" else 1
    if moe is None and not fused_kernels and elementwise == "eager":
        token_bytes = eager_elementwise_bytes(model, layout.tp, shard)
    else:
        passes: float = ELEMENTWISE_PASSES_FUSED if fused_kernels else ELEMENTWISE_PASSES_UNFUSED
        # The dense MLP's share is split over the tp ranks, with or without sequence parallelism.
        if moe is None:
            passes = passes * (ELEMENTWISE_MLP_SHARE * shard / layout.tp + 1 - ELEMENTWISE_MLP_SHARE)
        token_bytes = model.dim * job.precision.activation_bytes * passes / shard
    elementwise_s = tokens * token_bytes / profile.hbm_bytes_per_s
    if moe is not None:
        elementwise_s += moe.other_ops_s
    if job.fp8:
        elementwise_s += float8_cast_seconds(job, layout, profile, moe is not None)
    host_s = profile.layer_overhead_s
    if layout.tp > 1:
        activations = tokens * model.dim * job.precision.activation_bytes
        host_s += profile.tp_layer_overhead_s + profile.tp_layer_overhead_s_per_byte * activations
    host_s += profile.dp_layer_overhead_s if layout.fsdp_ranks > 1 and layout.zero_stage >= 2 else 0.0
    # Selective recomputation redoes the attention core, which a FlashAttention kernel does anyway.
    # Full recomputation redoes the forward.
    recompute_s = ((gemm_s + elementwise_s + host_s) / 3 + attention_fwd_s) * (layout.forward_passes(job) - 1)
    if layout.recompute == "selective" and kernel == "materialized":
        recompute_s = attention_fwd_s
    if layout.recompute == "op":  # every second linear layer's forward, and the element-wise forward
        shapes = linear_shapes(model, layout.tp)[1::2]
        recompute_s = sum(gemm_seconds(tokens, n_in, n_out, profile, dtype) for n_in, n_out in shapes)
        recompute_s += elementwise_s / 3
    return BlockTime(gemm_s, attention_fwd_s + attention_bwd_s, elementwise_s, host_s, recompute_s)


def eager_elementwise_bytes(model: ModelConfig, tp: int, shard: int) -> float:
    """Bytes one token of one block moves in its element-wise operators as torch's eager mode runs them (the
    EAGER_* counts), split over `shard` ranks (hidden-size ones) or `tp` (heads and ffn width)."""
    norm = EAGER_RMSNORM_BYTES if model.norm == "rmsnorm" else EAGER_LAYERNORM_BYTES
    norms = 1 if model.block == "parallel" else 2
    hidden = (norms * norm + EAGER_RESIDUAL_BYTES) * model.dim / shard
    head_dim = head_dim_of(model)
    queries, keys = model.attention.n_heads * head_dim, model.attention.n_kv_heads * head_dim
    rope = EAGER_ROPE_BYTES * (queries + keys) if model.position == "rope" else 0
    mlp = (EAGER_SWIGLU_BYTES if model.mlp == "swiglu" else EAGER_GELU_BYTES) * ffn_dim_of(model)
    return hidden + (rope + EAGER_ATTENTION_OUTPUT_BYTES * queries + mlp) / tp


# Bytes of memory traffic a float8 linear layer moves, counted from torchao's Float8Linear with dynamic
# per-tensor scaling (https://github.com/pytorch/ao/blob/main/torchao/float8/float8_linear.py): per element
# of its input, cast in the forward (an amax pass reads the 2-byte element, the cast reads it again and
# writes 1 byte) and again in the backward for the weight-gradient GEMM's other layout (the layer keeps its
# input in bf16); per element of its output gradient, one amax pass, then a cast for each backward GEMM's
# layout; per element of its weight, each micro-batch, cast in the forward and again in the backward from
# a 2-byte copy (FSDP's bf16 gather; with the float8 all-gather, each rank's shard before each gather).
FLOAT8_INPUT_CAST_BYTES = 2 * (2 + 2 + 1)
FLOAT8_GRAD_CAST_BYTES = 2 + 2 * (2 + 1)
FLOAT8_WEIGHT_CAST_BYTES = 2 * (2 + 2 + 1)


def float8_cast_bytes(tokens: float, n_in: int, n_out: int, weight_shards: int = 1) -> float:
    """Memory traffic of casting one float8 layer's input, output gradient and weight (in `weight_shards`)."""
    activations = tokens * (n_in * FLOAT8_INPUT_CAST_BYTES + n_out * FLOAT8_GRAD_CAST_BYTES)
    return activations + n_in * n_out * FLOAT8_WEIGHT_CAST_BYTES / weight_shards


def float8_cast_seconds(job: Job, layout: Layout, profile: HardwareProfile, moe: bool) -> float:
    """What float8 casts add to one block and micro-batch (an MoE layer's experts stay bf16)."""
    tokens = layout.micro_batch * layout.local_seq_len(job)
    shapes = attention_shapes(job.model, layout.tp) if moe else linear_shapes(job.model, layout.tp)
    shards = layout.fsdp_ranks if job.fp8_all_gather else 1
    cast_bytes = sum(float8_cast_bytes(tokens, n_in, n_out, shards) for n_in, n_out in shapes)
    return cast_bytes / profile.hbm_bytes_per_s


def keys_per_query(seq_len: int, window: int | None) -> float:
    """Keys a causal query attends to, on average over the sequence (a window caps them)."""
    span = seq_len if window is None else min(window, seq_len)
    return (span * (span + 1) / 2 + (seq_len - span) * span) / seq_len


def attention_seconds(job: Job, layout: Layout, profile: HardwareProfile, kernel: str) -> tuple[float, float]:
    """(forward, backward) seconds of one block's attention core a micro-batch: in a fused kernel ("fused" at
    the attention curve's rate, "flash2" at `flash2_attention_speed` of it, "flash" at half that), backward
    two forwards, or over materialised scores. Under context parallelism 1/cp of the causal work, in cp
    kernels."""
    model = job.model
    heads = model.attention.n_heads // layout.tp
    head_dim = head_dim_of(model)
    queries = layout.micro_batch * layout.local_seq_len(job)
    if kernel == "materialized":
        square = queries * heads * job.seq_len
        # Both matmuls over the whole square as batched GEMMs, timed by their FLOPs: the square's bytes,
        # which they write and read, are counted with the softmax's and the dropout's below.
        matmuls_s = gemm_compute_seconds(4.0 * square * head_dim, profile, job.dtype)
        memory_s = square * job.precision.activation_bytes / 2 / profile.hbm_bytes_per_s
        dropless = 0 if job.dropout else DROPOUT_SCORE_BYTES
        return (
            matmuls_s + (MATERIALIZED_BYTES_FORWARD - dropless) * memory_s,
            2 * matmuls_s + (MATERIALIZED_BYTES_BACKWARD - dropless) * memory_s,
        )
    keys = keys_per_query(job.seq_len, model.attention.window)
    flops = 4 * queries * keys * heads * head_dim
    speed = {"fused": 1.0, "flash2": profile.flash2_attention_speed}
    speed["flash"] = FLASH_ATTENTION_1_SPEED * speed["flash2"]
    efficiency = profile.attention_efficiency * speed[kernel]
    if profile.attention_half_flops:  # small kernels (few heads per rank, a ring step's) fill fewer units
        kernel_flops = flops / layout.cp
        efficiency *= 3 * kernel_flops / (3 * kernel_flops + profile.attention_half_flops)
    forward_s = flops / (profile.peak_flops(job.dtype) * efficiency)
    return forward_s, 2 * forward_s


def output_layer_seconds(job: Job, layout: Layout, profile: HardwareProfile) -> float:
    """The vocabulary projection, forward + backward, and the host time outside the blocks."""
    tokens = layout.micro_batch * layout.local_seq_len(job)
    host_s = profile.model_overhead_s + (profile.tp_model_overhead_s if layout.tp > 1 else 0.0)
    host_s += profile.dp_model_overhead_s if layout.fsdp_ranks > 1 and layout.zero_stage >= 2 else 0.0
    gemm_s = gemm_seconds(tokens, job.model.dim, job.model.vocab_size / layout.tp, profile, job.dtype)
    return 3 * gemm_s + host_s
