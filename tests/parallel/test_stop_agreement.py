"""A stop signal reaching one rank just after a step's all-reduce: every rank must still stop after the
same step (a rank that left the loop alone would leave the others waiting in the next collective); and a
rank whose own signal comes after that agreement saves with the others."""

import os
import signal

from megascale.checkpoint.manifest import list_checkpoints
from megascale.config import load_config
from megascale.trainer import Trainer
from tests.conftest import tiny_args
from tests.parallel.multiprocess import run_ranks


def two_rank_trainer(corpus, run_dir, data_dir):
    """The tiny job over 2 data-parallel ranks, 8 steps (a checkpoint every 3)."""
    return Trainer(
        load_config(None, tiny_args(corpus, run_dir, data_dir, "--parallel.dp_shard=2", "--training.steps=8"))
    )


def train_with_late_signal(rank, world_size, corpus, run_dir, data_dir):
    trainer = two_rank_trainer(corpus, run_dir, data_dir)
    step_once = trainer.train_step

    def step_then_signal():
        metrics = step_once()
        if rank == 1 and trainer.step == 2:  # the all-reduce of step 3 is behind us: too late to carry it
            trainer._stop_signal = 15
        return metrics

    trainer.train_step = step_then_signal
    summary = trainer.train()
    return summary["step"], summary["interrupted"]


def test_a_signal_after_the_all_reduce_stops_every_rank_one_step_later(tiny_corpus, tmp_path):
    results = run_ranks(
        train_with_late_signal, 2, tiny_corpus, tmp_path / "run", tmp_path / "data", timeout_s=90
    )
    assert results == [(4, True), (4, True)]


def train_with_a_signal_in_the_save(rank, world_size, corpus, run_dir, data_dir):
    """Rank 0 is signalled as step 2 begins, so both ranks stop after step 2; rank 1's own signal comes
    only as it starts that last save (a preemption reaches the nodes at different moments)."""
    trainer = two_rank_trainer(corpus, run_dir, data_dir)
    step_once, save = trainer.train_step, trainer.save_checkpoint

    def step_signalled():
        if rank == 0 and trainer.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return step_once()

    def save_signalled():
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        save()

    trainer.train_step, trainer.save_checkpoint = step_signalled, save_signalled
    summary = trainer.train()
    return summary["step"], summary["interrupted"]


def test_a_rank_signalled_after_the_stop_was_agreed_still_saves_with_the_others(tiny_corpus, tmp_path):
    results = run_ranks(
        train_with_a_signal_in_the_save, 2, tiny_corpus, tmp_path / "run", tmp_path / "data", timeout_s=90
    )
    assert results == [(2, True), (2, True)]
    assert [step for step, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2]
