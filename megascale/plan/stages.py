"""The blocks each pipeline rank holds, cut as megascale's trainer cuts them (`megascale.layout`): in
equal counts, or balanced by parameters with the embedding and the output layer counted toward the first
and last stage (`parallel.pp_split`); a pipeline is priced by what its busiest rank holds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megascale.errors import ConfigError
from megascale.layout import split_layers, stage_ids_of
from megascale.models.flops import matmul_params_per_layer
from megascale.plan.job import Job, Layout


@dataclass(frozen=True)
class RankShare:
    """What one pipeline rank holds: its blocks over all its chunks, and whether the output layer."""

    blocks: int
    output: bool


@functools.cache
def _stage_sizes(layers: int, stages: int, first_extra: float, last_extra: float) -> tuple[int, ...]:
    return tuple(len(r) for r in split_layers([1.0] * layers, stages, first_extra, last_extra))


def rank_shares(job: Job, layout: Layout) -> list[RankShare]:
    """Each pipeline rank's share, in rank order."""
    model = job.model
    stages = layout.pp * layout.virtual_stages
    if stages > model.n_layers:
        raise ConfigError(
            f"plan: layout {layout.describe()}: {stages} pipeline stages for model.n_layers = "
            f"{model.n_layers}; each stage needs a layer"
        )
    extra = 0.0
    if layout.stage_split == "params":  # the embedding's and the output layer's weights, in blocks
        extra = model.vocab_size * model.dim / (matmul_params_per_layer(model) + 2 * model.dim)
    sizes = _stage_sizes(model.n_layers, stages, extra, extra)
    schedule = "zbv" if layout.zero_bubble else "1f1b"
    shares = []
    for rank in range(layout.pp):
        held = stage_ids_of(rank, layout.pp, layout.virtual_stages, schedule)
        shares.append(RankShare(sum(sizes[stage] for stage in held), stages - 1 in held))
    return shares


def busiest_rank(job: Job, layout: Layout, block_s: float, output_s: float) -> RankShare:
    """The rank whose micro-batch takes longest: the pipeline runs at its pace."""
    return max(rank_shares(job, layout), key=lambda share: share.blocks * block_s + share.output * output_s)


def most_blocks(job: Job, layout: Layout) -> int:
    """The most blocks any pipeline rank holds (what its memory must hold)."""
    return max(share.blocks for share in rank_shares(job, layout))
