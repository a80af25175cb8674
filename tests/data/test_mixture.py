"""Mixtures of prepared sources: the schedule's proportions and determinism, data-parallel shares, loaders."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import make_documents, write_jsonl, write_text_dir

from megascale.data import build_dataloaders
from megascale.data.mixture import BLOCK, MixtureSampler, MixtureSchedule
from megascale.errors import ConfigError, DataError


def sources_of(schedule: MixtureSchedule, start: int, stop: int) -> np.ndarray:
    return np.array([schedule.locate(position)[0] for position in range(start, stop)])


@pytest.mark.parametrize("weights", [(0.7, 0.3), (1, 3), (0.5, 0.5)])
def test_two_sources_proportions_are_within_2_percent_of_the_weights_over_1000_samples(weights):
    schedule = MixtureSchedule(weights, seed=0)
    shares = np.bincount(sources_of(schedule, 0, 1000), minlength=2) / 1000
    expected = np.asarray(weights) / sum(weights)
    assert np.all(np.abs(shares - expected) <= 0.02), (shares, expected)
    for seed in range(1, 6):  # any seed and any window, not one lucky draw
        for start in (37, 12_345, 10**9 + 7):
            window = sources_of(MixtureSchedule(weights, seed), start, start + 1000)
            assert np.all(np.abs(np.bincount(window, minlength=2) / 1000 - expected) <= 0.02)


def test_the_schedule_converges_for_any_weights_and_numbers_each_sources_positions():
    weights = (0.6, 0.3, 0.0996, 0.0004)
    schedule = MixtureSchedule(weights, seed=3)
    assert 20_000 % BLOCK == 0
    sources = sources_of(schedule, 0, 20_000)
    counts = np.bincount(sources, minlength=4)
    assert np.all(np.abs(counts - 20_000 * np.asarray(weights)) <= 1), counts  # exact at block ends
    assert counts[3] == 8  # a tiny weight still gets its share
    for source in range(4):  # the k-th position of a source is numbered k
        indices = [schedule.locate(p)[1] for p in np.flatnonzero(sources == source)]
        assert indices == list(range(counts[source]))
    orders = [sources_of(MixtureSchedule(weights, seed), 0, 1000) for seed in (3, 4)]
    assert not np.array_equal(*orders)  # seeded: another seed, another order


def test_the_schedule_is_a_pure_function_of_the_position():
    """A resumed run (a fresh schedule asked from the middle) continues the same schedule."""
    walked = MixtureSchedule((0.7, 0.3), seed=5)
    expected = [walked.locate(p) for p in range(5 * BLOCK)]
    jumped = MixtureSchedule((0.7, 0.3), seed=5)
    assert [jumped.locate(p) for p in range(3 * BLOCK + 17, 5 * BLOCK)] == expected[3 * BLOCK + 17 :]
    assert [jumped.locate(p) for p in range(0, 40)] == expected[:40]


@pytest.mark.parametrize("dp_size", [2, 4])
def test_data_parallel_ranks_never_read_the_same_sample(dp_size):
    sizes, micro_batch = [37, 23], 3
    one = MixtureSampler(sizes, (0.7, 0.3), seed=1, micro_batch_size=micro_batch)
    ranks = [MixtureSampler(sizes, (0.7, 0.3), 1, micro_batch, rank, dp_size) for rank in range(dp_size)]
    steps = 10
    stream = one.indices_at(0, steps * micro_batch * dp_size)
    taken = []
    for step in range(steps):
        for rank, sampler in enumerate(ranks):
            mine = next(sampler)
            begin = (step * dp_size + rank) * micro_batch
            assert mine == stream[begin : begin + micro_batch]  # its own slice of the one-rank stream
            taken += mine
    assert taken == stream  # every sample of the stream is read by exactly one rank
    for source, size in enumerate(sizes):  # and no sequence twice within its source's epoch
        first_epoch = [i for i in taken if (i < sizes[0]) == (source == 0)][:size]
        assert len(set(first_epoch)) == len(first_epoch) > size // 2


def test_a_mixture_of_prepared_sources_trains_in_its_weights(tmp_path, cfg_for):
    code = write_text_dir(tmp_path / "code", make_documents(60, seed=1))
    prose = write_jsonl(tmp_path / "prose.jsonl", [d.upper() for d in make_documents(60, seed=2)])
    cfg = cfg_for("unused", mixture=f"{code}=0.75, json:{prose}=0.25", seq_len=8, prefetch=0)
    train, val = build_dataloaders(cfg, model_vocab_size=264, micro_batch_size=8, seed=0, progress=False)
    try:
        rows = np.concatenate([next(train)[0].numpy() for _ in range(100)])
        upper = sum(
            bool(bytes(row[(row < 256)].astype(np.uint8)).decode(errors="ignore").isupper()) for row in rows
        )
        lower = sum(
            bool(bytes(row[(row < 256)].astype(np.uint8)).decode(errors="ignore").islower()) for row in rows
        )
        assert abs(upper / (upper + lower) - 0.25) < 0.03, (upper, lower)
        state = train.state_dict()
        assert state == {"consumed_sequences": 800}  # the position alone, as for one source
        assert val.num_sequences > 0 and len(val.share(10)) == 2
    finally:
        train.close()


def test_a_mixture_refuses_a_bpe_per_source_and_sources_of_other_tokenizers(tmp_path, cfg_for):
    first = write_text_dir(tmp_path / "a", make_documents(10))
    second = write_text_dir(tmp_path / "b", make_documents(10, seed=3))
    cfg = cfg_for("unused", mixture=f"{first}=1, {second}=1", tokenizer="bpe")
    with pytest.raises(ConfigError, match=r"data\.tokenizer = 'bpe' would train one tokenizer per source"):
        build_dataloaders(cfg, model_vocab_size=9000, micro_batch_size=2, seed=0, progress=False)
    from megascale.data import prepare_dataset

    bpe = prepare_dataset(cfg_for(second, tokenizer="bpe", bpe_vocab_size=300), progress=False)
    mixed = cfg_for("unused", mixture=f"{first}=1, {bpe}=1")
    with pytest.raises(DataError, match=r"data\.mixture entry .* is prepared with another tokenizer"):
        build_dataloaders(mixed, model_vocab_size=512, micro_batch_size=2, seed=0, progress=False)
