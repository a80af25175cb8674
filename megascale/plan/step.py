"""The analytical model of one training step: seconds by term, tokens/s, MFU and memory (MegaScale,
arXiv:2402.15627 §2, §3; docs/planning.md, "The model"):

    step = straggler * (m + bubble) * t_mb + overlapped PP + core sharing + exposed DP
           + sharing * optimizer + host
    t_mb = blocks_per_stage * (block + exposed TP/SP + exposed CP ring) [+ output layer on the last stage]
           [+ blocking PP p2p]

t_mb is one micro-batch through the busiest stage. The bubble is (pp - 1)/v micro-batch times (1F1B when
v = 1), (pp - 1)/3v for the zero-bubble V schedules. Each overlap of §3.2 hides its communication as far as
the compute beside it lasts, the first of its chunks excepted; stragglers slow a job on n hosts to
1 + d (1 - (1 - f)^n) times the healthy pace; on a CPU with more processes than cores the pipeline takes
the longer of its critical path and all its processes' core time over the cores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megascale.config import OverlapConfig, head_dim_of
from megascale.errors import ConfigError
from megascale.models.flops import flops_per_token
from megascale.plan.comm import (
    all_to_all_seconds,
    gather_or_scatter_seconds,
    group_gather_or_scatter_seconds,
    group_spans_nodes,
    send_seconds,
)
from megascale.plan.compute import (
    BlockTime,
    attention_linear_seconds,
    attention_shapes,
    block_time,
    gemm_seconds,
    mlp_shapes,
    output_layer_seconds,
)
from megascale.plan.context import context_problem, exposed_ring_seconds
from megascale.plan.experts import MoEWork, exposed_all_to_all_seconds, layout_problem, moe_layers, moe_work
from megascale.plan.hardware import HardwareProfile
from megascale.plan.job import Cluster, Features, Job, Layout
from megascale.plan.memory import Memory, gathered_bytes, memory_per_device, stage_param_groups
from megascale.plan.stages import busiest_rank, most_blocks

# Chunks an overlapped collective is cut into, as megascale's overlap cuts it (`parallel.overlap.tp_chunks`,
# MegaScale §3.2 Fig. 3); the first one's transfer is always exposed.
TP_OVERLAP_CHUNKS = OverlapConfig().tp_chunks


@dataclass(frozen=True)
class StepEstimate:
    """A predicted step: its seconds by term (they add up to `step_s`), throughput, MFU and memory."""

    terms_s: dict[str, float]
    tokens_per_s: float
    mfu: float
    memory: Memory
    micro_batches: int

    @property
    def step_s(self) -> float:
        return sum(self.terms_s.values())


def estimate_step(
    job: Job, layout: Layout, features: Features, profile: HardwareProfile, cluster: Cluster
) -> StepEstimate:
    """Predict one step of `job` laid out as `layout` on `cluster` devices of `profile`."""
    if problem := layout_problem(job, layout) or context_problem(job, layout):
        raise ConfigError(f"plan: layout {layout.describe()}: {problem}")
    model, m = job.model, layout.micro_batches(job)
    dense = block_time(
        job, layout, profile, features.fused_kernels, None, features.attention_kernel, features.elementwise
    )
    output_s = output_layer_seconds(job, layout, profile)
    busiest = busiest_rank(job, layout, dense.total_s, output_s)  # the pipeline runs at its pace
    blocks = busiest.blocks
    output_s *= busiest.output
    moe_blocks = min(blocks, moe_layers(model))  # the slowest stage holds MoE blocks first
    kinds: list[tuple[float, BlockTime, MoEWork | None]] = [(blocks - moe_blocks, dense, None)]
    if moe_blocks:
        moe = moe_work(job, layout, profile, lambda m, k, n: gemm_seconds(m, k, n, profile, job.dtype))
        moe_block = block_time(job, layout, profile, features.fused_kernels, moe, features.attention_kernel)
        kinds.append((moe_blocks, moe_block, moe))

    def per_micro_batch(seconds: Callable[[BlockTime, MoEWork | None], float]) -> float:
        return sum(count * seconds(block, moe) for count, block, moe in kinds)

    tp_exposed_s = per_micro_batch(
        lambda block, moe: _tp_exposed_seconds(job, layout, profile, features, block, moe)
    )
    ep_exposed_s = per_micro_batch(
        lambda block, moe: exposed_all_to_all_seconds(moe, features.ep_overlap, block.total_s) if moe else 0.0
    )
    cp_exposed_s = blocks * exposed_ring_seconds(job, layout, profile, features)  # every block's attention
    compute_s = per_micro_batch(lambda block, moe: block.total_s)
    micro_batch_s = compute_s + tp_exposed_s + ep_exposed_s + cp_exposed_s + output_s
    forward_s = per_micro_batch(lambda block, moe: block.total_s - block.recompute_s) / 3
    pp_exposed_s = _pp_exposed_seconds(job, layout, profile, features, m, forward_s)
    if not features.pp_overlap:
        micro_batch_s += pp_exposed_s
    bubble = _bubble_micro_batches(layout)
    slowdown = _straggler_slowdown(cluster, profile)
    dp_exposed_s = _dp_exposed_seconds(job, layout, profile, features, micro_batch_s)
    terms = {
        "gemm": m * per_micro_batch(lambda block, moe: block.gemm_s),
        "attention": m * per_micro_batch(lambda block, moe: block.attention_s),
        "elementwise": m * per_micro_batch(lambda block, moe: block.elementwise_s),
        "host_dispatch": m * per_micro_batch(lambda block, moe: block.host_s),
        "recompute": m * per_micro_batch(lambda block, moe: block.recompute_s),
        "output_layer": m * output_s,
        "tp_exposed": m * tp_exposed_s,
        "ep_exposed": m * ep_exposed_s,
        "cp_exposed": m * cp_exposed_s,
        "pp_exposed": m * pp_exposed_s,
        "bubble": bubble * micro_batch_s,
        "stragglers": (slowdown - 1) * (m + bubble) * micro_batch_s,
        "core_sharing": _core_sharing_seconds(
            cluster, profile, m * (compute_s + output_s), (m + bubble) * micro_batch_s
        ),
        "dp_exposed": dp_exposed_s,
        "optimizer": _core_sharing(cluster, profile) * _optimizer_seconds(job, layout, profile),
        "host": features.host_stall_s,
    }
    step_s = sum(terms.values())
    tokens_per_s = job.tokens_per_step / step_s
    peak = cluster.devices * profile.peak_flops(job.dtype)
    memory = memory_per_device(job, layout, features, on_cpu=profile.host_cores > 0)
    return StepEstimate(
        terms, tokens_per_s, tokens_per_s * flops_per_token(model, job.seq_len) / peak, memory, m
    )


def _tp_exposed_seconds(
    job: Job,
    layout: Layout,
    profile: HardwareProfile,
    features: Features,
    block: BlockTime,
    moe: MoEWork | None,
) -> float:
    """Model-parallel collective seconds of one block a micro-batch on the critical path (none where the
    profile's host times hold them): Megatron's, or sequence-parallel attention's and an MoE layer's."""
    if layout.tp == 1 or profile.tp_comm_measured:
        return 0.0
    if moe is None and layout.attention == "tp":
        return _megatron_tp_exposed_seconds(job, layout, profile, features, block.gemm_s)
    payload = layout.micro_batch * layout.local_seq_len(job) * job.model.dim * job.precision.activation_bytes
    gather_s = gather_or_scatter_seconds(
        payload, layout.tp, profile, group_spans_nodes(1, layout.tp, profile.devices_per_node)
    )
    if layout.attention == "sp":
        attention_s = _sequence_parallel_attention_seconds(job, layout, profile)
        if features.tp_overlap:  # the exchanges fused into the projections' GEMMs (MegaScale-MoE §4)
            linear_s = attention_linear_seconds(job, layout, profile)
            attention_s = attention_s / TP_OVERLAP_CHUNKS + max(0.0, attention_s - linear_s)
    else:  # Megatron's collectives around a column/row-parallel pair, not fused in a serial block
        attention_s = pair_collectives(job, layout) * gather_s
    if moe is None or layout.moe_tp == "ep":
        return attention_s  # the MLP runs on the rank's share of the sequence, or its experts' slots
    if layout.moe_tp == "whole":  # the whole sequence gathered forward, its gradient scattered backward
        return attention_s + (1 + layout.forward_passes(job)) * gather_s
    mlp_s = pair_collectives(job, layout) * gather_s  # "split": the dense MLP's pair around the experts
    if features.tp_overlap:
        mlp_s = mlp_s / TP_OVERLAP_CHUNKS + max(0.0, mlp_s - moe.gemm_s)
    return attention_s + mlp_s


def _megatron_tp_exposed_seconds(
    job: Job, layout: Layout, profile: HardwareProfile, features: Features, gemm_s: float
) -> float:
    """A dense block under Megatron's tensor and sequence parallelism."""
    # A serial block has two column/row-parallel pairs, a parallel block (PTB) one.
    groups = 1 if job.model.block == "parallel" else 2
    collectives = groups * pair_collectives(job, layout)
    payload = layout.micro_batch * layout.local_seq_len(job) * job.model.dim * job.precision.activation_bytes
    cross = group_spans_nodes(1, layout.tp, profile.devices_per_node)
    collective_s = gather_or_scatter_seconds(payload, layout.tp, profile, cross)
    comm_s = collectives * collective_s
    if not features.tp_overlap:
        if features.tp_backward_overlap:
            comm_s -= _column_backward_hidden_seconds(job, layout, profile, collective_s)
        return comm_s
    # A serial block fuses only the MLP's pair (paper §3.2), unless the attention's projections are fused
    # too (Megatron-Core's overlap of every tensor-parallel GEMM with its collective).
    serial_too = features.tp_overlap_attention
    fused_share = 1.0 if job.model.block == "parallel" or serial_too else 0.5
    fused_s = fused_share * comm_s
    exposed_fused_s = fused_s / TP_OVERLAP_CHUNKS + max(0.0, fused_s - fused_share * gemm_s)
    return comm_s - fused_s + exposed_fused_s


def _column_backward_hidden_seconds(
    job: Job, layout: Layout, profile: HardwareProfile, collective_s: float
) -> float:
    """What Megatron-LM's column-parallel backward hides of a block's collectives (`tp_backward_overlap`): two
    of `collective_s` a column-parallel layer, as far as its gradient GEMM lasts."""
    model = job.model
    tokens = layout.micro_batch * layout.local_seq_len(job)
    attention_in = attention_shapes(model, layout.tp)[:3]
    mlp_in = mlp_shapes(model, layout.tp)[:-1]
    pairs = [attention_in + mlp_in] if model.block == "parallel" else [attention_in, mlp_in]
    hidden_s = 0.0
    for shapes in pairs:
        gemm_s = sum(gemm_seconds(tokens, n_in, n_out, profile, job.linear_dtype) for n_in, n_out in shapes)
        if layout.sequence_parallel:
            hidden_s += 2 * min(collective_s, gemm_s)
        else:
            hidden_s += min(2 * collective_s, gemm_s)
    return hidden_s


def pair_collectives(job: Job, layout: Layout) -> float:
    """All-gathers and reduce-scatters (an all-reduce counts as one of each) around one
    column-parallel/row-parallel pair per micro-batch, forward + backward: 5 with sequence parallelism (the
    input gathered forward and again backward, its gradient reduce-scattered; the output reduce-scattered
    forward, its gradient gathered), 4 without (an all-reduce each way); full recomputation repeats the
    forward's."""
    forward = 2
    backward = 3 if layout.sequence_parallel else 2
    return forward * layout.forward_passes(job) + backward


def _sequence_parallel_attention_seconds(job: Job, layout: Layout, profile: HardwareProfile) -> float:
    """DeepSpeed-Ulysses' all-to-alls of q, k, v and the output around the attention core."""
    model = job.model
    head_dim = head_dim_of(model)
    tokens = layout.micro_batch * layout.local_seq_len(job) / layout.tp
    nbytes = job.precision.activation_bytes
    qkv = tokens * (model.attention.n_heads + 2 * model.attention.n_kv_heads) * head_dim * nbytes
    out = tokens * model.attention.n_heads * head_dim * nbytes
    passes = layout.forward_passes(job) + 1  # and the backward
    return passes * sum(all_to_all_seconds(payload, layout.tp, 1, profile) for payload in (qkv, out))


def _pp_seconds(job: Job, layout: Layout, profile: HardwareProfile, features: Features) -> float:
    """Blocking p2p seconds per micro-batch on a stage, a receive/send pair per chunk each way: each tp rank
    sends its sequence shard, or its slice (Megatron-LM's scatter/gather, arXiv:2104.04473 §4.1)."""
    if layout.pp == 1:
        return 0.0
    shard = layout.tp if layout.sequence_parallel or features.pp_scatter_gather else 1
    tokens = layout.micro_batch * layout.local_seq_len(job)
    payload = tokens * job.model.dim * job.precision.activation_bytes / shard
    cross = group_spans_nodes(layout.tp * layout.fsdp_ranks, layout.pp, profile.devices_per_node)
    return 2 * layout.virtual_stages * send_seconds(payload, profile, cross)


def _pp_exposed_seconds(
    job: Job, layout: Layout, profile: HardwareProfile, features: Features, m: int, forward_s: float
) -> float:
    """Pipeline transfer seconds on the critical path, per micro-batch: blocking, one paired exchange with
    each neighbour a micro-batch's turn (Megatron-LM's 1F1B, replayed in test_blocking_pipeline.py);
    asynchronous, what the schedule's order waits for over the step (`_overlapped_pp_seconds`)."""
    transfers_s = _pp_seconds(job, layout, profile, features)
    if features.pp_overlap:
        return _overlapped_pp_seconds(layout, m, transfers_s, forward_s) / m
    if layout.pp == 2 and layout.virtual_stages == 1:
        return transfers_s / 2  # each stage has one neighbour: one paired exchange a micro-batch's turn
    return transfers_s


def _overlapped_pp_seconds(layout: Layout, m: int, transfers_s: float, forward_s: float) -> float:
    """Transfer seconds a step waits for with asynchronous sends and receives, given `transfers_s`, a
    micro-batch's 2 v transfers through a stage, and `forward_s`, its forward through the stage (the orders
    replayed in tests/plan/test_step.py): 1F1B's loop of p stages keeps 2 (p - 1)/p transfers of each
    micro-batch's turn exposed and 2 (p - 2) more in the fill and drain; interleaved, one micro-batch's way
    through the p v chunks and back, 2 (p v - 1), or 4 (p - 1) on a V; a transfer longer than a chunk's
    forward delays each later chunk's turn by the excess."""
    p, v = layout.pp, layout.virtual_stages
    transfer_s = transfers_s / (2 * v)
    if v == 1 and not layout.zero_bubble:
        return transfer_s * (2 * (p - 1) / p * m + 2 * (p - 2))
    path = 2 * (p * v - 1) - (2 if layout.zero_bubble else 0)  # a V's turn stays on its rank
    excess_s = max(0.0, transfer_s - forward_s / v)
    return path * transfer_s + m * (v - 1) * excess_s


def _bubble_micro_batches(layout: Layout) -> float:
    """The fill and drain in micro-batch times: (pp - 1)/v, (pp - 1)/3v on a zero-bubble V."""
    if layout.zero_bubble:
        return (layout.pp - 1) / (3 * layout.virtual_stages)
    return (layout.pp - 1) / layout.virtual_stages


def _core_sharing(cluster: Cluster, profile: HardwareProfile) -> float:
    """How many processes take turns on each core of a host (1 when devices compute on their own)."""
    if not profile.host_cores:
        return 1.0
    return max(1.0, min(cluster.devices, profile.devices_per_node) / profile.host_cores)


def _core_sharing_seconds(
    cluster: Cluster, profile: HardwareProfile, work_s: float, critical_path_s: float
) -> float:
    """What too few cores add to `critical_path_s` for `work_s` of each process's core time."""
    sharing = _core_sharing(cluster, profile)
    if sharing == 1.0:
        return 0.0
    return max(0.0, sharing * work_s - critical_path_s)


def _straggler_slowdown(cluster: Cluster, profile: HardwareProfile) -> float:
    hosts = max(1, cluster.devices // profile.devices_per_node)
    return 1 + cluster.straggler_slowdown * (1 - (1 - cluster.straggler_host_fraction) ** hosts)


def _dp_exposed_seconds(
    job: Job, layout: Layout, profile: HardwareProfile, features: Features, micro_batch_s: float
) -> float:
    """Data-parallel seconds per step on the critical path: each group's gradient reduce-scatter and weight
    all-gather(s), a collective per block and one for the rest, less what overlaps compute. Overlapped with
    a pipeline, the last chunk's reduce-scatter, 1/(2v) of it (MegaScale §3.2); without one, one block's
    share behind the compute of a micro-batch (or of each, where synchronised every micro-batch). Under
    torch's pipelining schedules FSDP reduce-scatters once a step and ZeRO-3 gathers again for each
    backward."""
    precision = job.precision
    units = most_blocks(job, layout) + 1
    scatter_s = gather_s = 0.0  # one reduce-scatter of the gradients, one all-gather of the weights
    groups = stage_param_groups(job, layout)
    for group, weight_bytes in zip(groups, gathered_bytes(job, layout, groups)):
        if group.ranks == 1:
            continue
        scatter_s += units * group_gather_or_scatter_seconds(
            group.params * precision.grad_bytes / units, group.stride, group.ranks, profile
        )
        gather_s += units * group_gather_or_scatter_seconds(
            weight_bytes / units, group.stride, group.ranks, profile
        )
    zero3 = layout.zero_stage >= 3
    sync_s = scatter_s + gather_s * (2 if zero3 else 1)  # ZeRO-3 gathers the weights again for the backward
    m = layout.micro_batches(job)
    per_micro_batch = features.dp_sync_per_micro_batch and layout.zero_stage >= 2  # ZeRO-1: once a step
    if per_micro_batch and layout.pp > 1:
        total_s = scatter_s + gather_s * (m + 1 if zero3 else 1)
    else:
        total_s = sync_s * (m if per_micro_batch else 1)
    overlapped = features.dp_overlap and (layout.pp == 1 or features.dp_overlap_pipelined)
    if not overlapped or not total_s:
        return total_s
    if layout.pp > 1:
        return max(total_s / (2 * layout.virtual_stages), total_s - m * micro_batch_s)
    if per_micro_batch:
        return m * max(sync_s / units, sync_s - micro_batch_s)
    return max(sync_s / units, sync_s - micro_batch_s)


def _optimizer_seconds(job: Job, layout: Layout, profile: HardwareProfile) -> float:
    """The update as memory traffic (Adam is bandwidth-bound) over what the device owns and holds, and on a
    CPU the measured host time per block."""
    precision = job.precision
    groups = stage_param_groups(job, layout)
    owned = sum(group.params / (group.ranks if layout.zero_stage >= 1 else 1) for group in groups)
    held_grads = sum(group.params / (group.ranks if layout.zero_stage >= 2 else 1) for group in groups)
    update_bytes = owned * (precision.grad_bytes + 2 * precision.optimizer_bytes + precision.weight_bytes)
    grad_bytes = held_grads * 2 * precision.grad_bytes
    per_block_s = profile.update_layer_overhead_s
    per_block_s += profile.tp_update_layer_overhead_s if layout.tp > 1 else 0.0
    per_block_s += profile.dp_update_layer_overhead_s if layout.fsdp_ranks > 1 else 0.0
    rest_s = profile.update_model_overhead_s
    rest_s += profile.tp_update_model_overhead_s if layout.tp > 1 else 0.0
    rest_s += profile.dp_update_model_overhead_s if layout.fsdp_ranks > 1 else 0.0
    host_s = most_blocks(job, layout) * per_block_s + rest_s
    return (update_bytes + grad_bytes) / profile.hbm_bytes_per_s + host_s
