"""The single-process trainer end to end on a tiny model: metrics, checkpoints, resume, signals."""

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megascale.checkpoint.checkpointer import list_checkpoints, read_manifest
from megascale.errors import CheckpointError
from megascale.observe.metrics import read_metrics
from megascale.trainer import Trainer
from tests.conftest import tiny_args


def losses_by_step(run_dir):
    """The last logged loss of every step (a resumed run logs the steps after its checkpoint again)."""
    return {record["step"]: record["loss"] for record in read_metrics(run_dir)}


def test_trains_logs_and_checkpoints(tiny_config, tmp_path):
    cfg = tiny_config("--metrics.tensorboard=true", "--training.steps=12", "--optim.lr=0.01")
    summary = Trainer(cfg).train()
    run_dir = tmp_path / "run"
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 13))
    first, last = records[0], records[-1]
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu"):
        assert key in first
    assert first["peak_source"] == "config"
    assert last["loss"] < first["loss"] - 0.5, (first["loss"], last["loss"])
    assert "val_loss" in last and summary["val_loss"] == last["val_loss"]
    assert [step for step, _ in list_checkpoints(run_dir / "checkpoints")] == [6, 9, 12]  # keep = 3
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "step 12/12" in (run_dir / "train.log").read_text()


def test_resume_in_process_is_exact(tiny_config, tmp_path):
    straight = Trainer(tiny_config(run_dir=tmp_path / "straight"))
    straight.train()
    first = Trainer(tiny_config(run_dir=tmp_path / "split"))
    for _ in range(3):  # what the loop does, stopping after step 3
        first.train_step()
        first.step += 1
    first.save_checkpoint(blocking=True)
    first.close()
    second = Trainer(tiny_config(run_dir=tmp_path / "split"))
    assert second.step == 3
    second.train()
    reference = losses_by_step(tmp_path / "straight")
    assert losses_by_step(tmp_path / "split") == {step: reference[step] for step in (4, 5, 6)}
    for a, b in zip(straight.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)


def _train_command(corpus, run_dir, cache_dir, *extra):
    return [sys.executable, "-m", "megascale.cli", "train", *tiny_args(corpus, run_dir, cache_dir, *extra)]


def _wait_for(predicate, timeout_s, proc):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"process exited early with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def test_sigkill_then_restart_reproduces_losses_bit_for_bit(tiny_corpus, tmp_path):
    """A run killed with SIGKILL after a checkpoint and restarted with the same command matches an
    uninterrupted run exactly (fp32)."""
    cache = tmp_path / "data"
    steps = ["--training.steps=30", "--checkpoint.every=10"]
    reference = subprocess.run(
        _train_command(tiny_corpus, tmp_path / "straight", cache, *steps),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert reference.returncode == 0, reference.stderr
    command = _train_command(tiny_corpus, tmp_path / "killed", cache, *steps)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Kill the first time a checkpoint has been committed and training has moved past it.
        _wait_for(
            lambda: (
                list_checkpoints(tmp_path / "killed" / "checkpoints")
                and max(losses_by_step(tmp_path / "killed"), default=0) > 10
            ),
            240,
            proc,
        )
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = max(losses_by_step(tmp_path / "killed"))
    assert killed_at < 30, "the run finished before it could be killed"
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in (tmp_path / "killed" / "train.log").read_text()
    reference_losses = losses_by_step(tmp_path / "straight")
    assert losses_by_step(tmp_path / "killed") == reference_losses
    assert len(reference_losses) == 30


def test_sigterm_saves_a_checkpoint_and_exits_zero(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    command = _train_command(
        tiny_corpus, run_dir, tmp_path / "data", "--training.steps=100000", "--checkpoint.every=100000"
    )
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: max(losses_by_step(run_dir), default=0) >= 2, 240, proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    assert len(checkpoints) == 1
    step, path = checkpoints[0]
    assert step == max(losses_by_step(run_dir))
    assert read_manifest(path)["step"] == step


@pytest.mark.parametrize(
    "extra",
    [
        ["--optim.name=lamb"],
        [
            "--model.block=parallel",
            "--model.attention.window=8",
            "--model.norm=layernorm",
            "--model.mlp=gelu",
            "--model.position=learned",
        ],
        ["--training.dtype=bfloat16"],
    ],
)
def test_model_and_optimizer_options_train(tiny_config, extra):
    cfg = tiny_config(*extra, "--training.steps=4", "--checkpoint.enabled=false")
    summary = Trainer(cfg).train()
    assert summary["step"] == 4 and torch.isfinite(torch.tensor(summary["loss"]))


def test_trains_outside_the_main_thread(tiny_config):
    """Signal handlers can only be installed from the main thread; elsewhere training runs without them."""
    outcome = {}

    def run():
        try:
            cfg = tiny_config("--training.steps=2", "--checkpoint.enabled=false")
            outcome["summary"] = Trainer(cfg).train()
        except Exception as err:  # noqa: BLE001 (reported below)
            outcome["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["summary"]["step"] == 2


def _corrupt_newest(run_dir):
    step, location = list_checkpoints(run_dir / "checkpoints")[-1]
    shard = next(path for path in Path(location).iterdir() if path.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-16])
    return step


def test_a_step_that_raises_leaves_no_thread_of_the_run_behind(tiny_config, monkeypatch):
    """An exception out of the loop stops the run's threads (data prefetch, timeline, hang watch) before it
    reaches the caller; a notebook, or a test process that forks ranks later, keeps none of them."""
    trainer = Trainer(tiny_config())
    step = trainer.train_step

    def fails_at_step_3():
        if trainer.step == 2:
            raise RuntimeError("injected")
        return step()

    monkeypatch.setattr(trainer, "train_step", fails_at_step_3)
    with pytest.raises(RuntimeError, match="injected"):
        trainer.train()
    assert trainer.step == 2
    assert [thread.name for thread in threading.enumerate() if thread.name.startswith("megascale")] == []


def test_a_corrupted_newest_checkpoint_resumes_from_the_previous_one(tiny_config, tmp_path):
    Trainer(tiny_config()).train()  # checkpoints at steps 3 and 6
    assert _corrupt_newest(tmp_path / "run") == 6
    resumed = Trainer(tiny_config())
    resumed.close()
    assert resumed.step == 3
    log = (tmp_path / "run" / "train.log").read_text()
    assert "step 6 at" in log and "failed verification (file __0_0.distcp has" in log


def test_when_every_checkpoint_is_damaged_the_run_refuses_to_start(tiny_config, tmp_path):
    Trainer(tiny_config("--checkpoint.keep=1")).train()
    _corrupt_newest(tmp_path / "run")
    with pytest.raises(CheckpointError, match="every checkpoint under .* failed verification"):
        Trainer(tiny_config())


def test_checkpointing_does_not_change_the_training(tiny_config, tmp_path):
    # Taking a fresh optimizer's state dict used to step it once (DCP initialises lazy state that way),
    # which shifted Adam's bias correction and so every loss after the first.
    plain = tiny_config("--checkpoint.enabled=false", run_dir=tmp_path / "plain")
    Trainer(plain).train()
    Trainer(tiny_config(run_dir=tmp_path / "checkpointed")).train()
    assert losses_by_step(tmp_path / "checkpointed") == losses_by_step(tmp_path / "plain")


def test_stop_at_step_stops_short_of_the_schedule_and_a_later_run_finishes_it(tiny_config, tmp_path):
    Trainer(tiny_config(run_dir=tmp_path / "straight")).train()
    split = tmp_path / "split"
    summary = Trainer(tiny_config("--training.stop_at_step=4", run_dir=split)).train()
    assert summary["step"] == 4
    assert list_checkpoints(split / "checkpoints")[-1][0] == 4
    Trainer(tiny_config(run_dir=split)).train()
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(split)
    # The learning rate of every step follows the 6-step schedule, so the losses are the same bits.
    assert [(r["step"], r["lr"], r["loss"]) for r in resumed] == [
        (r["step"], r["lr"], r["loss"]) for r in straight
    ]


def test_each_step_is_logged_once_when_a_run_directory_is_run_again(tiny_config, tmp_path):
    for _ in range(2):  # no checkpoints: the second run starts afresh in the same directory
        Trainer(tiny_config("--checkpoint.enabled=false")).train()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == list(range(1, 7))
    # A run that went past its newest checkpoint (lost here) logs the steps after it again, once.
    Trainer(tiny_config(run_dir=tmp_path / "crashed")).train()
    shutil.rmtree(list_checkpoints(tmp_path / "crashed" / "checkpoints")[-1][1])
    Trainer(tiny_config(run_dir=tmp_path / "crashed")).train()
    assert [r["step"] for r in read_metrics(tmp_path / "crashed")] == list(range(1, 7))


def test_validation_takes_the_same_sequences_whatever_the_micro_batch(tiny_config, tmp_path):
    """3 validation sequences: one micro-batch of 4 with a padded slot, or three of 1."""
    losses = []
    for size in (1, 4):
        trainer = Trainer(
            tiny_config(
                f"--training.micro_batch_size={size}",
                "--training.val_sequences=3",
                run_dir=tmp_path / str(size),
            )
        )
        losses.append(trainer.validate())
        trainer.close()
    assert abs(losses[0] - losses[1]) <= 1e-6


def test_a_warm_standby_builds_says_it_is_ready_waits_and_then_resumes(tiny_config, tmp_path, monkeypatch):
    """MEGASCALE_STANDBY: the trainer builds everything, writes standby-<rank>.json, and resumes only once
    the file it names exists, from the newest state (here a run's checkpoint), as any restart would."""
    import gc

    Trainer(tiny_config("--training.steps=4", run_dir=tmp_path / "run")).train()
    go = tmp_path / "attempt-1" / "go"
    go.parent.mkdir()
    monkeypatch.setenv("MEGASCALE_STANDBY", str(go))
    monkeypatch.setenv("MEGASCALE_HEARTBEAT_DIR", str(go.parent))
    built: list[Trainer] = []
    standby = threading.Thread(
        target=lambda: built.append(Trainer(tiny_config("--training.steps=6", run_dir=tmp_path / "run")))
    )
    try:
        standby.start()
        deadline = time.monotonic() + 60
        while not (go.parent / "standby-0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (go.parent / "standby-0.json").exists() and not built  # ready, and waiting
        go.touch()
        standby.join(timeout=60)
        (trainer,) = built
        assert trainer.step == 4
        trainer.train()
        assert trainer.step == 6
    finally:
        go.touch()
        standby.join(timeout=60)
        gc.unfreeze()
