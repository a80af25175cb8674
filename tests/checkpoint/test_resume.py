"""Resuming with a changed config: each change said and applied, or refused when it would be ignored."""

import shutil
import threading

import pytest

from megascale.checkpoint.checkpointer import list_checkpoints
from megascale.cli import main
from megascale.config import load_config
from megascale.errors import CheckpointError, ConfigError
from megascale.optim import lr_factor
from megascale.trainer import Trainer
from tests.conftest import tiny_args
from tests.data.data_helpers import make_documents, write_parquet_parts
from tests.parallel.multiprocess import run_ranks


def test_a_longer_schedule_and_a_new_peak_lr_are_said_and_applied_from_the_resumed_step(
    tiny_config, tmp_path
):
    Trainer(tiny_config("--training.steps=4")).train()
    resumed = Trainer(tiny_config("--training.steps=8", "--optim.lr=0.001"))
    assert resumed.step == 4
    log = (tmp_path / "run" / "train.log").read_text()
    assert "resumed with settings changed since step 4: optim.lr 0.003 -> 0.001; training.steps 4 -> 8" in log
    schedule = dict(warmup_steps=2, total_steps=8, decay="cosine", min_lr_ratio=0.1)
    for optimizer in resumed.optimizers:
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(0.001 * lr_factor(4, **schedule))
    resumed.train()
    assert resumed.lr_schedulers[0].get_last_lr()[0] == pytest.approx(0.001 * lr_factor(8, **schedule))


def _resume_saying(rank: int, world: int, overrides: list[str]) -> str:
    """What this rank printed while resuming (rank 0's console and every rank's warnings go to stderr)."""
    import io
    import sys

    sys.stderr = io.StringIO()
    trainer = Trainer(load_config(None, overrides))
    trainer.close()
    return sys.stderr.getvalue()


def test_a_resume_with_changed_settings_is_said_once_for_the_job_not_by_every_rank(
    tiny_config, tiny_corpus, tmp_path
):
    Trainer(tiny_config("--training.steps=2")).train()
    overrides = tiny_args(
        tiny_corpus, tmp_path / "run", tmp_path.parent / "data", "--training.steps=3", "--parallel.dp_shard=2"
    )
    said = run_ranks(_resume_saying, 2, overrides, timeout_s=180)
    assert ["resumed with settings changed since step 2" in text for text in said] == [True, False]


def _train_longer(rank: int, world: int, overrides: list[str]) -> int:
    trainer = Trainer(load_config(None, overrides))
    trainer.train()
    return trainer.step


def test_a_longer_context_phase_resumes_with_rope_scaling_and_context_parallelism(
    tiny_config, tiny_corpus, tmp_path
):
    """docs/models.md's long-context recipe: the same run at 4x the sequence length, RoPE scaled over the
    trained length, each sequence split over 2 ranks."""
    Trainer(tiny_config("--training.steps=2")).train()
    longer = [
        "--model.max_seq_len=128",
        "--data.seq_len=128",
        "--model.attention.rope_scaling.type=llama3",
        "--model.attention.rope_scaling.factor=4",
        "--model.attention.rope_scaling.original_max_seq_len=32",
        "--parallel.cp=2",
        "--training.global_batch_size=2",
        "--training.micro_batch_size=1",
        "--training.steps=3",
    ]
    overrides = tiny_args(tiny_corpus, tmp_path / "run", tmp_path.parent / "data", *longer)
    assert run_ranks(_train_longer, 2, overrides, timeout_s=180) == [3, 3]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "resumed from" in log and "(sequence over cp 2)" in log
    assert "model.attention.rope_scaling.type 'none' -> 'llama3'" in log


def test_a_longer_learned_position_table_is_refused_on_resume(tiny_config):
    Trainer(tiny_config("--training.steps=2", "--model.position=learned")).train()
    with pytest.raises(
        CheckpointError, match=r"model\.max_seq_len = 32, but the config has model\.max_seq_len = 64"
    ):
        Trainer(tiny_config("--training.steps=4", "--model.position=learned", "--model.max_seq_len=64"))


def test_another_optimizer_is_refused_on_resume(tiny_config):
    Trainer(tiny_config("--training.steps=3")).train()
    with pytest.raises(ConfigError, match=r"optim\.name = 'lamb', but the run .* was trained with 'adamw'"):
        Trainer(tiny_config("--training.steps=6", "--optim.name=lamb"))


def test_an_import_into_a_run_directory_of_another_run_is_refused(tiny_config, tmp_path):
    source = Trainer(tiny_config("--training.steps=3", run_dir=tmp_path / "imported"))
    imported = source.save_checkpoint(blocking=True)
    source.close()
    Trainer(tiny_config("--training.steps=3")).train()  # the directory's own run, not started from it
    with pytest.raises(
        ConfigError, match=r"already holds checkpoints \(up to step 3\) of a run that did not"
    ):
        Trainer(tiny_config(f"--checkpoint.init_from={imported}"))
    assert [thread.name for thread in threading.enumerate() if thread.name.startswith("megascale-")] == []


def test_a_run_started_from_an_import_resumes_from_its_own_checkpoints(tiny_config, tmp_path):
    source = Trainer(tiny_config("--training.steps=3", run_dir=tmp_path / "imported"))
    imported = source.save_checkpoint(blocking=True)
    source.close()
    first = Trainer(tiny_config("--training.stop_at_step=2", f"--checkpoint.init_from={imported}"))
    first.train()
    again = Trainer(tiny_config(f"--checkpoint.init_from={imported}"))
    assert again.step == 2
    assert (
        "checkpoint.init_from is read only when a run starts" in (tmp_path / "run" / "train.log").read_text()
    )
    again.close()


def test_a_run_already_past_its_steps_says_there_is_nothing_to_train(tiny_corpus, tmp_path):
    args = tiny_args(tiny_corpus, tmp_path / "run", tmp_path / "data", "--training.steps=4")
    assert main(["train", *args]) == 0
    assert main(["train", *args, "--training.steps=2"]) == 0
    log = (tmp_path / "run" / "train.log").read_text()
    assert (
        "nothing to train: the run in" in log and "is already at step 4, and training ends at step 2" in log
    )
    assert [step for step, _ in list_checkpoints(tmp_path / "run" / "checkpoints")][-1] == 4


def test_a_run_whose_checkpoints_were_all_deleted_refuses_to_start_over_unless_told(tiny_config, tmp_path):
    """The checkpoint directory of a run that had progressed is deleted: the next start names the step that
    was lost and the flag that starts afresh, instead of silently training from step 0. A restart before
    the first commit, and a start afresh that crashes before its own, are not refused."""
    Trainer(tiny_config("--training.steps=4", "--checkpoint.every=2")).close()  # crashed before a commit
    Trainer(tiny_config("--training.steps=4", "--checkpoint.every=2")).train()
    shutil.rmtree(tmp_path / "run" / "checkpoints")
    gone = r"every checkpoint of this run is gone: step 4 .*--checkpoint\.resume=false"
    with pytest.raises(CheckpointError, match=gone):
        Trainer(tiny_config("--training.steps=6"))
    Trainer(tiny_config("--checkpoint.resume=false")).close()
    Trainer(tiny_config("--training.steps=2")).train()  # started afresh, nothing committed since: no refusal
    assert list_checkpoints(str(tmp_path / "run" / "checkpoints"))[-1][0] == 2


def test_a_run_that_switches_between_token_shards_and_streamed_data_resumes_with_the_data_at_its_start(
    tiny_config, tiny_corpus, tmp_path
):
    """Prepared shards and a stream keep different data states: the model, optimizer and schedule resume,
    the data starts at its beginning, and the log says so in one line; both ways."""
    pytest.importorskip("datasets")
    write_parquet_parts(tmp_path / "parquet", make_documents(300), parts=1)
    parquet = f"parquet:{tmp_path}/parquet/*.parquet"
    streamed = [f"--data.source={parquet}", "--data.streaming=true"]
    Trainer(tiny_config("--training.steps=2")).train()
    for steps, extra in ((4, streamed), (6, [])):
        trainer = Trainer(tiny_config(f"--training.steps={steps}", *extra))
        assert trainer.step == steps - 2
        assert trainer.train_loader.state_dict()["consumed_sequences"] == 0
        trainer.train()
    log = (tmp_path / "run" / "train.log").read_text()
    shards, stream = f"reads token shards of {str(tiny_corpus)!r}", f"streams {parquet!r}"
    said = "the model, optimizer and schedule resume from step {}, the data at its beginning"
    assert f"data: the checkpoint's run {shards}, this run {stream}; {said.format(2)}" in log
    assert f"data: the checkpoint's run {stream}, this run {shards}; {said.format(4)}" in log
