"""Expert parallelism (parallel/expert.py) against one process: the same loss and the same gradient of
every parameter, experts included, for the same global batch; an expert that no token chooses and
uneven all-to-all splits included. The fp8 payload's quantization against a rounding to the e4m3 grid
written from the format's definition, and its training against the float32 payload's. Whole training
runs with ep are rows of the parity matrix."""

import copy
import itertools

import pytest
import torch

from megascale.config import load_config
from megascale.models.llama import Transformer
from megascale.models.moe import MoE, training_step
from megascale.parallel.dims import ParallelDims
from megascale.parallel.expert import (
    FP8_BLOCK,
    ExpertParallelExperts,
    _chunk_counts,
    _chunk_slots,
    dequantize_fp8_rows,
    quantize_fp8_rows,
)
from megascale.parallel.parallelize import parallelize
from megascale.parallel.tensor import full_tensor
from megascale.trainer import next_token_loss
from tests.parallel import config_space
from tests.parallel.multiprocess import run_ranks
from tests.parallel.parity_matrix import TOLERANCES, Matrix, refusal

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
_OVER_TP = ["--parallel.tp=2", "--parallel.moe_tp=ep"]


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
    differences = {"loss": abs(float(loss) / world - float(expected))}  # the same on each tp rank
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
        # The experts over the tp ranks, each routing its part of the sequence (parallel.moe_tp = 'ep').
        (2, _OVER_TP, 1e-5),
        (2, [*_OVER_TP, "--model.moe.capacity_factor=1.0"], 1e-5),
        (2, [*_OVER_TP, "--parallel.sequence_parallel=false", "--model.moe.score=sigmoid"], 1e-5),
        (4, [*_OVER_TP, "--parallel.ep=2", "--model.moe.shared_experts=1"], 1e-5),  # ep 2 x tp 2
        (4, [*_OVER_TP, "--parallel.dp_shard=2", "--model.moe.capacity_factor=1.0"], 1e-5),  # edp 2
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
        {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.ep": 2},  # experts under HSDP
    ],
    ids=["ep2-x-edp2-capacity", "ep2-x-edp2-zero1-bias", "ep2-x-hsdp2"],
)
def test_training_with_experts_sharded_over_ep_and_edp_matches_one_process(layout, tiny_corpus, tmp_path):
    """The every-pair set's layouts have dp_shard 2, so edp 1: here the experts' FSDP over edp > 1, and
    their HSDP over replicas, train 10 steps against one process (and resume and export), as the
    matrix's rows do."""
    row = {
        **config_space.default_row(),
        "model.moe.experts": 4,
        "model.moe.bias_update_rate": 0.001,
        **layout,
    }
    assert refusal(row) is None
    result = Matrix(tiny_corpus, tmp_path).run(0, row)
    assert result.status == "matched", result.message


def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative float8 e4m3fn number, ascending, from the format's definition: 3 mantissa
    bits, exponent bias 7, subnormals below 2^-6, and no infinities (the top code, S.1111.111, is NaN)."""
    subnormal = [m / 8 * 2.0**-6 for m in range(8)]
    normal = [(1 + m / 8) * 2.0 ** (e - 7) for e, m in itertools.product(range(1, 16), range(8))]
    return torch.tensor(subnormal + normal[:-1], dtype=torch.float64)


def _reference_round_trip(rows: torch.Tensor) -> torch.Tensor:
    """Each block of FP8_BLOCK channels of each row scaled by amax/448 (in float32, as the scale travels),
    rounded to the nearest e4m3 number (ties to the even mantissa) and scaled back."""
    grid = _e4m3_grid()
    out = torch.empty_like(rows)
    for start in range(0, rows.shape[1], FP8_BLOCK):
        block = rows[:, start : start + FP8_BLOCK]
        amax = block.abs().amax(1, keepdim=True)
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        scaled = (block / scale).double()
        distance = (scaled.abs().unsqueeze(-1) - grid).abs()
        index = distance.argmin(-1)  # the lower of two equally near; an even index is an even mantissa
        above = (index + 1).clamp(max=len(grid) - 1)
        tie = distance.gather(-1, above[..., None]) == distance.gather(-1, index[..., None])
        index = index + (tie[..., 0] & (index % 2 == 1)).long()
        out[:, start : start + FP8_BLOCK] = (grid[index] * scaled.sign()).float() * scale
    return out


def test_fp8_payload_rounds_each_block_to_e4m3_within_its_bound():
    """Rows of 300 channels (blocks of 128, 128 and 44), values over 12 orders of magnitude: the bytes are
    the fp8 values and one float32 scale per block; the round trip is the reference rounding exactly, and
    within half an e4m3 step of each value (2^-4 relative, or 2^-10 of the scale below e4m3's normals)."""
    generator = torch.Generator().manual_seed(0)
    magnitudes = 10.0 ** torch.randint(-6, 6, (64, 1), generator=generator)
    rows = torch.randn(64, 300, generator=generator) * magnitudes
    rows[3, 128:256] = 0  # a block of zeros in a row
    rows[5] = 0  # a row of zeros
    payload = quantize_fp8_rows(rows)
    assert payload.dtype == torch.uint8 and payload.shape == (64, 300 + 4 * 3)
    got = dequantize_fp8_rows(payload, 300, torch.float32)
    assert torch.equal(got, _reference_round_trip(rows))
    for start in range(0, 300, FP8_BLOCK):
        block, block_got = rows[:, start : start + FP8_BLOCK], got[:, start : start + FP8_BLOCK]
        scale = block.abs().amax(1, keepdim=True) / 448
        bound = torch.maximum(block.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
        assert ((block_got - block).abs() <= bound).all()
        assert ((block_got - block).abs().amax(1) <= block.abs().amax(1) / 16).all()
    assert not got[3, 128:256].any() and not got[5].any()
    assert dequantize_fp8_rows(quantize_fp8_rows(rows[:0]), 300, torch.float32).shape == (0, 300)


def test_fp8_payload_is_exact_for_e4m3_numbers_times_a_power_of_two():
    """A block whose largest magnitude is 448 * 2^k and whose other values are e4m3 numbers times 2^k has
    the scale 2^k, and comes back bit for bit; in bfloat16 too."""
    generator = torch.Generator().manual_seed(1)
    grid = _e4m3_grid().float()
    values = grid[torch.randint(len(grid), (16, 256), generator=generator)]
    values = values * (torch.randint(2, (16, 256), generator=generator) * 2 - 1)
    values[:, 0], values[:, 128] = 448.0, -448.0  # each block's largest magnitude
    powers = 2.0 ** torch.randint(-20, 20, (16, 2), generator=generator).float()
    rows = values * powers.repeat_interleave(FP8_BLOCK, 1)
    assert torch.equal(dequantize_fp8_rows(quantize_fp8_rows(rows), 256, torch.float32), rows)
    rows = rows.bfloat16()
    assert torch.equal(dequantize_fp8_rows(quantize_fp8_rows(rows), 256, torch.bfloat16), rows)


def _train_counting_payload(rank: int, world: int, wire: str) -> tuple[list[float], int, int]:
    """10 AdamW steps of the tiny MoE model under ep 2 with the `wire` payload: each step's loss on this
    rank, and the token rows this rank sent by all-to-all (forward and backward) and their bytes."""
    cfg = load_config(None, [*MODEL, "--parallel.ep=2", f"--parallel.ep_comm_dtype={wire}"])
    model = _model(cfg)
    dims = ParallelDims.from_config(cfg, world)
    dims.build_mesh("cpu")
    stepped = parallelize(model, dims, cfg.parallel, device=torch.device("cpu"), microbatches=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    all_to_all, sent = torch.distributed.all_to_all_single, {"rows": 0, "bytes": 0}

    def counting(output, payload, *args, **kwargs):
        if payload.dim() == 2:  # token rows (the per-expert counts are a vector)
            sent["rows"] += payload.shape[0]
            sent["bytes"] += payload.numel() * payload.element_size()
        return all_to_all(output, payload, *args, **kwargs)

    torch.distributed.all_to_all_single = counting
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(10):
        tokens = torch.randint(257, (8, 17), generator=generator).chunk(dims.dp)[dims.dp_rank()]
        batches = [(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.chunk(2)]
        losses.append(float(full_tensor(stepped.forward_backward(batches, next_token_loss))))
        optimizer.step()
        optimizer.zero_grad()
    return losses, sent["rows"], sent["bytes"]


def test_an_fp8_payload_trains_as_float32_does_with_a_quarter_of_the_bytes_plus_scales():
    """The same 10 steps with a float32 and an fp8 payload: every loss within the parity matrix's fp8
    bound (the largest difference here is 9e-4), and a token row of 32 channels travels in 32 + 4 bytes
    (its fp8 values and one float32 scale) instead of 32 x 4."""
    exact = run_ranks(_train_counting_payload, 2, "float32", timeout_s=120)
    fp8 = run_ranks(_train_counting_payload, 2, "float8_e4m3fn", timeout_s=120)
    for (exact_losses, exact_rows, exact_bytes), (fp8_losses, fp8_rows, fp8_bytes) in zip(exact, fp8):
        differences = [abs(a - b) for a, b in zip(exact_losses, fp8_losses)]
        assert 0 < max(differences) < TOLERANCES["float8_e4m3fn"].loss, differences
        assert (exact_bytes, fp8_bytes) == (exact_rows * 32 * 4, fp8_rows * (32 + 4))
        assert fp8_bytes / exact_bytes == pytest.approx(36 / 128, rel=0.05)  # routing may differ a little


def _backward_exchanges(rank: int, world: int, overrides: list[str]) -> str:
    """The backward's all-to-all issues (I) and waits (W) on this rank, in order, one training step."""
    from megascale.parallel import expert

    cfg = load_config(None, [*MODEL, "--parallel.ep=2", *overrides])
    dims = ParallelDims.from_config(cfg, world)
    dims.build_mesh("cpu")
    stepped = parallelize(_model(cfg), dims, cfg.parallel, device=torch.device("cpu"), microbatches=1)
    events: list[str] | None = None  # a list once the forward is over
    issue, wait = expert._issue, expert._wait

    def recording(letter, function):
        def recorded(*args, **kwargs):
            if events is not None:
                events.append(letter)
            return function(*args, **kwargs)

        return recorded

    def loss_then_record(logits, labels):
        nonlocal events
        events = []
        return next_token_loss(logits, labels)

    expert._issue, expert._wait = recording("I", issue), recording("W", wait)
    tokens = torch.randint(257, (4, 17), generator=torch.Generator().manual_seed(1))
    stepped.forward_backward([(tokens[:, :-1], tokens[:, 1:])], loss_then_record)
    return "".join(events or [])


def test_the_backward_overlaps_each_chunks_returning_gradients_with_the_other_chunks_gemms():
    """Per MoE layer, with two chunks: both combines' gradients are sent before either is waited for, and
    each chunk's dispatch gradient is sent before the other chunk's expert GEMMs run backward (its next
    issue) and waited for only after them; with one chunk every exchange is waited for at once."""
    layers = 2  # the tiny model's MoE layers
    for events in run_ranks(_backward_exchanges, 2, [], timeout_s=120):
        assert events == "IIWIWIWW" * layers, events
    for events in run_ranks(_backward_exchanges, 2, ["--parallel.overlap.ep=false"], timeout_s=120):
        assert events == "IWIW" * layers, events
