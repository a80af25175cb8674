"""Bytes one device holds at its peak: weights, gradients and optimizer state by ZeRO stage, activations.

Training state follows ZeRO (Rajbhandari et al. 2020): stage 1 shards the optimizer state over data
parallelism, stage 2 the gradients too, stage 3 the weights too (paper §2: MegaScale uses stage 2).
Activations per block follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Eqs. 1-3): s*b*h*(34 + 5*a*s/h) bytes at 2-byte activations, sequence parallelism
dividing everything by t. The attention-score term 5*a*s/h is left out: every system modelled here runs
attention in a FlashAttention kernel (`megascale.plan.compute`), which keeps no scores. Full recomputation
keeps only each block's input. The pipeline's first stage
holds the most micro-batches in flight: pp of them under 1F1B, pp * (1 + (pp - 1)/(pp * v)) interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.models.flops import matmul_params_per_layer
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


def stage_params(job: Job, layout: Layout) -> float:
    """Parameters of the heaviest pipeline stage on one tensor-parallel rank (with the embedding or the
    output layer)."""
    model = job.model
    block = matmul_params_per_layer(model) + 2 * model.dim
    layers = model.n_layers / layout.pp
    vocab = model.vocab_size * model.dim
    if layout.pp == 1:
        return (layers * block + vocab * (1 if model.tie_embeddings else 2)) / layout.tp
    return (layers * block + vocab) / layout.tp


def activation_bytes_per_block(job: Job, layout: Layout) -> float:
    """Activations one block keeps for its backward, per micro-batch, on one device."""
    s, b, h, t = job.seq_len, layout.micro_batch, job.model.dim, layout.tp
    scale = job.precision.activation_bytes / 2  # the formula counts 2-byte activations
    if layout.recompute == "full":
        return s * b * h * 2 * scale / (t if layout.sequence_parallel else 1)
    if layout.sequence_parallel:
        return s * b * h * 34 / t * scale
    return s * b * h * (10 + 24 / t) * scale


def micro_batches_in_flight(job: Job, layout: Layout) -> float:
    """Micro-batches whose activations the first stage holds at once."""
    m = layout.micro_batches(job)
    if layout.pp == 1:
        return 1.0
    in_flight = float(layout.pp)
    if layout.virtual_stages > 1:
        in_flight *= 1 + (layout.pp - 1) / (layout.pp * layout.virtual_stages)
    return min(in_flight, m)


def memory_per_device(job: Job, layout: Layout) -> Memory:
    """Peak bytes on the busiest device."""
    precision, dp = job.precision, layout.dp
    params = stage_params(job, layout)
    weights = params * precision.weight_bytes / (dp if layout.zero_stage >= 3 else 1)
    grads = params * precision.grad_bytes / (dp if layout.zero_stage >= 2 else 1)
    optimizer = params * precision.optimizer_bytes / (dp if layout.zero_stage >= 1 else 1)
    blocks = job.model.n_layers / layout.pp
    activations = blocks * activation_bytes_per_block(job, layout)
    activations *= micro_batches_in_flight(job, layout)
    logits = 2 * 4 * layout.micro_batch * job.seq_len * job.model.vocab_size / layout.tp  # fp32, and its grad
    return Memory(weights, grads, optimizer, activations + logits)
