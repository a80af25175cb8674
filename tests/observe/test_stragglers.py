"""Stragglers: the detector on made-up compute times, and a rank slowed 1.5x in a real 4-process run."""

import random

import pytest

from megascale.observe.metrics import read_metrics
from megascale.observe.stragglers import StragglerDetector
from tests.conftest import train_processes


def noisy(rng, seconds):
    return seconds * rng.uniform(0.8, 1.2)


def test_a_rank_persistently_slower_than_its_peers_is_named_once():
    rng = random.Random(0)
    detector = StragglerDetector([0, 0, 0, 0], window=10, ratio=1.3)
    findings = [
        detector.observe([noisy(rng, 0.1 * (1.5 if r == 2 else 1)) for r in range(4)]) for _ in range(40)
    ]
    named = [finding for step in findings for finding in step]
    assert [finding["rank"] for finding in named] == [2] and 1.3 < named[0]["ratio"] < 1.8
    assert next(step for step, found in enumerate(findings) if found) == 9  # once the window is full
    assert detector.stragglers() == [2]


def test_noise_and_single_slow_steps_name_no_one():
    rng = random.Random(1)
    detector = StragglerDetector([0, 0, 0, 0], window=10, ratio=1.3)
    for step in range(200):
        times = [noisy(rng, 0.1) for _ in range(4)]
        if step % 7 == 0:
            times[step % 4] *= 3  # one slow step now and then (a GC pause, a page fault)
        assert detector.observe(times) == []


def test_ranks_are_compared_with_the_ranks_of_their_own_pipeline_stage():
    detector = StragglerDetector([0, 0, 1, 1], window=4, ratio=1.3)
    # The last stage computes the output layer: 2x the first stage's work, alike on both of its ranks.
    for _ in range(4):
        findings = detector.observe([0.1, 0.1, 0.2, 0.2])
    assert findings == [] and detector.stragglers() == []


@pytest.mark.slow
@pytest.mark.parametrize("slowed", [None, 2])
def test_a_rank_slowed_by_half_is_named_and_only_then(tiny_corpus, tmp_path, slowed):
    run_dir = train_processes(
        4,
        tiny_corpus,
        tmp_path,
        "--parallel.dp_shard=4",
        "--training.global_batch_size=8",
        "--training.micro_batch_size=2",
        "--training.steps=30",
        "--training.val_every=100",
        "--checkpoint.enabled=false",
        "--metrics.straggler_window=10",
        *([f"--resilience.inject=slow:rank={slowed}:factor=1.5"] if slowed is not None else []),
    )
    records = read_metrics(run_dir)
    named = sorted({rank for record in records for rank in record.get("stragglers", [])})
    log = (run_dir / "train.log").read_text()
    print(f"slowed {slowed}: named {named}; last compute times {records[-1]['rank_compute_s']}")
    assert named == ([slowed] if slowed is not None else [])
    assert ("straggler: rank 2 computes" in log) == (slowed is not None)
