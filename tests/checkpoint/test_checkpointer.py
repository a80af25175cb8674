"""Two-stage checkpoints: snapshot then background write, manifest committed last, checksums verified on
load with fallback, retention, and any fsspec location."""

import logging

import pytest
import torch
from torch import nn

from megascale.checkpoint import checkpointer as ckpt
from megascale.checkpoint import persist as persist_module
from megascale.checkpoint.checkpointer import Checkpointer, list_checkpoints, read_manifest, verify
from megascale.checkpoint.stateful import ModelState
from megascale.errors import CheckpointError


def model_state(seed: int = 0) -> tuple[nn.Module, dict]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    return model, {"model": ModelState(model)}


def restored(location: str) -> nn.Module:
    model, state = model_state(seed=123)
    ckpt.load_checkpoint(location, state)
    return model


def data_file(location: str):
    from pathlib import Path

    return next(path for path in Path(location).iterdir() if path.suffix == ".distcp")


def test_stage_one_snapshots_so_training_may_change_the_weights_at_once(tmp_path):
    model, state = model_state()
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    saver = Checkpointer(tmp_path, keep=3, async_save=True)
    location = saver.save(1, state, {"note": "x"})
    with torch.no_grad():  # the next optimizer step, while stage 2 may still be writing
        for param in model.parameters():
            param.add_(1.0)
    saver.wait()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
    for name, value in restored(location).state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_the_manifest_lists_every_file_with_size_and_crc(tmp_path):
    _, state = model_state()
    saver = Checkpointer(tmp_path, keep=3)
    location = saver.save(7, state, {"layout": "1 process"})
    saver.wait()
    manifest = read_manifest(location)
    assert manifest["step"] == 7 and manifest["layout"] == "1 process"
    assert ".metadata" in manifest["files"] and any(name.endswith(".distcp") for name in manifest["files"])
    assert all(entry["bytes"] > 0 and isinstance(entry["crc32"], int) for entry in manifest["files"].values())
    assert verify(location) is None


def test_a_save_that_dies_in_stage_two_is_invisible_and_its_files_removed(tmp_path, monkeypatch):
    _, state = model_state()
    saver = Checkpointer(tmp_path, keep=3)
    saver.save(1, state, {})
    saver.wait()

    def die(*args):
        raise OSError("disk vanished")

    monkeypatch.setattr(persist_module, "commit", die)
    saver.save(2, state, {})
    with pytest.raises(CheckpointError, match="saving step 2 failed: disk vanished"):
        saver.wait()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
    assert not (tmp_path / "step-00000002").exists()  # written, never committed: removed at once
    assert saver.latest_verified().endswith("step-00000001")
    monkeypatch.undo()
    saver.save(3, state, {})
    saver.wait()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1, 3]


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "delete"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_verified_one(tmp_path, caplog, damage):
    model, state = model_state()
    saver = Checkpointer(tmp_path, keep=3)
    first = saver.save(1, state, {})
    saver.wait()
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    with torch.no_grad():
        model[0].weight.add_(1.0)
    second = saver.save(2, state, {})
    saver.wait()
    shard = data_file(second)
    content = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(content[: len(content) // 2])
    elif damage == "flip a byte":
        shard.write_bytes(content[:-100] + bytes([content[-100] ^ 0xFF]) + content[-99:])
    else:
        shard.unlink()
    with caplog.at_level(logging.WARNING, logger="megascale.checkpoint"):
        assert saver.latest_verified() == first
    assert "step 2" in caplog.text and "failed verification" in caplog.text
    for name, value in restored(first).state_dict().items():
        assert torch.equal(value, expected[name])


def test_keeps_the_newest_k(tmp_path):
    _, state = model_state()
    saver = Checkpointer(tmp_path, keep=2, async_save=False)
    for step in range(1, 5):
        saver.save(step, state, {})
    assert [step for step, _ in list_checkpoints(tmp_path)] == [3, 4]


def test_any_fsspec_location(tmp_path):
    model, state = model_state()
    saver = Checkpointer("memory://megascale-test/run", keep=2)
    location = saver.save(5, state, {})
    saver.wait()
    assert location == "memory://megascale-test/run/step-00000005"
    assert list_checkpoints("memory://megascale-test/run") == [(5, location)]
    assert verify(location) is None
    for name, value in restored(location).state_dict().items():
        assert torch.equal(value, model.state_dict()[name])


def test_a_coordinator_waiting_for_a_node_that_died_gives_up_when_abandoned(tmp_path):
    """Two nodes; the other one died before its share was ready, so only the coordinator's marker comes."""
    import threading
    import time

    staged = tmp_path / "staging" / "step-00000004"
    staged.mkdir(parents=True)
    (staged / ".metadata").write_bytes(b"m")
    (staged / "__0_0.distcp").write_bytes(b"x" * 100)
    final = str(tmp_path / "checkpoints" / "step-00000004")
    persist_module.mark_ready(
        staged, final=final, descriptor={"step": 4}, keep=3, save_id="s1", nodes=2, node="node-0"
    )
    heard, outcome = [], {}

    def run():
        try:
            persist_module.persist(staged, marker_timeout_s=60, on_wait=heard.append)
        except RuntimeError as err:
            outcome["error"] = str(err)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 10
    while not heard and time.monotonic() < deadline:
        time.sleep(0.01)
    assert heard == [{"final": final, "save_id": "s1"}]
    started = time.monotonic()
    persist_module.abandon(final, "s1")
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - started < 2
    assert "1 of 2 nodes persisted" in outcome["error"] and heard[-1] is None
    assert list_checkpoints(tmp_path / "checkpoints") == [] and not staged.exists()


def test_a_checkpoint_lacking_an_entry_the_state_asks_for_is_one_line(tmp_path):
    """DCP's own error is a BaseException gathering every rank's: it becomes a CheckpointError naming the
    key, not a traceback."""
    _, state = model_state()
    location = ckpt.write_checkpoint(str(tmp_path / "ckpt"), state, {})
    _, asked = model_state()
    asked["data"] = {"position": 0}
    with pytest.raises(CheckpointError) as refused:
        ckpt.load_checkpoint(location, asked)
    assert str(refused.value) == (
        f"checkpoint: cannot load {location}: Missing key in checkpoint state_dict: data.position."
    )
