"""The prefetching training loader: exact resume whatever was prefetched, errors raised in the trainer's
thread, clean shutdown, and a slow dataset that costs the step nothing with the thread and its delay
without it (timeline data wait)."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import threading
import time

import pytest
import torch

from megascale.data import build_dataloaders
from megascale.data.dataset import PackedSequences
from megascale.observe.trace import read_trace
from megascale.trainer import Trainer

STEPS, SPLIT_AT = 24, 9
DELAY_S = 0.05  # per batch read, below the step time the slow-sync step below gives
SYNC_S = 0.12  # the emulated gradient synchronisation at the end of each step


def loader(cfg, prefetch: int, micro_batches_per_step: int = 2):
    train, _ = build_dataloaders(
        dataclasses.replace(cfg, prefetch=prefetch),
        model_vocab_size=257,
        micro_batch_size=2,
        seed=3,
        micro_batches_per_step=micro_batches_per_step,
        progress=False,
    )
    return train


_EARLIER: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _ignore_earlier_tests_threads():
    """Loaders of earlier tests in the session (a Trainer built but never run keeps its loader until it
    is collected) may still have their threads: count only this test's."""
    _EARLIER.clear()
    _EARLIER.update(thread for thread in threading.enumerate() if thread.name == "megascale-data")


def data_threads() -> list[threading.Thread]:
    """This test's prefetch threads still alive."""
    return [t for t in threading.enumerate() if t.name == "megascale-data" and t not in _EARLIER]


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.fixture
def cfg(cfg_for, text_dir):
    return cfg_for(text_dir[0], seq_len=32)


@pytest.mark.parametrize(("before", "after"), [(1, 1), (1, 0), (0, 2)])
def test_resume_gives_the_uninterrupted_stream(cfg, before, after):
    """N batches straight equal k batches, a saved state, a new loader and N - k batches, with prefetch
    on or off on either side; the state counts what was taken, not what the thread prepared."""
    straight = loader(cfg, prefetch=1)
    expected = [next(straight) for _ in range(STEPS)]
    straight.close()

    first = loader(cfg, prefetch=before)
    taken = [next(first) for _ in range(SPLIT_AT)]
    time.sleep(0.05)  # let the thread run ahead
    state = first.state_dict()
    assert state == {"consumed_sequences": SPLIT_AT * 2}
    first.close()
    second = loader(cfg, prefetch=after)
    second.load_state_dict(state)
    rest = [next(second) for _ in range(STEPS - SPLIT_AT)]
    second.close()
    assert all(same(a, b) for a, b in zip(taken + rest, expected, strict=True))


def test_load_state_discards_prefetched_batches(cfg):
    reference = loader(cfg, prefetch=0)
    expected = [next(reference) for _ in range(12)]
    train = loader(cfg, prefetch=2)
    for _ in range(3):
        next(train)
    rewind = train.state_dict()
    for _ in range(6):
        next(train)
    train.load_state_dict(rewind)  # the thread had batches 10-13 ready: all dropped
    assert all(same(next(train), batch) for batch in expected[3:12])
    train.close()


def test_thread_runs_ahead_by_its_depth_and_stops_clean(cfg, monkeypatch):
    reads = []
    original = PackedSequences.rows
    monkeypatch.setattr(PackedSequences, "rows", lambda self, rows: reads.append(1) or original(self, rows))
    train = loader(cfg, prefetch=2, micro_batches_per_step=3)  # 6 batches ahead
    next(train)
    deadline = time.monotonic() + 5
    while len(reads) < 1 + 6 + 1 and time.monotonic() < deadline:  # 6 queued, one made and waiting
        time.sleep(0.01)
    time.sleep(0.1)
    assert len(reads) == 8 and len(data_threads()) == 1
    train.close()
    assert data_threads() == []
    with pytest.raises(RuntimeError, match="closed"):
        next(train)


def test_dropped_loader_ends_its_thread(cfg):
    train = loader(cfg, prefetch=1)
    next(train)
    assert len(data_threads()) == 1
    del train
    gc.collect()
    deadline = time.monotonic() + 5
    while data_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert data_threads() == []


def test_error_in_the_thread_is_raised_in_the_trainers_thread(cfg, monkeypatch):
    original = PackedSequences.rows
    calls = []

    def failing(self, indices):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise ValueError("shard 7 is unreadable: Input/output error")
        return original(self, indices)

    monkeypatch.setattr(PackedSequences, "rows", failing)
    train = loader(cfg, prefetch=1)
    next(train), next(train)
    with pytest.raises(ValueError, match=r"^shard 7 is unreadable: Input/output error$"):
        next(train)
    assert set(calls) == {"megascale-data"}  # read in the thread, raised here
    assert train.state_dict() == {"consumed_sequences": 4}  # the failed batch was not taken
    assert next(train)[0].shape == (2, 32)  # a retry starts the thread again
    train.close()


def test_a_trainer_stepped_by_hand_ends_its_thread_on_close(tiny_config, tmp_path):
    trainer = Trainer(
        tiny_config("--data.prefetch=2", "--checkpoint.enabled=false", run_dir=tmp_path / "run")
    )
    trainer.train_step()
    assert len(data_threads()) == 1
    trainer.close()
    trainer.close()  # idempotent
    assert data_threads() == []


@pytest.mark.parametrize("prefetch", [1, 0])
def test_slow_dataset_costs_no_data_wait_with_prefetch(tiny_config, monkeypatch, tmp_path, prefetch):
    """Each batch read takes DELAY_S; each step ends with a SYNC_S gradient synchronisation. With the
    thread the reads hide behind the step (timeline data wait ~0); without it each step waits DELAY_S."""
    original_rows = PackedSequences.rows

    def slow_rows(self, indices):
        time.sleep(DELAY_S)
        return original_rows(self, indices)

    original_mean = Trainer._job_mean

    def slow_sync(self, *args, **kwargs):
        time.sleep(SYNC_S)
        return original_mean(self, *args, **kwargs)

    monkeypatch.setattr(PackedSequences, "rows", slow_rows)
    monkeypatch.setattr(Trainer, "_job_mean", slow_sync)
    run_dir = tmp_path / f"prefetch-{prefetch}"
    cfg = tiny_config(
        f"--data.prefetch={prefetch}",
        "--training.steps=8",
        "--training.micro_batch_size=4",  # one micro-batch, so one data span, per step
        "--training.val_every=100",
        "--checkpoint.enabled=false",
        run_dir=run_dir,
    )
    Trainer(cfg).train()
    assert data_threads() == []
    (trace,) = run_dir.glob("traces/*/rank-00000.json")
    waits = [event["dur"] / 1e6 for event in read_trace(trace) if event.get("name") == "data"]
    assert len(waits) == 8
    median = statistics.median(waits[1:])  # the first step has nothing prepared yet
    print(f"prefetch={prefetch}: median data wait {median * 1e3:.1f} ms a step, delay {DELAY_S * 1e3:.0f} ms")
    if prefetch:
        assert median < 0.25 * DELAY_S
    else:
        assert median > 0.75 * DELAY_S
