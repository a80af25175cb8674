"""Stage 1 as a copy into a named memory buffer: what it holds, that it survives its process, and that a
restarted trainer writes a snapshot that was only in memory and resumes from it exactly."""

import torch
from torch import nn

from megascale.checkpoint.checkpointer import Checkpointer, list_checkpoints
from megascale.checkpoint.snapshot import SnapshotBuffer, SnapshotSlots, flatten
from megascale.checkpoint.stateful import ModelState
from megascale.config import JobConfig
from megascale.trainer import Trainer
from tests.test_trainer import losses_by_step


def state_of(model: nn.Module) -> dict:
    return {"model": ModelState(model), "extra": {"step": 7, "positions": [1, 2, 3], "rng": torch.arange(5)}}


def test_take_copies_the_state_and_the_copy_does_not_follow_training(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    buffer = SnapshotBuffer(tmp_path, rank=0)
    staged = buffer.take(state_of(model), {"step": 7})
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    assert staged["extra"]["step"] == 7 and staged["extra"]["positions"] == [1, 2, 3]
    assert torch.equal(staged["extra"]["rng"], torch.arange(5))
    for name, value in expected.items():
        assert torch.equal(staged["model"][name], value), name
    assert buffer.record_path.exists() and buffer.data_path.stat().st_size >= sum(
        v.numel() * 4 for v in expected.values()
    )


def test_a_new_process_restores_the_snapshot_when_the_layout_matches(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    SnapshotBuffer(tmp_path, rank=0).take(state_of(model), {"step": 7, "descriptor": {"x": 1}})

    fresh = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))  # what the restarted process builds
    meta, staged = SnapshotBuffer(tmp_path, rank=0).restore(state_of(fresh))
    assert meta == {"step": 7, "descriptor": {"x": 1}}
    for name, value in expected.items():
        assert torch.equal(staged["model"][name], value), name

    other_shape = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
    assert SnapshotBuffer(tmp_path, rank=0).restore(state_of(other_shape)) is None
    assert SnapshotBuffer(tmp_path, rank=1).restore(state_of(fresh)) is None  # another rank's: none


def test_release_forgets_the_snapshot_and_close_frees_the_memory(tmp_path):
    model = nn.Linear(8, 8)
    buffer = SnapshotBuffer(tmp_path / "snapshots", rank=0)
    buffer.take(state_of(model), {"step": 1})
    buffer.release()
    assert buffer.restore(state_of(model)) is None and buffer.data_path.exists()
    buffer.close()
    assert not (tmp_path / "snapshots").exists()


def test_closing_a_checkpointer_leaves_nothing_in_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_STAGING_DIR", str(tmp_path / "shm" / "job"))
    saver = Checkpointer(tmp_path / "ckpt", keep=2)
    saver.save(1, {"model": ModelState(nn.Linear(8, 8))}, {})
    saver.close()
    assert [step for step, _ in list_checkpoints(tmp_path / "ckpt")] == [1]
    assert not (tmp_path / "shm").exists()


def test_a_checkpointer_crashing_after_stage_one_loses_nothing(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    crashed = Checkpointer(tmp_path / "ckpt", keep=2)
    crashed._in_background = lambda *args: None  # the process dies before serialising its snapshot
    crashed.save(5, {"model": ModelState(model)}, {})
    crashed.wait()
    assert list_checkpoints(tmp_path / "ckpt") == []

    fresh = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    restarted = Checkpointer(tmp_path / "ckpt", keep=2)
    assert restarted.restore_from_memory({"model": ModelState(fresh)}, JobConfig())["step"] == 5
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name
    restarted.wait()  # the save's snapshot, never written, is written now
    assert [step for step, _ in list_checkpoints(tmp_path / "ckpt")] == [5]
    reloaded = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    restarted.load(restarted.latest_verified(), {"model": ModelState(reloaded)})
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_a_memory_snapshot_is_restored_without_storage_and_never_aliases_its_buffer(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    taker = Checkpointer(tmp_path / "ckpt", keep=2)
    taker.snapshot(3, {"model": ModelState(model)}, {})

    fresh = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    restarted = Checkpointer(tmp_path / "ckpt", keep=2)
    assert restarted.restore_from_memory({"model": ModelState(fresh)}, JobConfig())["step"] == 3
    restarted.wait()
    assert list_checkpoints(tmp_path / "ckpt") == []  # a snapshot between saves is written nowhere
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name
    with torch.no_grad():  # training goes on in the restored tensors; the buffer keeps step 3
        for param in fresh.parameters():
            param.add_(1.0)
    again = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    reader = Checkpointer(tmp_path / "ckpt", keep=2)
    assert reader.restore_from_memory({"model": ModelState(again)}, JobConfig())["step"] == 3
    for name, value in again.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_a_rank_killed_while_copying_keeps_its_previous_snapshot(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    at_step_2 = {name: value.clone() for name, value in model.state_dict().items()}
    slots = SnapshotSlots(tmp_path, rank=0)
    slots.take({"model": ModelState(model)}, {"step": 2})
    with torch.no_grad():
        model.weight.add_(1.0)
    slots.take({"model": ModelState(model)}, {"step": 4})
    with torch.no_grad():
        model.weight.add_(1.0)
    # The third copy goes into step 2's slot; the process dies with the copy half done (no record yet).
    slots.buffers[slots.next_slot()].release()
    fresh = nn.Linear(8, 8)
    state = {"model": ModelState(fresh)}
    restarted = SnapshotSlots(tmp_path, rank=0)
    tree = flatten(state)
    assert list(restarted.held(state, tree)) == [4]
    restarted.restore_into(state, tree, 4)
    assert torch.equal(fresh.weight, at_step_2["weight"] + 1.0)
    assert restarted.next_slot() != restarted.newest  # the next copy leaves step 4 whole


def test_a_trainer_killed_right_after_stage_one_resumes_from_that_snapshot_exactly(
    tiny_config, tmp_path, monkeypatch
):
    straight = tiny_config(run_dir=tmp_path / "straight")
    Trainer(straight).train()

    first = Trainer(tiny_config("--checkpoint.every=100", run_dir=tmp_path / "split"))
    for _ in range(4):
        first.train_step()
        first.step += 1
    monkeypatch.setattr(first.checkpointer, "_in_background", lambda *args: None)
    first.save_checkpoint()  # stage 1 done; the process "dies" before anything reaches storage
    first.checkpointer.wait()
    assert list_checkpoints(tmp_path / "split" / "checkpoints") == []

    second = Trainer(tiny_config(run_dir=tmp_path / "split"))
    assert second.step == 4
    second.train()
    first.close()  # the "dead" process's threads, once its snapshot was read
    reference = losses_by_step(tmp_path / "straight")
    assert losses_by_step(tmp_path / "split") == {step: reference[step] for step in (5, 6)}
