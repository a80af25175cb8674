"""Context parallelism's ring attention: its messages, what the attention hides of them, its buffers.

Each of the cp ranks of a ring holds 2 of the 2 x cp chunks of every sequence, so it computes 1/cp of
every token-wise operator and of the causal attention (`megascale.plan.compute`); per block and
micro-batch it sends cp - 1 messages of its keys and values forward (again under full recomputation) and
(cp - 1) + cp backward with their gradients, to the next rank, tp ranks away (`megascale.plan.placement`).
With the overlap each ring step's transfers run beside its attention blocks (docs/planning.md, "Context
parallelism").
"""

from __future__ import annotations

from megascale.config import head_dim_of
from megascale.plan.comm import group_spans_nodes, send_seconds
from megascale.plan.compute import attention_seconds
from megascale.plan.experts import is_moe
from megascale.plan.hardware import HardwareProfile
from megascale.plan.job import Features, Job, Layout

# Ring messages a rank holds at its peak, in the backward: the keys and values it holds and those arriving,
# and their gradients held and arriving, counted from megascale's ring (megascale/parallel/context.py,
# `_ring_backward`).
RING_BUFFERS = 4


def context_problem(job: Job, layout: Layout) -> str | None:
    """Why this layout's context parallelism cannot run (or is not modelled), or None."""
    if layout.cp < 1:
        return f"cp {layout.cp} must be >= 1"
    if layout.cp == 1:
        return None
    if job.seq_len % (2 * layout.cp):
        return f"sequence {job.seq_len} does not split into 2 x cp = {2 * layout.cp} equal chunks"
    if is_moe(job.model) and layout.experts_over_tp:
        return (
            "moe_tp 'ep' beside context parallelism: the tp ranks would route parts of each cp rank's chunks "
            "(megascale's trainer refuses it; use moe_tp 'whole')"
        )
    if layout.attention == "sp":
        return "context parallelism beside sequence-parallel attention is not modelled"
    return None


def ring_message_bytes(job: Job, layout: Layout) -> float:
    """One ring message: this rank's keys and values stacked, for its positions and kv heads."""
    model = job.model
    kv_heads = model.attention.n_kv_heads / layout.tp
    elements = 2 * layout.local_seq_len(job) * kv_heads * head_dim_of(model) * layout.micro_batch
    return elements * job.precision.activation_bytes


def ring_messages(job: Job, layout: Layout) -> float:
    """Messages a rank sends per block and micro-batch: cp - 1 forward (per forward pass), and backward cp - 1
    and their gradients' cp."""
    if layout.cp == 1:
        return 0
    return layout.forward_passes(job) * (layout.cp - 1) + (layout.cp - 1) + layout.cp


def ring_transfer_seconds(job: Job, layout: Layout, profile: HardwareProfile) -> float:
    """One message to the next rank of the ring: over NVLink inside a node, else one NIC per rank."""
    cross = group_spans_nodes(layout.tp, layout.cp, profile.devices_per_node)
    return send_seconds(ring_message_bytes(job, layout), profile, cross)


def exposed_ring_seconds(job: Job, layout: Layout, profile: HardwareProfile, features: Features) -> float:
    """The ring's seconds per block and micro-batch (forward + backward) on the critical path. Without the
    overlap, every message's. With it, per ring step whatever of the step's transfers outlasts its blocks
    (1/cp of the attention each): forward the keys and values, backward the keys and values and the
    gradients on one link, and the gradients' last hop home, which nothing hides."""
    if layout.cp == 1:
        return 0.0
    transfer_s = ring_transfer_seconds(job, layout, profile)
    if not features.cp_overlap:
        return ring_messages(job, layout) * transfer_s
    forward_s, backward_s = attention_seconds(job, layout, profile, features.attention)
    steps = layout.cp
    forward = (steps - 1) * max(0.0, transfer_s - forward_s / steps)
    backward = (steps - 1) * max(0.0, 2 * transfer_s - backward_s / steps) + transfer_s
    return layout.forward_passes(job) * forward + backward


def ring_buffer_bytes(job: Job, layout: Layout) -> float:
    """Bytes of ring messages a rank holds at once, beyond its own activations."""
    return RING_BUFFERS * ring_message_bytes(job, layout) if layout.cp > 1 else 0.0
