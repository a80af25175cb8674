"""Parallel-strategy search: every legal layout of a job on a cluster, kept if it fits, fastest first.

Over the choices megascale's config exposes (TP within a node, pipeline stages and chunks, context
parallelism for long sequences, micro-batch, ZeRO stage, recomputation), as far as the system has each
(`Features`); legal under the rules `ParallelDims` enforces, kept if its peak memory fits the device with
MEMORY_HEADROOM to spare. Every micro-batch dividing a replica's share of the batch, and every chunk
count down to one layer a chunk, is tried.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megascale.errors import ConfigError
from megascale.plan.context import context_problem
from megascale.plan.experts import is_moe, layout_problem
from megascale.plan.hardware import HardwareProfile
from megascale.plan.job import Cluster, Features, Job, Layout
from megascale.plan.step import StepEstimate, estimate_step

# The share of device memory a plan may use, the rest left to the allocator's fragmentation, the CUDA
# context and NCCL's buffers: vLLM's default for the same reason (--gpu-memory-utilization 0.9,
# https://docs.vllm.ai/en/latest/configuration/engine_args.html).
MEMORY_HEADROOM = 0.9
# Positions of each sequence a cp rank keeps, at least: the model leaves out what a ring step costs beyond
# its transfer and blocks (launches, merging each step's output), which short chunks feel; Llama 3 ran
# context parallelism at 131,072 over 16 ranks (8,192 each) and none at 8,192 (arXiv:2407.21783, Table 4).
MIN_CONTEXT_POSITIONS = 8192


@dataclass(frozen=True)
class Plan:
    layout: Layout
    estimate: StepEstimate

    @property
    def split(self) -> tuple[int | str, ...]:
        """How the plan divides the devices (degrees, and how an MoE layer uses the tp ranks)."""
        layout = self.layout
        return (layout.tp, layout.pp, layout.dp, layout.cp, layout.ep, layout.moe_tp, layout.attention)


def fastest_per_split(plans: list[Plan]) -> list[Plan]:
    """The fastest plan of each split of the devices, fastest first (`plans` sorted)."""
    seen: set[tuple[int | str, ...]] = set()
    fastest = []
    for plan in plans:
        if plan.split not in seen:
            seen.add(plan.split)
            fastest.append(plan)
    return fastest


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    job: Job,
    devices: int,
    profile: HardwareProfile,
    fixed: dict[str, int],
    recomputes: tuple[str, ...],
    features: Features | None = None,
) -> list[Layout]:
    """Every legal layout, `fixed` pinning some fields (e.g. {"tp": 8}); an MoE model's in each of the
    system's ways."""
    features = features or Features()
    sp = features.sequence_parallel
    layouts = []
    for tp, pp, cp, dp in _degrees(job, devices, profile, features):
        for micro_batch in divisors(job.global_batch // dp):
            micro_batches = job.global_batch // (dp * micro_batch)
            if pp > 1 and micro_batches < pp:
                continue
            for virtual_stages in _virtual_stage_choices(job.model.n_layers, pp, micro_batches, features):
                for zero_stage in features.zero_stages if dp * cp > 1 else (1,):
                    for recompute in recomputes:
                        base = Layout(
                            tp, pp, dp, virtual_stages, micro_batch, zero_stage, recompute, sp, cp=cp
                        )
                        for layout in _expert_layouts(job, base, features):
                            if all(getattr(layout, key) == value for key, value in fixed.items()):
                                layouts.append(layout)
    return layouts


def _degrees(
    job: Job, devices: int, profile: HardwareProfile, features: Features
) -> list[tuple[int, int, int, int]]:
    """(tp, pp, cp, dp) of every legal split: TP within a node dividing what it shards, stages the system can
    cut, the batch dividing over dp."""
    model = job.model
    shapes = (model.dim, model.attention.n_heads, model.attention.n_kv_heads, model.vocab_size)
    degrees = []
    for tp in divisors(devices) if features.model_parallel else [1]:
        if tp > profile.devices_per_node or any(size % tp for size in shapes):
            continue
        for pp in divisors(devices // tp) if features.model_parallel else [1]:
            for cp in _context_choices(job, devices // (tp * pp), features):
                dp = devices // (tp * pp * cp)
                if _stages_fit(model.n_layers, pp, features) and job.global_batch % dp == 0:
                    degrees.append((tp, pp, cp, dp))
    return degrees


def _context_choices(job: Job, ranks: int, features: Features) -> list[int]:
    """Context-parallel degrees: powers of two dividing the ranks whose 2 x cp chunks split the sequence, each
    keeping MIN_CONTEXT_POSITIONS."""
    if not features.model_parallel:
        return [1]
    choices, cp = [1], 2
    while ranks % cp == 0 and job.seq_len % (2 * cp) == 0 and job.seq_len // cp >= MIN_CONTEXT_POSITIONS:
        choices.append(cp)
        cp *= 2
    return choices


def _expert_layouts(job: Job, layout: Layout, features: Features) -> list[Layout]:
    """`layout` with each legal way of spreading the model's experts (itself for a dense model)."""
    if not is_moe(job.model):
        return [layout]
    chosen = []
    for moe_tp in features.moe_tp:
        if moe_tp == "ep" and layout.tp > 1:
            chosen += [
                dataclasses.replace(layout, moe_tp="ep", ep=layout.tp * k, attention=features.moe_attention)
                for k in divisors(layout.dp)
            ]
        elif moe_tp != "ep" or "whole" not in features.moe_tp:  # without tp, "ep" is "whole"
            base = "whole" if moe_tp == "ep" else moe_tp
            chosen += [dataclasses.replace(layout, moe_tp=base, ep=ep) for ep in divisors(layout.fsdp_ranks)]
    return [choice for choice in chosen if not (layout_problem(job, choice) or context_problem(job, choice))]


def _virtual_stage_choices(n_layers: int, pp: int, micro_batches: int, features: Features) -> list[int]:
    """Chunks per pipeline rank: 1, and where the system interleaves at this pp, the counts it can cut the
    layers into, the micro-batches a multiple of pp."""
    least = features.interleaved_min_pp
    if pp == 1 or least is None or pp < least or micro_batches % pp:
        return [1]
    return [1, *(v for v in range(2, n_layers // pp + 1) if _stages_fit(n_layers, pp * v, features))]


def _stages_fit(n_layers: int, stages: int, features: Features) -> bool:
    """Whether the system can cut the layers into `stages` stages: evenly, or at least one layer each."""
    return n_layers % stages == 0 or features.uneven_stages and stages <= n_layers


# What a pinned degree must satisfy, for the message that refuses one (the rules `_degrees` applies).
PINNED_RULES = {
    "tp": "TP divides the devices, the model's heads, KV heads, hidden size and vocabulary, within a node",
    "pp": "PP divides the devices TP leaves, cuts the layers into stages the system can run and gets at "
    "least pp micro-batches of the batch",
    "cp": "CP is a power of two dividing the data-parallel ranks, leaving each rank "
    f"{MIN_CONTEXT_POSITIONS:,} positions of a sequence at least",
}


def _pinned_problem(
    job: Job,
    devices: int,
    profile: HardwareProfile,
    fixed: dict[str, int],
    recomputes: tuple[str, ...],
    features: Features,
) -> str | None:
    """Why the pinned degrees leave no legal layout where the free devices have some; None where none is
    legal."""
    free = candidate_layouts(job, devices, profile, {}, recomputes, features)
    if not free:
        return None
    for key, value in fixed.items():
        legal = sorted({getattr(layout, key) for layout in free})
        if value not in legal:
            taken = ", ".join(str(degree) for degree in legal)
            return (
                f"--{key} {value} is not a degree {devices} devices can take for this job (these can: "
                f"{taken}): {PINNED_RULES.get(key, 'see docs/planning.md')}"
            )
    pinned = " ".join(f"--{key} {value}" for key, value in fixed.items())
    return f"{pinned}: each is legal alone but no layout of {devices} devices takes them together; unpin one"


def memory_limit_bytes(profile: HardwareProfile, devices: int) -> float:
    """What one device may use: its memory less headroom, or on a CPU its share of the host's."""
    sharing = min(devices, profile.devices_per_node) if profile.host_cores else 1
    return MEMORY_HEADROOM * profile.hbm_bytes / sharing


class NoLayoutFits(ConfigError):
    """Every legal layout needs more memory per device than the search allows."""


def search(
    job: Job,
    cluster: Cluster,
    profile: HardwareProfile,
    features: Features,
    fixed: dict[str, int] | None = None,
    skip_selective: bool = False,
) -> list[Plan]:
    """Layouts that fit, fastest first, recomputing as the system can (`skip_selective`: not selective, the
    same as none beside fused attention). Raises ConfigError when none is legal, NoLayoutFits when none
    fits."""
    recomputes = tuple(r for r in features.recomputes if not (skip_selective and r == "selective"))
    layouts = candidate_layouts(job, cluster.devices, profile, fixed or {}, recomputes, features)
    if not layouts:
        pinned = "".join(f" --{key} {value}" for key, value in (fixed or {}).items())
        if fixed and (problem := _pinned_problem(job, cluster.devices, profile, fixed, recomputes, features)):
            raise ConfigError(f"plan: {problem}")
        raise ConfigError(
            f"plan: no legal layout of {cluster.devices} devices for batch {job.global_batch}{pinned}: "
            "the batch "
            "must divide over data parallelism and give every pipeline at least pp micro-batches; try a "
            "--batch that is a multiple of --devices, or unpin --tp/--pp"
        )
    limit_bytes = memory_limit_bytes(profile, cluster.devices)
    plans, smallest = [], None
    for layout in layouts:
        estimate = estimate_step(job, layout, features, profile, cluster)
        if estimate.memory.total_bytes <= limit_bytes:
            plans.append(Plan(layout, estimate))
        elif smallest is None or estimate.memory.total_bytes < smallest.estimate.memory.total_bytes:
            smallest = Plan(layout, estimate)
    if not plans:
        assert smallest is not None  # every layout (there is one at least) was too big
        memory = smallest.estimate.memory
        state_bytes = memory.total_bytes - memory.activations_bytes
        fix = "use more --devices" if state_bytes > limit_bytes else "use more --devices or a smaller --batch"
        raise NoLayoutFits(
            f"plan: no layout fits {limit_bytes / 1e9:.1f} GB per device ({profile.name}); the smallest, "
            f"{smallest.layout.describe()}, needs "
            f"{memory.total_bytes / 1e9:.1f} GB ({state_bytes / 1e9:.1f} GB of it weights, gradients and "
            f"optimizer state): {fix}"
        )
    return sorted(plans, key=lambda plan: plan.estimate.step_s)
