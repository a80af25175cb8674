"""Expert load per expert-parallel rank: the routed token slots each rank's experts computed in a step.

With `parallel.ep = N` each MoE layer's routed experts are split in contiguous ranges over the N ranks of
an expert-parallel group: ep rank r holds experts [r E/N, (r+1) E/N) of every layer, and computes the
slots that its group's tokens routed to them. A rank whose experts are popular computes more on any
machine; the straggler detector (stragglers.py) and the report's per-ep-rank view need that load to tell
routing from a slow machine.

Every rank counts, per expert, the slots its own tokens routed in the step (`MoE.load`, before
`finish_step` sums the counts over the data-parallel ranks and clears them). Those slots are computed by
the members of its expert-parallel group, each its range of experts, so the rank adds its counts for each
member's range into that member's slot of a world-sized vector; the vector travels in the step's loss
all-reduce (`Trainer._job_mean`), which every rank already makes: no new collective, and every rank's
expert load arrives on rank 0 exactly as its experts took it, its pipeline stage's MoE layers and its own
group's tokens (not an average over the other expert-parallel groups, whose tokens route otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megascale.config import ModelConfig
from megascale.models.flops import expert_params, flops_per_token
from megascale.models.moe import MoE


def expert_slots_by_rank(
    layers: Sequence[MoE], ep_group: Sequence[int], world_size: int, device: torch.device
) -> torch.Tensor:
    """This rank's part of every rank's expert load this step, [world_size]: in the slot of each member of
    its expert-parallel group (`ep_group`, global ranks in ep order), the slots this rank's tokens routed to
    that member's experts, summed over this rank's MoE layers (none on a dense pipeline stage: zeros).
    Summed over all ranks, each rank's slot holds the slots its experts computed. Call it after the step's
    forwards and before `finish_step`, which sums the counts over the data-parallel ranks and clears them;
    local, no communication."""
    slots = torch.zeros(world_size, device=device)
    if layers:
        per_expert = torch.stack([layer.load for layer in layers]).sum(dim=0)
        slots[list(ep_group)] = per_expert.view(len(ep_group), -1).sum(dim=1).to(slots.dtype)
    return slots


def ep_rank_experts(experts: int, ep: int) -> list[list[int]]:
    """Each ep rank's first and last expert (of every MoE layer)."""
    per_rank = experts // ep
    return [[r * per_rank, (r + 1) * per_rank - 1] for r in range(ep)]


def ep_rank_load_over_mean(rank_expert_slots: Sequence[float], ep_of_rank: Sequence[int]) -> list[float]:
    """Each ep rank's routed slots over the mean of the ep ranks' (1.0 = even): its experts' loads summed
    over the MoE layers of every stage and over its replicas (the ranks with that ep index in the other
    expert-parallel groups and tensor-parallel ranks), which is their average up to a factor all ep ranks
    share."""
    ep = max(ep_of_rank) + 1
    slots = [0.0] * ep
    for rank_slots, ep_rank in zip(rank_expert_slots, ep_of_rank):
        slots[ep_rank] += rank_slots
    mean = sum(slots) / ep
    return [s / mean if mean > 0 else 1.0 for s in slots]


def routed_expert_share(cfg: ModelConfig, seq_len: int) -> float:
    """The routed experts' share of a token's training FLOPs (models/flops.py's accounting: 6 per weight
    per token, top_k experts of each MoE layer): the part of a rank's compute that grows with the slots its
    experts take, at an even load. A lower bound on CPU, where gathering and scattering the slots also grows
    with them."""
    moe = cfg.moe
    if not moe.experts:
        return 0.0
    routed = 6 * (cfg.n_layers - moe.dense_layers) * moe.top_k * expert_params(cfg)
    return routed / flops_per_token(cfg, seq_len)
