"""SequenceSampler: determinism, resume, epoch rollover and data-parallel sharding of one stream."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.stateful import Stateful

from megascale.data.sampler import SequenceSampler


def _take(sampler, steps):
    return [next(sampler) for _ in range(steps)]


def _reference_stream(num_sequences, seed, length):
    """Global positions 0..length-1 mapped exactly as documented, written independently."""
    stream = []
    for position in range(length):
        epoch, offset = divmod(position, num_sequences)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        stream.append(int(torch.randperm(num_sequences, generator=generator)[offset]))
    return stream


def test_matches_documented_stream_and_is_deterministic():
    sampler = SequenceSampler(num_sequences=23, seed=5, micro_batch_size=4)
    batches = _take(sampler, 20)  # 80 positions: three epochs and a bit
    assert [i for b in batches for i in b] == _reference_stream(23, 5, 80)
    assert _take(SequenceSampler(23, 5, 4), 20) == batches
    assert _take(SequenceSampler(23, 6, 4), 20) != batches
    assert isinstance(sampler, Stateful)


def test_each_epoch_is_a_permutation():
    sampler = SequenceSampler(num_sequences=12, seed=0, micro_batch_size=3)
    epochs = [sorted(i for b in _take(sampler, 4) for i in b) for _ in range(3)]
    assert epochs == [list(range(12))] * 3
    assert sampler.epoch == 3
    sampler = SequenceSampler(num_sequences=12, seed=0, micro_batch_size=3)
    first, second = [i for b in _take(sampler, 4) for i in b], [i for b in _take(sampler, 4) for i in b]
    assert first != second  # a new order each epoch


def test_resume_mid_epoch_continues_identically():
    uninterrupted = SequenceSampler(num_sequences=50, seed=3, micro_batch_size=4, dp_rank=1, dp_size=2)
    expected = _take(uninterrupted, 30)

    first_run = SequenceSampler(50, 3, 4, dp_rank=1, dp_size=2)
    _take(first_run, 7)  # 56 positions: mid-way through epoch 1
    state = first_run.state_dict()
    assert state == {"consumed_sequences": 56}
    resumed = SequenceSampler(50, 3, 4, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    assert _take(resumed, 23) == expected[7:]


def test_data_parallel_ranks_split_the_single_rank_stream():
    single = _take(SequenceSampler(num_sequences=37, seed=11, micro_batch_size=3), 40)
    rank0 = _take(SequenceSampler(37, 11, 3, dp_rank=0, dp_size=2), 20)
    rank1 = _take(SequenceSampler(37, 11, 3, dp_rank=1, dp_size=2), 20)
    for step in range(20):
        assert rank0[step] == single[2 * step] and rank1[step] == single[2 * step + 1]
        # within one epoch's worth of a step the two ranks never share a sequence
        positions = range(step * 6, step * 6 + 6)
        if len({p // 37 for p in positions}) == 1:
            assert not set(rank0[step]) & set(rank1[step])
    assert [i for step in zip(rank0, rank1) for b in step for i in b] == [i for b in single for i in b]


def test_resume_under_another_layout():
    """The state is the global position, so 2 ranks can resume a 1-rank run (same global batch)."""
    single = SequenceSampler(num_sequences=40, seed=2, micro_batch_size=4)
    _take(single, 10)
    expected = [i for b in _take(SequenceSampler(40, 2, 4), 30)[10:] for i in b]
    state = single.state_dict()
    ranks = [SequenceSampler(40, 2, 2, dp_rank=r, dp_size=2) for r in range(2)]
    for rank in ranks:
        rank.load_state_dict(state)
    resumed = [i for _ in range(20) for rank in ranks for i in next(rank)]
    assert resumed == expected
