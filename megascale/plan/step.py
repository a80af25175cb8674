"""The analytical model of one training step: seconds by term, tokens/s, MFU and memory (paper §2, §3).

A step is the pipeline's work plus what the schedule cannot hide:

    step = straggler * (m + bubble) * t_mb + overlapped PP + core sharing + exposed DP
           + sharing * optimizer + host
    t_mb = blocks_per_stage * (block + exposed TP/SP + exposed CP ring) [+ output layer on the last stage]
           [+ blocking PP p2p]

t_mb is one micro-batch through the slowest stage (forward and backward). The bubble is (pp - 1) micro-
batch times for 1F1B, (pp - 1)/v for interleaved 1F1B with v chunks per rank (Narayanan et al. 2021) and
(pp - 1)/3v for the zero-bubble V schedules (Qi et al. 2024).
What each overlap of paper §3.2 hides:
- TP/SP: the all-gather fused into the column-parallel GEMM and the reduce-scatter into the row-parallel
  one (Fig. 3) hide all but the first of TP_OVERLAP_CHUNKS chunks, as far as the GEMMs last; with a serial
  block only the MLP's pair is fused, half the traffic. Without that fusion, Megatron-LM's column-parallel
  backward still runs two collectives of each pair beside its gradient GEMMs (`tp_backward_overlap`).
- CP: the ring's keys and values (and their gradients) sent while each ring step's attention blocks
  compute hide as far as the blocks last (`megascale.plan.context`).
- PP: decoupled, asynchronous sends and receives leave only the transfers on the schedule's critical
  path exposed (`_overlapped_pp_seconds`); without them every transfer of a micro-batch is waited for.
- DP: per-chunk all-gathers before each chunk's forward and reduce-scatters after its backward leave only
  the last chunk's reduce-scatter, 1/(2v) of the traffic, exposed (the first all-gather overlaps data
  loading) -- as long as the compute is long enough to cover the rest; without a pipeline, block by
  block behind one micro-batch's compute (`_dp_exposed_seconds`). Some systems overlap only without a
  pipeline (`dp_overlap_pipelined`).
Stragglers: synchronous training runs at the pace of its slowest host. With a fraction f of hosts slower by
d (the cluster's: paper §5.1 saw about 0.5% of hosts, §6.3 about 10% slower), a job on n hosts computes
at 1 + d * (1 - (1 - f)^n) times the healthy pace in expectation.
Core sharing (a CPU host running more processes than it has cores): the cores are work-conserving -- a
stage idle in the bubble or waiting for a transfer leaves its core to the others -- so the pipeline takes
the longer of its critical path and all its processes' core time over the cores; the update after it runs
on every process at once, slowed by the full sharing factor.
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
from megascale.plan.experts import (
    MoEWork,
    exposed_all_to_all_seconds,
    layout_problem,
    moe_layers,
    moe_work,
)
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
        moe = moe_work(job, layout, profile, _gemm(job, profile))
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


def _gemm(job: Job, profile: HardwareProfile) -> Callable[[float, float, float], float]:
    return lambda m, k, n: gemm_seconds(m, k, n, profile, job.dtype)


def _tp_exposed_seconds(
    job: Job,
    layout: Layout,
    profile: HardwareProfile,
    features: Features,
    block: BlockTime,
    moe: MoEWork | None,
) -> float:
    """Model-parallel collective seconds of one block per micro-batch (forward + backward) that stay on
    the critical path (none apart from the host times when the profile measured them with the
    communication in). A dense block with head-split attention is Megatron's case below; sequence-
    parallel attention and MoE layers have their own exchanges (the all-to-alls of expert parallelism are
    counted apart, in `ep_exposed`)."""
    if layout.tp == 1 or profile.tp_comm_measured:
        return 0.0
    if moe is None and layout.attention == "tp":
        return _megatron_tp_exposed_seconds(job, layout, profile, features, block.gemm_s)
    recomputed = layout.recomputed_share(job)
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
        return attention_s + (2 + recomputed) * gather_s
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
    """What Megatron-LM's column-parallel backward hides of a block's tensor-parallel collectives, per
    micro-batch (`Features.tp_backward_overlap`). Without sequence parallelism it all-reduces the input
    gradient while the weight gradient's GEMM runs; with it, it gathers the saved input shard again while
    the input gradient's GEMM runs and reduce-scatters that gradient while the weight gradient's does.
    Either way two of `collective_s`, each hidden as far as its GEMM lasts (as long as the layer's
    forward GEMM); a block's column-parallel layers are its q, k, v projections and its MLP's first (and
    gate) projection, one layer per column/row-parallel pair."""
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
    """All-gathers and reduce-scatters (an all-reduce counts as one of each) around one column-parallel/
    row-parallel pair per micro-batch, forward + backward. With sequence parallelism the column-parallel
    layer all-gathers its input forward, all-gathers it again and reduce-scatters its input gradient
    backward (the gathered input is not kept), and the row-parallel one reduce-scatters forward and
    all-gathers backward: 5. Without it (Megatron-LM before 2022) the input is kept whole: one all-reduce
    forward after the row-parallel layer and one backward before the column-parallel one: 4. Full
    recomputation runs the forward's collectives again, in the share of blocks that recompute."""
    forward = 2
    backward = 3 if layout.sequence_parallel else 2
    return forward * layout.forward_passes(job) + backward


def _sequence_parallel_attention_seconds(job: Job, layout: Layout, profile: HardwareProfile) -> float:
    """DeepSpeed-Ulysses' all-to-alls around the attention core, forward + backward (+ recomputation):
    each rank's share of the sequence's queries, keys and values sent to the ranks of their heads, and
    the attention's output back."""
    model = job.model
    head_dim = head_dim_of(model)
    tokens = layout.micro_batch * layout.local_seq_len(job) / layout.tp
    nbytes = job.precision.activation_bytes
    qkv = tokens * (model.attention.n_heads + 2 * model.attention.n_kv_heads) * head_dim * nbytes
    out = tokens * model.attention.n_heads * head_dim * nbytes
    passes = layout.forward_passes(job) + 1  # and the backward
    return passes * sum(all_to_all_seconds(payload, layout.tp, 1, profile) for payload in (qkv, out))


def _pp_seconds(job: Job, layout: Layout, profile: HardwareProfile, features: Features) -> float:
    """Blocking p2p seconds per micro-batch on a stage: a receive/send pair per chunk, forward and
    backward. Each tp rank sends its share of the activations: its sequence shard under sequence
    parallelism, else its slice of the replicated tensor (Megatron-LM's scatter/gather, SC'21 §4.1),
    which the receiving ranks all-gather over NVLink."""
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
    """Pipeline transfer seconds on the critical path, per micro-batch. Blocking, each micro-batch's turn
    through a stage waits for one exchange with each neighbour, each send beside the receive it waits for
    (two transfers, one where two stages have a neighbour each): Megatron-LM's blocking 1F1B, replayed,
    waits within three transfers a step of that, exactly at two stages (test_blocking_pipeline.py).
    With asynchronous sends and receives, what the schedule's order waits for over the step
    (`_overlapped_pp_seconds`, given a micro-batch's `forward_s` through the stage)."""
    transfers_s = _pp_seconds(job, layout, profile, features)
    if features.pp_overlap:
        return _overlapped_pp_seconds(layout, m, transfers_s, forward_s) / m
    if layout.pp == 2 and layout.virtual_stages == 1:
        return transfers_s / 2  # each stage has one neighbour: one paired exchange a micro-batch's turn
    return transfers_s


def _overlapped_pp_seconds(layout: Layout, m: int, transfers_s: float, forward_s: float) -> float:
    """Transfer seconds a step waits for when sends and receives are asynchronous, under the schedules'
    own orders (Megatron-LM's 1F1B and interleaved 1F1B, which torch's share, and torch's ZB-V and
    DualPipeV), given `transfers_s`, a micro-batch's 2 v transfers through a stage, and `forward_s`, its
    forward through the stage's chunks.

    Replaying the orders (each rank's actions in turn, each as soon as its input has arrived;
    tests/plan/test_step.py replays them): without interleaving (v = 1) the 1F1B loop of p stages and
    2 (p - 1) transfers, which the p micro-batches in flight go round, keeps 2 (p - 1)/p transfers of each
    micro-batch's turn exposed, and the fill and drain 2 (p - 2) more; exact when the micro-batches fill
    whole rounds of p, within two transfers otherwise. Interleaved, each rank runs 2 (p - 1 - rank)
    forwards ahead beyond its v - 1 rounds, a chunk's forward of slack for every transfer, so only one
    micro-batch's way through the p v chunks and back is waited for, in the fill and drain: 2 (p v - 1)
    transfers, 4 (p - 1) on a V, whose turn stays on a rank (DualPipeV's exactly; ZB-V's order within
    max(1, p - 3) transfers of it). A transfer longer than a chunk's forward delays each chunk's turn
    after the first of a micro-batch by the excess (interleaved 1F1B's replayed wait within a fifth for
    transfers up to two chunk forwards long: rare on GPUs, where a chunk computes for milliseconds)."""
    p, v = layout.pp, layout.virtual_stages
    transfer_s = transfers_s / (2 * v)
    if v == 1 and not layout.zero_bubble:
        return transfer_s * (2 * (p - 1) / p * m + 2 * (p - 2))
    path = 2 * (p * v - 1) - (2 if layout.zero_bubble else 0)  # a V's turn stays on its rank
    excess_s = max(0.0, transfer_s - forward_s / v)
    return path * transfer_s + m * (v - 1) * excess_s


def _bubble_micro_batches(layout: Layout) -> float:
    """Idle time of the pipeline's fill and drain, in micro-batch times. A zero-bubble V schedule leaves
    pp - 1 of the 3 v equal parts of a micro-batch (each chunk's forward, input and weight gradient) idle:
    torch's ZB-V and DualPipeV orders replayed with unit costs (bench/pipeline_bubble.py, 'counted')."""
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
    """What processes taking turns on too few cores add to the pipeline's `critical_path_s`, when each
    computes `work_s` of core time (waits for communication and idle bubbles take none).

    The cores run every process's work, and an idle stage (in the bubble, or waiting for a transfer)
    leaves its core to the others: the pipeline needs at least all processes' work over the cores, and
    at least its own critical path; whichever is longer."""
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
    """Data-parallel seconds per step on the critical path: the gradient reduce-scatter and the weight
    all-gather(s) of each data-parallel group (the routed experts have their own), one collective per block
    and one for the rest of the model, less what overlaps compute.

    Overlapped, a pipeline (pp > 1) leaves the last model chunk's reduce-scatter exposed, 1/(2v) of the
    traffic (paper §3.2). Without a pipeline, the collectives go block by block (FSDP's units, DDP's and
    Megatron's buckets), each behind the next block's compute, so one block's share stays exposed -- as
    long as the compute they can hide behind lasts: one micro-batch's forward and backward (gradients are
    reduced after the step's last micro-batch, weights gathered for its first), or, where they are synced
    every micro-batch (FSDP with ZeRO-2/3), each micro-batch's own. Under torch's pipelining schedules
    (megascale's trainer, torchtitan) FSDP reduce-scatters once a step, after the last micro-batch
    (`PipelineStage.perform_reduce_grad`), and keeps the weights gathered through each backward: ZeRO-3,
    resharding them after each forward, gathers them for the first forward and again for each
    micro-batch's backward; ZeRO-2 once."""
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
    """The update, as memory traffic (Adam's update is bandwidth-bound): each parameter this device owns
    (its shard under ZeRO) has its gradient read, its master weight and two moments read and written, and
    its low-precision weight written; every gradient it holds is zeroed and read once more for the
    gradient norm. On a host that dispatches every operator (a CPU) the norm, clipping and optimizer step
    cost measured host seconds per block held, more when the weights are DTensors (TP, FSDP)."""
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
