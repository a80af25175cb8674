"""Expert parallelism (parallel/expert.py) against one process: the same loss and the same gradient of
every parameter, experts included, for the same global batch; an expert that no token chooses and
uneven all-to-all splits included. Whole training runs with ep are rows of the parity matrix."""

import copy

import pytest
import torch

from megascale import config_space
from megascale.config import load_config
from megascale.models.llama import Transformer
from megascale.models.moe import MoE, training_step
from megascale.parallel.dims import ParallelDims
from megascale.parallel.expert import ExpertParallelExperts, _chunk_counts, _chunk_slots
from megascale.parallel.parallelize import parallelize
from megascale.parallel.tensor import full_tensor
from megascale.trainer import next_token_loss
from tests.parallel.multiprocess import run_ranks
from tests.parallel.parity_matrix import Matrix, refusal

MODEL = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.attention.n_heads=4",
    "--model.max_seq_len=16",
    "--data.seq_len=16",
    "--model.moe.experts=4",
    "--model.moe.aux_loss_coeff=0.01",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=2",
]
UNCHOSEN = 3  # the expert no token is routed to


def _model(cfg) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2)
    for layer in model.modules():
        if isinstance(layer, MoE):
            layer.router.expert_bias[UNCHOSEN] = -1e4
    return model


def _gradients_against_one_process(rank: int, world: int, overrides: list[str]) -> dict[str, float]:
    cfg = load_config(None, [*MODEL, *overrides])
    model = _model(cfg)
    reference = copy.deepcopy(model)
    dims = ParallelDims.from_config(cfg, world)
    dims.build_mesh("cpu")
    stepped = parallelize(model, dims, cfg.parallel, device=torch.device("cpu"), microbatches=2)
    tokens = torch.randint(257, (8, 17), generator=torch.Generator().manual_seed(1))
    share = tokens.chunk(dims.dp)[dims.dp_rank()]
    batches = [(chunk[:, :-1], chunk[:, 1:]) for chunk in share.chunk(2)]
    loss = stepped.forward_backward(batches, next_token_loss)
    loss = full_tensor(loss)
    torch.distributed.all_reduce(loss)

    with training_step():
        expected = next_token_loss(reference(tokens[:, :-1]), tokens[:, 1:])
    expected.backward()
    differences = {"loss": abs(float(loss) / dims.dp - float(expected))}
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert got.grad is not None, name
        differences[name] = float((full_tensor(got.grad) - want.grad).abs().max())
    experts = [m.experts for m in model.modules() if isinstance(m, MoE)]
    assert experts and all(isinstance(e, ExpertParallelExperts) for e in experts)
    return differences


@pytest.mark.parametrize(
    "world, overrides, tolerance",
    [
        (2, ["--parallel.ep=2"], 1e-5),  # experts split over both ranks, slots in two overlapped chunks
        (2, ["--parallel.ep=2", "--parallel.overlap.ep=false"], 1e-5),  # in one synchronous exchange
        (4, ["--parallel.ep=2"], 1e-5),  # experts also sharded by FSDP over the other two ranks
        (4, ["--parallel.ep=4", "--parallel.zero_stage=1"], 1e-5),  # one expert per rank, ZeRO-1
        (2, ["--parallel.ep=2", "--parallel.ep_comm_dtype=bfloat16"], 1e-3),  # bf16 payload: rounded
    ],
)
def test_expert_parallel_gives_one_process_loss_and_gradients(world, overrides, tolerance):
    for rank_differences in run_ranks(_gradients_against_one_process, world, overrides, timeout_s=180):
        worst = max(rank_differences.items(), key=lambda item: item[1])
        assert worst[1] < tolerance, worst
        if "--parallel.ep_comm_dtype=bfloat16" in overrides:  # the rounding is there, and small
            assert worst[1] > 1e-6, worst


def test_the_chunks_deal_each_experts_slots_evenly_and_cover_every_slot_once():
    counts = torch.tensor([5, 0, 2, 1])
    parts = _chunk_counts(counts, 2)
    assert [part.tolist() for part in parts] == [[3, 0, 1, 1], [2, 0, 1, 0]]
    positions = _chunk_slots(counts, 2)
    assert [where.tolist() for where in positions] == [[0, 1, 2, 5, 7], [3, 4, 6]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        {"parallel.dp_shard": 4, "parallel.ep": 2, "model.moe.capacity_factor": 1.0},  # experts FSDP over 2
        {"parallel.dp_shard": 4, "parallel.ep": 2, "parallel.zero_stage": 1, "model.moe.score": "sigmoid"},
    ],
    ids=["ep2-x-edp2-capacity", "ep2-x-edp2-zero1-bias"],
)
def test_training_with_experts_sharded_over_ep_and_edp_matches_one_process(layout, tiny_corpus, tmp_path):
    """The every-pair set's layouts have dp_shard 2, so edp 1: here the experts' FSDP over edp > 1 trains
    10 steps against one process (and resumes and exports), as the matrix's rows do."""
    row = {
        **config_space.default_row(),
        "model.moe.experts": 4,
        "model.moe.bias_update_rate": 0.001,
        **layout,
    }
    assert refusal(row) is None
    result = Matrix(tiny_corpus, tmp_path).run(0, row)
    assert result.status == "matched", result.message
