"""Context parallelism (parallel/context.py) against one process: the ring attention's output and the
gradients of every rank's queries, keys and values, for causal and sliding-window attention with grouped kv
heads, over 2 and 4 ranks; and a model's loss and every gradient in cp layouts with dp and tp, dense and
MoE (with capacity, the balancing loss and expert parallelism). Whole training runs with cp are rows of the
parity matrix."""

import copy

import pytest
import torch
import torch.distributed as dist

from megascale.config import load_config
from megascale.models.attention import causal_attention
from megascale.models.llama import Attention, Transformer
from megascale.models.moe import MoE, training_step
from megascale.parallel.context import RingAttention, chunk_positions, ring_attention, shard_sequence
from megascale.parallel.dims import ParallelDims
from megascale.parallel.parallelize import parallelize
from megascale.parallel.tensor import full_tensor
from megascale.trainer import next_token_loss
from tests.conftest import TINY
from tests.parallel.multiprocess import run_ranks

BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 32, 8


def test_the_ranks_chunks_cover_the_sequence_once_each_rank_a_front_and_its_mirrored_back_chunk():
    cp = 4
    held = [chunk_positions(SEQ, cp, rank) for rank in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(SEQ))
    assert held[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    # Causal work (keys at or before each query) is the same on every rank.
    assert len({int((positions + 1).sum()) for positions in held}) == 1


def _inputs():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator)
    k = torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, generator=generator)
    v = torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, generator=generator)
    upstream = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator)
    return q, k, v, upstream


def _ring_against_whole(rank: int, world: int, window: int | None, overlap: bool = True) -> float:
    q, k, v, upstream = _inputs()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = causal_attention(*whole, window)
    (expected * upstream).sum().backward()

    mine = [shard_sequence(t, world, rank, dim=2).requires_grad_() for t in (q, k, v)]
    got = ring_attention(*mine, dist.group.WORLD, window, overlap)
    (got * shard_sequence(upstream, world, rank, dim=2)).sum().backward()
    differences = [(got - shard_sequence(expected, world, rank, dim=2)).abs().max()]
    for local, full in zip(mine, whole):
        assert local.grad is not None and full.grad is not None
        differences.append((local.grad - shard_sequence(full.grad, world, rank, dim=2)).abs().max())
    return float(max(differences))


@pytest.mark.parametrize(
    "world, window, overlap",
    [(2, None, True), (4, None, True), (4, None, False), (2, 5, True), (4, 3, True), (4, 20, True)],
    ids=["cp2", "cp4", "cp4-no-overlap", "cp2-window5", "cp4-window3", "cp4-window20"],
)
def test_ring_attention_gives_the_whole_sequences_output_and_gradients(world, window, overlap):
    for difference in run_ranks(_ring_against_whole, world, window, overlap, timeout_s=120):
        assert difference < 1e-5


def _backward_transfers(rank: int, world: int, overlap: bool) -> str:
    """The ring backward's transfers issued (I) and waited for (W) on this rank, and its runs of blocks
    (B), in order."""
    from megascale.parallel import context

    q, k, v, upstream = _inputs()
    mine = [shard_sequence(t, world, rank, dim=2).requires_grad_() for t in (q, k, v)]
    got = ring_attention(*mine, dist.group.WORLD, None, overlap)
    events: list[str] = []
    functions = context._issue, context._wait, context._scores

    def recording(letter, function):
        def recorded(*args, **kwargs):
            if not events or letter != "B" or events[-1] != "B":
                events.append(letter)
            return function(*args, **kwargs)

        return recorded

    context._issue, context._wait, context._scores = map(recording, "IWB", functions)
    try:
        (got * shard_sequence(upstream, world, rank, dim=2)).sum().backward()
    finally:
        context._issue, context._wait, context._scores = functions
    return "".join(events)


@pytest.mark.parametrize(
    "world, overlap, expected",
    [
        # Each step but the last sends the next keys and values (I) before its blocks (B); from the
        # second step on, the gradients the ranks before summed are waited for (W) after the blocks.
        (2, True, "IBIW" + "BWIW"),
        (4, True, "IBIW" + "IBWIW" * 2 + "BWIW"),
        # Without overlap every transfer is waited for between the steps.
        (2, False, "BIIW" + "WBIW"),
    ],
    ids=["cp2", "cp4", "cp2-no-overlap"],
)
def test_the_ring_backward_receives_the_key_gradients_behind_the_next_steps_blocks(world, overlap, expected):
    for events in run_ranks(_backward_transfers, world, overlap, timeout_s=120):
        assert events == expected


def _gradients_against_one_process(rank: int, world: int, overrides: list[str]) -> float:
    cfg = load_config(None, [*TINY, *overrides])  # the suite's tiny model, 4 sequences in 2 micro-batches
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    reference = copy.deepcopy(model)
    dims = ParallelDims.from_config(cfg, world)
    dims.build_mesh("cpu")
    stepped = parallelize(model, dims, cfg.parallel, device=torch.device("cpu"), microbatches=2)
    assert all(isinstance(m.core, RingAttention) for m in model.modules() if isinstance(m, Attention))
    tokens = torch.randint(257, (4, 33), generator=torch.Generator().manual_seed(1))
    share = tokens.chunk(dims.dp)[dims.dp_rank()]
    batches = [(chunk[:, :-1], chunk[:, 1:]) for chunk in share.chunk(2)]
    loss = full_tensor(stepped.forward_backward(batches, next_token_loss))
    dist.all_reduce(loss)  # each rank's mean over its tokens (the same on tp ranks): a mean over ranks
    with training_step():  # the balancing loss of an MoE model weighs in, as in forward_backward
        expected = next_token_loss(reference(tokens[:, :-1]), tokens[:, 1:])
        expected.backward()
    differences = [abs(float(loss) / world - float(expected))]
    # Dropped token slots (capacity): the ranks' sum, each tp rank routing the same tokens, is one process's.
    layers = [layer for layer in model.modules() if isinstance(layer, MoE)]
    if layers:
        dropped = torch.stack([layer.dropped for layer in layers]).sum()
        dist.all_reduce(dropped)
        kept = sum(float(layer.dropped) for layer in reference.modules() if isinstance(layer, MoE))
        differences.append(abs(float(dropped) / dims.tp - kept))
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert got.grad is not None and want.grad is not None, name
        differences.append(float((full_tensor(got.grad) - want.grad).abs().max()))
    return max(differences)


@pytest.mark.parametrize(
    "world, overrides",
    [
        (2, ["--parallel.cp=2"]),
        (4, ["--parallel.cp=2", "--parallel.dp_replicate=2"]),  # two batches, each over a ring of 2
        (4, ["--parallel.cp=4", "--model.attention.window=6"]),  # a window across the chunks' borders
        (4, ["--parallel.cp=2", "--parallel.tp=2"]),  # heads split over tp, the sequence over cp
        (4, ["--parallel.cp=2", "--parallel.tp=2", "--parallel.sequence_parallel=false"]),
    ],
    ids=["cp2", "cp2-x-dp2", "cp4-window", "cp2-x-tp2", "cp2-x-tp2-no-sp"],
)
def test_context_parallel_gives_one_process_loss_and_gradients(world, overrides):
    for difference in run_ranks(_gradients_against_one_process, world, overrides, timeout_s=180):
        assert difference < 1e-5


MOE = ["--model.moe.experts=4", "--model.moe.top_k=2", "--model.moe.aux_loss_coeff=0.1"]
CAPACITY = ["--model.moe.capacity_factor=1.0"]  # drops slots: which depends on the whole sequence's order


@pytest.mark.parametrize(
    "world, overrides",
    [
        (2, ["--parallel.cp=2", *CAPACITY]),
        (4, ["--parallel.cp=4", *CAPACITY, "--model.moe.score=sigmoid"]),
        (2, ["--parallel.cp=2", "--parallel.ep=2", *CAPACITY]),  # the ring's ranks hold different experts
        (4, ["--parallel.cp=2", "--parallel.tp=2"]),  # the MoE layer whole on each tp rank
    ],
    ids=["cp2-capacity", "cp4-capacity-sigmoid", "cp2-x-ep2", "cp2-x-tp2"],
)
def test_context_parallel_moe_gives_one_process_loss_gradients_and_drops(world, overrides):
    for difference in run_ranks(_gradients_against_one_process, world, [*MOE, *overrides], timeout_s=180):
        assert difference < 1e-5
