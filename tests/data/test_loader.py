"""build_dataloaders: shapes, vocabulary check, fixed validation batches, resumable training stream."""

from __future__ import annotations

import pytest
import torch

from megascale.data import build_dataloaders
from megascale.data.dataset import IGNORE_INDEX
from megascale.data.tokenizer import ByteTokenizer
from megascale.errors import DataError


def test_loaders_yield_packed_int64_batches(cfg_for, text_dir):
    train, val = build_dataloaders(
        cfg_for(text_dir[0]), model_vocab_size=264, micro_batch_size=4, seed=0, progress=False
    )
    inputs, labels = next(train)
    assert inputs.shape == labels.shape == (4, 16)
    assert inputs.dtype == labels.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert isinstance(train.tokenizer, ByteTokenizer) and train.dataset_dir == val.dataset_dir
    assert train.num_tokens + val.num_tokens == sum(len(t.encode()) + 1 for t in text_dir[1])
    assert train.dataset_dir.is_dir() and train.num_sequences == (train.num_tokens - 1) // 16
    train.close()


def test_tokenizer_larger_than_model_vocab(cfg_for, text_dir):
    with pytest.raises(DataError) as error:
        build_dataloaders(
            cfg_for(text_dir[0]), model_vocab_size=200, micro_batch_size=2, seed=0, progress=False
        )
    message = str(error.value)
    assert message.startswith("data: tokenizer of ") and message.endswith(
        "has 257 tokens but model.vocab_size = 200; set --model.vocab_size=257 (or a larger multiple of 8)"
    )


def test_validation_batches_are_fixed_and_wrap(cfg_for, text_dir):
    _, val = build_dataloaders(
        cfg_for(text_dir[0], val_fraction=0.2, seq_len=8),
        model_vocab_size=257,
        micro_batch_size=3,
        seed=0,
        progress=False,
    )
    many = 3 * val.num_sequences  # more sequences than the split holds: indices wrap
    first = val.share(many)
    assert len(first) == val.num_sequences
    again = val.share(many)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    inputs = torch.cat([batch[0] for batch in first])
    labels = torch.cat([batch[1] for batch in first])
    count = val.num_sequences
    assert torch.equal(inputs[count], inputs[0])  # wrapped to the start
    assert torch.equal(labels[: count - 1, -1], inputs[1:count, 0])  # consecutive sequences, in order


def test_validation_shares_hold_each_sequence_once_and_pad_to_whole_units(cfg_for, text_dir):
    """7 sequences over 3 ranks in micro-batches of 2, the unit 2 micro-batches (a pipeline's step): each
    rank gets 3 sequences and a padded unit of 4 slots; the padding's labels are all ignored, and the real
    sequences, rank by rank, are the first 7 in order."""
    _, val = build_dataloaders(
        cfg_for(text_dir[0], val_fraction=0.2, seq_len=8),
        model_vocab_size=257,
        micro_batch_size=2,
        seed=0,
        progress=False,
    )
    one_rank = torch.cat([labels for _, labels in val.share(8)])[:7]
    shares = [val.share(7, rank, 3, unit=2) for rank in range(3)]
    assert [len(share) for share in shares] == [2, 2, 2]
    labels = [torch.cat([batch[1] for batch in share]) for share in shares]
    real = [rows[(rows != IGNORE_INDEX).all(dim=1)] for rows in labels]
    assert [len(rows) for rows in real] == [3, 3, 1]
    assert all(
        ((rows == IGNORE_INDEX).all(dim=1) | (rows != IGNORE_INDEX).all(dim=1)).all() for rows in labels
    )
    assert torch.equal(torch.cat(real), one_rank)


def test_no_validation_when_fraction_is_zero(cfg_for, text_dir):
    _, val = build_dataloaders(
        cfg_for(text_dir[0], val_fraction=0.0),
        model_vocab_size=257,
        micro_batch_size=2,
        seed=0,
        progress=False,
    )
    assert val.num_sequences == 0 and val.share(4) == []


def test_validation_split_too_small(cfg_for, text_dir):
    with pytest.raises(DataError, match=r"validation split .* needs at least 4001; lower --data\.seq_len"):
        build_dataloaders(
            cfg_for(text_dir[0], val_fraction=0.05, seq_len=4000),
            model_vocab_size=257,
            micro_batch_size=2,
            seed=0,
            progress=False,
        )


def test_train_loader_resumes_from_its_state(cfg_for, text_dir):
    cfg = cfg_for(text_dir[0], seq_len=128)
    train, _ = build_dataloaders(cfg, model_vocab_size=257, micro_batch_size=2, seed=4, progress=False)
    expected = [next(train) for _ in range(120)]  # several epochs: iteration never ends

    interrupted, _ = build_dataloaders(cfg, model_vocab_size=257, micro_batch_size=2, seed=4, progress=False)
    for _ in range(45):
        next(interrupted)
    state = interrupted.state_dict()
    resumed, _ = build_dataloaders(cfg, model_vocab_size=257, micro_batch_size=2, seed=4, progress=False)
    resumed.load_state_dict(state)
    for inputs, labels in expected[45:]:
        got_inputs, got_labels = next(resumed)
        assert torch.equal(got_inputs, inputs) and torch.equal(got_labels, labels)
    assert resumed.epoch >= 2
    for loader in (train, interrupted, resumed):
        loader.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_shard_overwritten_under_a_live_run_stops_it_before_the_next_step(cfg_for, text_dir, prefetch):
    """The shards are mapped, not copied: bytes written into one mid-run would change the batches from
    then on with no warning. The next batch read from it is refused instead, naming the shard."""
    train, _ = build_dataloaders(
        cfg_for(text_dir[0], prefetch=prefetch), model_vocab_size=264, micro_batch_size=2, seed=0,
        progress=False,
    )  # fmt: skip
    next(train)
    (shard,) = sorted(train.dataset_dir.glob("shard-*.tokens"))
    with open(shard, "r+b") as file:
        file.write(b"\x01\x00" * 64)
    with pytest.raises(DataError, match=rf"shard {shard} was changed or removed while this run read it"):
        for _ in range(train.num_sequences):  # a whole epoch reads every shard
            next(train)
    train.close()
