"""Stragglers: the detector on made-up compute times (and expert loads), and a rank slowed 1.5x in a real
4-process run."""

import random

import pytest

from megascale.observe.metrics import read_metrics
from megascale.observe.report import ROUTING_LINE, STRAGGLER_LINE
from megascale.observe.stragglers import StragglerDetector, describe
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


# Expert parallelism, ep 4: rank 1's experts take 1.6x the mean load, the others 0.8x. With half the
# compute in the routed experts (f = 0.5), rank 1 should compute (0.5 + 0.8) / (0.5 + 0.4) = 1.44x its peers.
SLOTS = [80, 160, 80, 80]
ROUTING_EXPLAINS = (0.5 + 0.5 * 1.6) / (0.5 + 0.5 * 0.8)


def expert_run(slowdown: list[float], slots=SLOTS, steps: int = 30, seed: int = 0):
    """Every step's findings of a detector (window 10, ratio 1.3, f 0.5) over 4 ranks whose compute is
    0.05 s plus 0.0005 s per slot of their experts, times `slowdown` (a slower machine), ±20% noise."""
    rng = random.Random(seed)
    detector = StragglerDetector([0, 0, 0, 0], window=10, ratio=1.3, expert_share=0.5)
    findings = []
    for _ in range(steps):
        loads = [slot * rng.uniform(0.9, 1.1) for slot in slots]
        compute = [noisy(rng, (0.05 + 0.0005 * load) * slow) for load, slow in zip(loads, slowdown)]
        findings += detector.observe(compute, loads)
    return detector, findings


def test_a_rank_busy_because_its_experts_are_popular_is_reported_as_routing_not_named():
    detector, findings = expert_run([1, 1, 1, 1])
    assert detector.stragglers() == []
    [finding] = findings  # once per episode
    assert finding["rank"] == 1 and not finding["straggler"]
    assert 1.3 < finding["ratio"] < ROUTING_EXPLAINS * 1.3 and finding["explained"] > 1.3
    assert finding["load"] == pytest.approx(1.6, abs=0.1)
    message = describe(finding, window=10, step=10)
    assert STRAGGLER_LINE.search(message) is None  # the report lists no straggler from it
    assert ROUTING_LINE.search(message)[1] == "1"
    assert "its experts took 1.6" in message and "routing imbalance, not the machine" in message


def test_a_slow_machine_is_named_whether_its_experts_are_popular_or_not():
    # Rank 1, whose experts are popular, on a machine 1.6x slower: more than its load explains.
    detector, findings = expert_run([1, 1.6, 1, 1])
    assert detector.stragglers() == [1] and [f["rank"] for f in findings] == [1]
    message = describe(findings[0], window=10, step=10)
    assert STRAGGLER_LINE.search(message)[1] == "1"  # the report's regex reads it as before
    assert "; its experts took 1.6" in message and "the rest is the machine" in message
    # Rank 2, whose experts are idle half the time, 1.5x slower: a light load never lowers the bar, so
    # it is named as it would be without expert parallelism.
    detector, findings = expert_run([1, 1, 1.5, 1])
    assert detector.stragglers() == [2]
    assert [(f["rank"], f["straggler"]) for f in findings] == [(1, False), (2, True)]
    message = describe(findings[1], window=10, step=10)
    assert message.startswith("straggler: rank 2 computes") and "its experts" not in message


def test_an_even_expert_load_leaves_the_detector_as_it_was():
    detector, findings = expert_run([1, 1, 1.5, 1], slots=[100, 100, 100, 100])
    assert [(f["rank"], f["straggler"]) for f in findings] == [(2, True)]
    assert findings[0]["explained"] == pytest.approx(1.0, abs=0.05)  # the loads' ±10% noise only
    detector, findings = expert_run([1, 1, 1, 1], slots=[100, 100, 100, 100], steps=200, seed=3)
    assert findings == []


@pytest.mark.slow
@pytest.mark.alone  # ranks compared by their pace: no other test's load beside it
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
