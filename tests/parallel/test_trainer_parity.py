"""The whole Trainer under every layout of the acceptance matrix against one process: 10 optimizer steps,
fp32, same seed and same sequences per step; max |delta loss| printed for each layout, optimizer and block.

Each layout's ranks are forked once and train every (optimizer, block) combination in turn, so the matrix
costs process start-up once per layout. The single-process references run in a forked process as well:
the test process itself never computes, which keeps forking it safe.
"""

import pytest

from megascale.config import load_config
from megascale.observe.metrics import read_metrics
from megascale.trainer import Trainer
from tests.conftest import TINY
from tests.parallel.multiprocess import run_ranks

STEPS = 10
TOLERANCE = 1e-4
COMBOS = [("adamw", "serial"), ("adamw", "parallel"), ("lamb", "serial"), ("lamb", "parallel")]
# Layouts of 4 and more processes take two, which still try each optimizer and each block: the combination
# adds nothing the layout does not already see, and the suite has 30 minutes.
PAIRED = [("adamw", "serial"), ("lamb", "parallel")]
# Four layers so that two pipeline ranks can hold two virtual stages each; 4 sequences per step.
PARITY = [
    "--model.n_layers=4",
    "--training.global_batch_size=4",
    f"--training.steps={STEPS}",
    f"--training.val_every={STEPS}",
    "--optim.grad_clip=0.5",  # small enough to clip: the global norm must be right
    "--checkpoint.enabled=false",
]


def job_args(corpus, data_dir, run_dir, *layout):
    return [
        *TINY,
        *PARITY,
        f"--data.source={corpus}",
        f"--data.cache_dir={data_dir}",
        f"--training.run_dir={run_dir}",
        *layout,
    ]


def train_combos(rank, world_size, corpus, data_dir, run_root, layout, combos=COMBOS):
    """Train each (optimizer, block) combination under `layout`; rank 0 returns each run's losses."""
    losses = {}
    for optimizer, block in combos:
        run_dir = run_root / f"{optimizer}-{block}"
        args = job_args(
            corpus, data_dir, run_dir, *layout, f"--optim.name={optimizer}", f"--model.block={block}"
        )
        trainer = Trainer(load_config(None, args))
        trainer.train()
        if rank == 0:
            losses[optimizer, block] = [record["loss"] for record in read_metrics(run_dir)]
    return trainer.parallel_dims.world_size, losses


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    _, losses = run_ranks(
        train_combos, 1, tiny_corpus, root / "data", root, ["--training.micro_batch_size=4"]
    )[0]
    return losses


def check_parity(reference, tiny_corpus, tmp_path, world_size, layout):
    combos = COMBOS if world_size <= 2 else PAIRED
    ran_on, got = run_ranks(
        train_combos, world_size, tiny_corpus, tmp_path / "data", tmp_path, layout, combos, timeout_s=400
    )[0]
    assert ran_on == world_size
    worst = 0.0
    for combo in combos:
        assert len(got[combo]) == STEPS == len(reference[combo])
        delta = max(abs(a - b) for a, b in zip(got[combo], reference[combo]))
        print(f"{' '.join(layout)} {combo[0]} {combo[1]}: max |delta loss| over {STEPS} steps = {delta:.2e}")
        worst = max(worst, delta)
    assert worst <= TOLERANCE


# (world size, layout flags); micro-batch sizes differ, the 4 sequences of each step do not.
LAYOUTS = {
    "dp2": (2, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--training.micro_batch_size=2"]),
    "fsdp2-zero1": (2, ["--parallel.dp_shard=2", "--parallel.zero_stage=1", "--training.micro_batch_size=1"]),
    "fsdp2-zero2": (2, ["--parallel.dp_shard=2", "--parallel.zero_stage=2", "--training.micro_batch_size=1"]),
    "fsdp2-zero3": (2, ["--parallel.dp_shard=2", "--parallel.zero_stage=3", "--training.micro_batch_size=2"]),
    "hsdp2x2": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--training.micro_batch_size=1"]),
    "tp2-sp": (2, ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--training.micro_batch_size=4"]),
    "pp2-1f1b": (2, ["--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--training.micro_batch_size=1"]),
    "pp2-interleaved": (
        2,
        [
            "--parallel.pp=2",
            "--parallel.pp_schedule=interleaved_1f1b",
            "--parallel.pp_virtual_stages=2",
            "--parallel.pp_split=params",
            "--training.micro_batch_size=1",
        ],
    ),
    "dp2xtp2": (4, ["--parallel.dp_shard=2", "--parallel.tp=2", "--training.micro_batch_size=2"]),
    "tp2xpp2": (4, ["--parallel.tp=2", "--parallel.pp=2", "--training.micro_batch_size=2"]),
    "dp2xpp2": (4, ["--parallel.dp_shard=2", "--parallel.pp=2", "--training.micro_batch_size=1"]),
    "dp2xpp2-dp-outermost": (
        4,
        [
            "--parallel.dp_shard=2",
            "--parallel.pp=2",
            "--parallel.rank_order=tp-pp-dp",
            "--training.micro_batch_size=1",
        ],
    ),
    "dp2xtp2xpp2": (
        8,
        ["--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.pp=2", "--training.micro_batch_size=1"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_process(name, reference, tiny_corpus, tmp_path):
    world_size, layout = LAYOUTS[name]
    check_parity(reference, tiny_corpus, tmp_path, world_size, layout)


def validation_loss(rank, world_size, corpus, data_dir, run_dir, layout):
    """Validation loss after 2 steps; 4 validation micro-batches of 1 sequence, a multiple of every
    layout's unit (dp, times micro-batches per step under pp), so no layout rounds the count up."""
    args = job_args(
        corpus,
        data_dir,
        run_dir,
        "--training.steps=2",
        "--training.val_batches=4",
        "--training.micro_batch_size=1",
        *layout,
    )
    return Trainer(load_config(None, args)).train()["val_loss"]


def test_validation_loss_matches_single_process(tiny_corpus, tmp_path):
    data = tmp_path / "data"
    reference = run_ranks(validation_loss, 1, tiny_corpus, data, tmp_path / "one", [])[0]
    for name, world_size, layout in [
        ("dp2", 2, ["--parallel.dp_shard=2"]),
        (
            "pp2 interleaved",
            2,
            ["--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2"],
        ),
        ("dp2 x pp2", 4, ["--parallel.dp_shard=2", "--parallel.pp=2"]),
    ]:
        got = run_ranks(
            validation_loss, world_size, tiny_corpus, data, tmp_path / name.replace(" ", ""), layout
        )
        print(f"validation loss, {name}: |delta| = {abs(got[0] - reference):.2e}")
        assert abs(got[0] - reference) <= TOLERANCE
