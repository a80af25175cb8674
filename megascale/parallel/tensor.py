"""Tensor + sequence parallelism (Megatron-style) applied to a model from its declared plan, with DTensor.

Column-wise q/k/v/gate/up and row-wise o/down linears split every block's matmuls over the TP ranks;
with sequence parallelism the residual stream, norms and dropout live on sequence shards between them, so
the all-reduce of plain TP becomes an all-gather before each column-parallel input and a reduce-scatter
after each row-parallel output (paper §3.2, Fig. 3a). The embedding and the output layer are split over
the vocabulary and the loss is computed on vocabulary shards (`loss_parallel`). DTensor's parallel styles
do all of this; what this module adds is the mapping from the model's plain-words plan (models/sharding.py)
to those styles, so neither side names the other.

A block with an MoE feed-forward layer takes the routed plan: its attention as in any block, and the MoE
layer computed whole on every TP rank on the whole sequence (gathered under sequence parallelism, and its
output cut back to the rank's shard), so routing, capacity and the balancing loss see whole sequences as
on one process. The TP ranks repeat the layer's work rather than split it; its experts can be split over
data-parallel ranks instead (expert.py). With parallel.moe_tp = "ep" (MegaScale-MoE's layout) the routed
block plan has each TP rank route its own part of the sequence (the stream's shard under sequence
parallelism, else a cut of the whole stream, gathered again after the layer) and send its slots to the
experts' ranks, which include the TP ranks (expert.py); the router and the shared experts are replicated,
each rank computing its own tokens, their gradients summed over the TP ranks by DTensor. The layer's
per-sequence counts (capacity, balancing loss) are exchanged over the TP group (`SequenceShards`).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from megascale.models.moe import MoE, WholeSequences
from megascale.parallel.tensor_overlap import ChunkedSequenceParallelAttention, ChunkedSequenceParallelMLP


def _style(word: str, sequence_parallel: bool, module: nn.Module, overlap_chunks: int | None):
    """The DTensor parallel style for one plan word, or None when the word needs nothing without SP."""
    stream = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    if word in ("position_wise_mlp", "projected_mixer"):
        if sequence_parallel and overlap_chunks is not None:
            if word == "position_wise_mlp":
                return ChunkedSequenceParallelMLP(overlap_chunks)
            return ChunkedSequenceParallelAttention(overlap_chunks)
        word = "gather_sequence"
    if word == "colwise":
        return ColwiseParallel()
    if word == "rowwise":
        return RowwiseParallel(output_layouts=stream)
    if word == "sequence":
        return SequenceParallel() if sequence_parallel else None
    if word == "whole_sequence":
        if not sequence_parallel:
            return None  # the stream is whole on every rank already
        return PrepareModuleInputOutput(
            input_layouts=Shard(1),
            desired_input_layouts=Replicate(),
            use_local_input=True,
            output_layouts=Replicate(),
            desired_output_layouts=Shard(1),
        )
    if word == "own_tokens":
        # The rank's part of the stream in and out: its shard, or, with the stream whole on every rank,
        # a cut of it whose outputs are gathered back.
        return PrepareModuleInputOutput(
            input_layouts=stream,
            desired_input_layouts=Shard(1),
            use_local_input=True,
            output_layouts=Shard(1),
            desired_output_layouts=stream,
        )
    if word == "replicated":
        # Its inputs are each rank's own tokens (dimension 0 names them for DTensor, whatever they are).
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    if word == "gather_sequence":
        if not sequence_parallel:
            return None
        # Only the first argument (the hidden states) is gathered; the rest (e.g. RoPE tables) pass as-is.
        others = (None,) * (len(inspect.signature(module.forward).parameters) - 1)
        return PrepareModuleInput(
            input_layouts=(Shard(1), *others), desired_input_layouts=(Replicate(), *others)
        )
    if word == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if word == "vocab_output":
        return ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
    raise ValueError(f"unknown tensor-parallel plan word {word!r}")


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    """None for submodules a pipeline stage dropped or a block type lacks (the parallel block's ffn_norm)."""
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def _plan_for(
    module: nn.Module, plan: dict[str, str], sequence_parallel: bool, overlap_chunks: int | None
) -> dict:
    styles = {}
    for name, word in plan.items():
        submodule = _submodule(module, name)
        style = _style(word, sequence_parallel, submodule, overlap_chunks) if submodule is not None else None
        if style is not None:
            styles[name] = style
    return styles


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    blocks: str,
    block_plan: dict[str, str],
    top_level_plan: dict[str, str],
    sequence_parallel: bool,
    overlap_chunks: int | None = None,
    routed_block_plan: dict[str, str] | None = None,
) -> None:
    """Shard `model` in place over `tp_mesh`. Collective over the TP group; every TP rank calls it with
    an identical model (same weights), whose tensors become DTensors holding this rank's shard. With
    `overlap_chunks` (and sequence parallelism) the MLPs and the attention projections overlap their
    communication in that many sequence chunks (tensor_overlap.py). Blocks holding an MoE layer take
    `routed_block_plan`."""
    tied = tied_parameters(model)
    for block in model.get_submodule(blocks).children():
        plan = block_plan
        if routed_block_plan is not None and any(isinstance(module, MoE) for module in block.modules()):
            plan = routed_block_plan
        parallelize_module(block, tp_mesh, _plan_for(block, plan, sequence_parallel, overlap_chunks))
        if plan.get("feed_forward") == "own_tokens":
            for module in block.modules():
                if isinstance(module, MoE):
                    module.sequences = SequenceShards(tp_mesh.get_group())
    parallelize_module(model, tp_mesh, _plan_for(model, top_level_plan, sequence_parallel, overlap_chunks))
    _tie_again(model, tied)


class SequenceShards(WholeSequences):
    """An MoE layer's view of sequences cut into the parts of a TP group's ranks, in rank order: counts
    over each part are summed (or summed before this rank's part) over the group."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.parts, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def total(self, counts: Tensor) -> Tensor:
        counts = counts.detach().clone()
        dist.all_reduce(counts, group=self.group)
        return counts

    def before(self, counts: Tensor) -> Tensor:
        parts = [torch.empty_like(counts) for _ in range(self.parts)]
        dist.all_gather(parts, counts.detach().contiguous(), group=self.group)
        return torch.stack(parts[: self.rank]).sum(0) if self.rank else torch.zeros_like(counts)


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """The fully-qualified names of each parameter that more than one module holds (tied embeddings)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _tie_again(model: nn.Module, tied: list[list[str]]) -> None:
    """Make tied parameters one again: each parallel style distributes its module's parameters into new
    DTensors, so a weight two modules shared (embedding and output layer) would become two, and train
    untied. The copies must hold the same shard (the vocabulary split of both is along dim 0)."""
    for first, *others in tied:
        kept = model.get_parameter(first)
        for name in others:
            copy = model.get_parameter(name)
            if getattr(copy, "placements", None) != getattr(kept, "placements", None):
                raise ValueError(
                    f"tensor parallelism shards the tied parameters {first} and {name} differently "
                    f"({getattr(kept, 'placements', None)} and {getattr(copy, 'placements', None)})"
                )
            owner, _, attribute = name.rpartition(".")
            model.get_submodule(owner).register_parameter(attribute, kept)


def loss_context(tensor_parallel: bool) -> contextlib.AbstractContextManager:
    """Where the loss must be computed: on vocabulary shards under TP (no gather of the logits)."""
    return loss_parallel() if tensor_parallel else contextlib.nullcontext()


def full_tensor(tensor: Tensor) -> Tensor:
    """A DTensor as the whole tensor it stands for (a collective if it is sharded or partial); any other
    tensor unchanged. Duck-typed, so callers need not know which they hold."""
    whole = getattr(tensor, "full_tensor", None)
    return whole() if whole is not None else tensor


def local_shard(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor (a view: writing it writes the DTensor); any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sharded_like(shard: Tensor, like: Tensor) -> Tensor:
    """`shard`, this rank's part of a tensor sharded as `like`, as a DTensor like `like` (no copy); `shard`
    itself where `like` is a plain tensor."""
    if not isinstance(like, DTensor):
        return shard
    mesh, placements = like.device_mesh, like.placements
    return DTensor.from_local(
        shard, mesh, placements, run_check=False, shape=like.shape, stride=like.stride()
    )
