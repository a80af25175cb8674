"""An unset training.compile compiles where it was measured to win, and only in layouts that allow it."""

import pytest

from megascale.autocompile import AUTO_MIN_STEPS, compiles
from megascale.config import load_config
from megascale.parallel.dims import ParallelDims


def decide(*overrides: str, world: int = 1, device: str = "cpu") -> bool:
    cfg = load_config(None, ["--training.dtype=bfloat16", f"--training.steps={AUTO_MIN_STEPS}", *overrides])
    return compiles(cfg, ParallelDims.from_config(cfg, world), device)


def test_a_long_cpu_bfloat16_run_of_a_dense_model_compiles():
    assert decide()


@pytest.mark.parametrize(
    "overrides, device",
    [
        (["--training.dtype=float32"], "cpu"),  # measured no faster
        ([f"--training.steps={AUTO_MIN_STEPS - 1}"], "cpu"),  # too short to win the compile back
        ([f"--training.stop_at_step={AUTO_MIN_STEPS - 1}"], "cpu"),  # stops as short
        ([], "cuda"),  # never measured
        (["--model.moe.experts=4"], "cpu"),  # never measured
    ],
)
def test_where_it_was_not_measured_to_win_it_stays_eager(overrides, device):
    assert not decide(*overrides, device=device)


def test_a_layout_that_refuses_compile_stays_eager_instead_of_failing():
    """Compiled tensor parallelism is refused (`ParallelDims.validate`): unset, tp 2 runs eager."""
    assert not decide("--parallel.tp=2", world=2)
    assert decide("--parallel.dp_shard=2", "--training.micro_batch_size=8", world=2)


def test_a_set_value_decides_outright():
    assert not decide("--training.compile=false")
    assert decide("--training.compile=true", "--training.dtype=float32", "--training.steps=5")


def test_the_trainer_compiles_its_blocks_when_it_decides_to(tiny_config):
    from megascale.trainer import Trainer

    trainer = Trainer(tiny_config("--training.dtype=bfloat16", f"--training.steps={AUTO_MIN_STEPS}"))
    try:
        assert trainer.compiled
        blocks = trainer.model.parts[0].layers.values()
        assert all(block._compiled_call_impl is not None for block in blocks)  # nn.Module.compile()
    finally:
        trainer.close()
