"""Layout validation: every bad layout is one clear ConfigError before any process group exists."""

import pytest
import torch.distributed as dist

from megascale.config import load_config
from megascale.errors import ConfigError
from megascale.parallel.dims import ParallelDims
from tests.parallel.multiprocess import run_ranks

SMALL = [
    "--model.dim=64",
    "--model.n_layers=4",
    "--model.attention.n_heads=4",
    "--model.attention.n_kv_heads=2",
    "--model.vocab_size=264",
    "--data.seq_len=32",
    "--model.max_seq_len=32",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=1",
]


def dims(world_size, *overrides):
    return ParallelDims.from_config(load_config(None, [*SMALL, *overrides]), world_size)


def test_dp_shard_takes_the_rest_of_the_world():
    assert dims(8, "--parallel.tp=2", "--parallel.pp=2") == ParallelDims(
        pp=2, dp_replicate=1, dp_shard=2, tp=2
    )
    assert dims(4, "--parallel.dp_replicate=2") == ParallelDims(pp=1, dp_replicate=2, dp_shard=2, tp=1)
    assert dims(1).world_size == 1 and dims(1).dp == 1


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (4, ["--parallel.dp_shard=3"], "1 x 1 x 3 x 1 = 3 must equal the world size 4"),
        (6, ["--parallel.tp=4"], "does not divide the world size 6"),
        (8, ["--parallel.tp=8"], "model.attention.n_heads = 4 is not divisible by parallel.tp = 8"),
        (4, ["--parallel.tp=4"], "model.attention.n_kv_heads = 2 is not divisible by parallel.tp = 4"),
        (
            2,
            [
                "--parallel.tp=2",
                "--model.dim=33",
                "--model.position=learned",
                "--model.attention.n_heads=3",
                "--model.attention.n_kv_heads=3",
            ],
            "model.dim = 33 is not divisible by parallel.tp = 2",
        ),
        (
            2,
            ["--parallel.tp=2", "--model.vocab_size=257"],
            "model.vocab_size = 257 is not divisible by parallel.tp = 2",
        ),
        (
            2,
            ["--parallel.tp=2", "--model.position=learned", "--model.max_seq_len=33"],
            "model.max_seq_len = 33 is not divisible by parallel.tp = 2",
        ),
        (
            2,
            ["--parallel.tp=2", "--data.seq_len=31"],
            "data.seq_len = 31 is not divisible by parallel.tp = 2",
        ),
        (8, ["--parallel.pp=8", "--parallel.dp_shard=1"], "8 stages, more than model.n_layers = 4"),
        (
            2,
            ["--parallel.pp=2", "--model.tie_embeddings=true"],
            "model.tie_embeddings = True cannot be used with parallel.pp = 2",
        ),
        (
            4,
            ["--parallel.pp=2", "--parallel.pp_virtual_stages=2"],
            "needs parallel.pp_schedule = 'interleaved_1f1b'",
        ),
        (
            4,
            ["--parallel.pp=2", "--parallel.pp_virtual_stages=4", "--parallel.pp_schedule=interleaved_1f1b"],
            "gives 8 stages, more than model.n_layers = 4",
        ),
        (2, ["--parallel.pp=2", "--parallel.pp_schedule=zbv"], "must be 2 with parallel.pp_schedule = 'zbv'"),
        (
            2,
            [
                *["--parallel.pp=2", "--parallel.pp_virtual_stages=2", "--parallel.pp_schedule=zbv"],
                "--parallel.overlap.pp=false",
            ],
            "parallel.overlap.pp = False cannot be used with parallel.pp_schedule = 'zbv'",
        ),
        (
            2,
            [
                *["--parallel.pp=2", "--parallel.pp_virtual_stages=2", "--parallel.pp_schedule=zbv"],
                "--training.compile=true",
            ],
            "training.compile = True cannot be used with parallel.pp_schedule = 'zbv'",
        ),
        (
            2,
            [
                *["--parallel.pp=2", "--parallel.pp_virtual_stages=2", "--parallel.pp_schedule=zbv"],
                "--parallel.activation_checkpoint=selective",
            ],
            "parallel.activation_checkpoint = 'selective' cannot be used with parallel.pp_schedule = 'zbv'",
        ),
        (
            4,
            [
                *["--parallel.pp=2", "--parallel.pp_virtual_stages=2", "--parallel.pp_schedule=dualpipev"],
                "--parallel.tp=2",
                "--parallel.dp_shard=1",
            ],
            "parallel.pp_schedule = 'dualpipev' cannot be used with parallel.tp = 2",
        ),
        (
            4,
            [
                *["--parallel.pp=2", "--parallel.pp_virtual_stages=2", "--parallel.pp_schedule=zbv"],
                "--parallel.zero_stage=3",
            ],
            "parallel.zero_stage = 3 cannot be used with parallel.pp_schedule = 'zbv' and data parallelism",
        ),
        (
            2,
            ["--parallel.tp=2", "--model.attention.qk_norm=true"],
            "model.attention.qk_norm = True cannot be used",
        ),
        (2, ["--parallel.ep=2"], "parallel.ep = 2 needs an MoE model (model.moe.experts > 0)"),
        (
            4,
            ["--model.moe.experts=4", "--parallel.ep=3"],
            "parallel.ep = 3 does not divide parallel.dp_shard = 4",
        ),
        (
            6,
            ["--model.moe.experts=4", "--parallel.ep=3", "--training.global_batch_size=6"],
            "model.moe.experts = 4 is not divisible by parallel.ep = 3",
        ),
        (
            2,
            ["--model.moe.experts=4", "--parallel.ep=2", "--parallel.activation_checkpoint=selective"],
            "parallel.activation_checkpoint = 'selective' cannot be used with parallel.ep = 2",
        ),
        (
            4,
            ["--model.moe.experts=2", "--parallel.tp=2", "--parallel.ep=2", "--parallel.moe_tp=ep"],
            "model.moe.experts = 2 is not divisible by parallel.ep x tp = 4",
        ),
        (
            2,
            [
                "--model.moe.experts=4",
                "--parallel.tp=2",
                "--parallel.moe_tp=ep",
                "--parallel.activation_checkpoint=selective",
            ],
            "parallel.activation_checkpoint = 'selective' cannot be used with parallel.ep x tp = 2",
        ),
        (
            2,
            [
                "--model.moe.experts=4",
                "--parallel.tp=2",
                "--parallel.moe_tp=ep",
                "--parallel.sequence_parallel=false",
                "--data.seq_len=15",
                "--model.max_seq_len=15",
            ],
            "data.seq_len = 15 is not divisible by parallel.tp = 2 (parallel.moe_tp = 'ep' routes each tp",
        ),
        (4, ["--parallel.cp=3"], "parallel.cp = 3 does not divide parallel.dp_shard = 4"),
        (
            2,
            ["--parallel.cp=2", "--data.seq_len=30", "--model.max_seq_len=30"],
            "data.seq_len = 30 is not divisible by 2 x parallel.cp = 4",
        ),
        (2, ["--parallel.cp=2", "--model.position=learned"], "model.position = 'learned' cannot be used"),
        (
            8,
            ["--parallel.cp=2", "--parallel.tp=2", "--model.moe.experts=4", "--parallel.moe_tp=ep"],
            "parallel.moe_tp = 'ep' cannot be used with parallel.cp = 2",
        ),
        (
            8,
            ["--parallel.cp=2", "--training.global_batch_size=6", "--training.micro_batch_size=1"],
            "training.global_batch_size = 6 is not divisible by the data-parallel degree 4 (dp_replicate x "
            "dp_shard / cp)",
        ),
        (3, [], "training.global_batch_size = 8 is not divisible by the data-parallel degree 3"),
        (
            2,
            [
                "--parallel.pp=2",
                "--parallel.pp_virtual_stages=2",
                "--parallel.pp_schedule=dualpipev",
                "--training.micro_batch_size=4",
            ],
            "leaves 2 micro-batches per step; DualPipeV needs at least its 2 x parallel.pp = 4 stages; try "
            "--training.micro_batch_size=2",
        ),
        (
            4,
            ["--training.micro_batch_size=4"],
            "training.micro_batch_size = 4 does not divide the per-rank batch 2 (global_batch_size / dp); "
            "try --training.micro_batch_size=2",
        ),
        (
            4,
            ["--parallel.pp=4", "--training.micro_batch_size=4"],
            "leaves 2 micro-batches per step, fewer than parallel.pp = 4 (the pipeline schedule needs at "
            "least pp); try --training.micro_batch_size=2",
        ),
        (
            6,
            [
                "--parallel.pp=3",
                "--parallel.pp_schedule=interleaved_1f1b",
                "--model.n_layers=6",
                "--training.global_batch_size=8",
                "--training.micro_batch_size=1",
                "--parallel.dp_shard=2",
            ],
            "leaves 4 micro-batches per step; interleaved 1F1B needs a multiple of parallel.pp = 3; raise "
            "training.global_batch_size",
        ),
    ],
)
def test_bad_layouts_fail_with_one_clear_line(world, overrides, message):
    with pytest.raises(ConfigError) as err:
        dims(world, *overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "world, overrides, ending",
    [
        # SMALL: 4 heads, 2 key/value heads, so tp of 1 or 2
        (8, ["--parallel.tp=3"], "does not divide the world size 8; valid parallel.tp: 1, 2"),
        (
            8,
            ["--parallel.tp=3", "--parallel.pp=2"],
            "= 6 does not divide the world size 8; no parallel.pp fits; valid parallel.tp: 1, 2",
        ),
        (4, ["--parallel.dp_shard=3"], "; --parallel.dp_shard=4 fits (or -1: the rest of the world)"),
        (
            6,
            ["--parallel.dp_shard=3", "--parallel.tp=4"],
            "= 12 must equal the world size 6; valid parallel.tp: 1, 2",
        ),
        (8, ["--parallel.tp=8"], "n_heads = 4 is not divisible by parallel.tp = 8; valid parallel.tp: 1, 2"),
        (4, ["--model.moe.experts=4", "--parallel.ep=3"], "dp_shard ranks); valid parallel.ep: 1, 2, 4"),
        (
            4,
            ["--model.moe.experts=2", "--parallel.tp=2", "--parallel.ep=2", "--parallel.moe_tp=ep"],
            "is not divisible by parallel.ep x tp = 4; valid parallel.ep: 1",
        ),
        (4, ["--parallel.cp=3"], "dp_shard ranks); valid parallel.cp: 1, 2, 4"),
        (
            2,
            ["--parallel.cp=2", "--data.seq_len=30", "--model.max_seq_len=30"],
            "(each cp rank holds 2 equal chunks); valid parallel.cp: 1",
        ),
        (
            8,
            ["--parallel.pp=8", "--parallel.dp_shard=1"],
            "than model.n_layers = 4; valid parallel.pp: 1, 2, 4",
        ),
    ],
)
def test_a_bad_degree_is_refused_with_the_degrees_that_would_fit(world, overrides, ending):
    with pytest.raises(ConfigError) as err:
        dims(world, *overrides)
    assert str(err.value).endswith(ending)


def test_one_micro_batch_is_singular_and_a_larger_global_batch_is_suggested_when_no_size_fits():
    with pytest.raises(ConfigError) as err:
        dims(2, "--parallel.pp=2", "--training.global_batch_size=1")
    assert str(err.value).endswith(
        "leaves 1 micro-batch per step, fewer than parallel.pp = 2 (the pipeline schedule needs at "
        "least pp); raise training.global_batch_size"
    )


def test_dp_shard_zero_is_rejected_by_the_config():
    with pytest.raises(ConfigError, match="parallel.dp_shard = 0 must be >= 1, or -1"):
        load_config(None, ["--parallel.dp_shard=0"])


def _mesh_groups(rank, world_size, rank_order):
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=2, tp=2, rank_order=rank_order)
    mesh = dims.build_mesh("cpu")
    return (
        mesh["pp"].get_local_rank(),
        dims.dp_rank(),
        mesh["tp"].get_local_rank(),
        dims.fsdp_mesh().size(),
    )


def test_build_mesh_numbers_tp_innermost_then_dp_then_pp():
    # Rank = (pp * dp + dp_rank) * tp + tp_rank: TP neighbours are adjacent ranks (one node), PP outermost.
    assert run_ranks(_mesh_groups, 8, "tp-dp-pp") == [
        (rank // 4, rank // 2 % 2, rank % 2, 2) for rank in range(8)
    ]


def test_rank_order_tp_pp_dp_puts_data_parallelism_outermost():
    # Rank = (dp_rank * pp + pp_rank) * tp + tp_rank.
    assert run_ranks(_mesh_groups, 8, "tp-pp-dp") == [
        (rank // 2 % 2, rank // 4, rank % 2, 2) for rank in range(8)
    ]


def _late_peer(rank, world_size, done):
    import time

    import torch

    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, tp=1)
    mesh = dims.build_mesh("cpu", timeout_s=3)
    if rank == 1:  # a hung peer, until rank 0 has given up on it (at most 30 s)
        deadline = time.monotonic() + 30
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=mesh["dp_shard"].get_group())
    except RuntimeError:
        return time.monotonic() - started
    finally:
        done.touch()
    return None


def test_the_mesh_groups_time_out_after_the_configured_timeout(tmp_path):
    # DeviceMesh's own groups took torch's 30-minute default, not parallel.timeout_s.
    waited, _ = run_ranks(_late_peer, 2, tmp_path / "gave-up")
    assert waited is not None and waited < 8, waited
