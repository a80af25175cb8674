"""Streaming mode: documents read in order, packed as prepared data is, resumable to the exact sample, shared
out disjointly over data-parallel ranks, mixed by weight, validated on held-out documents."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from data_helpers import make_documents, write_jsonl, write_parquet_parts

from megascale.data import build_dataloaders
from megascale.data.packing import held_out
from megascale.errors import ConfigError, DataError

pytest.importorskip("datasets")
EOS = 256


@pytest.fixture
def parquet_source(tmp_path) -> tuple[str, list[str]]:
    documents = make_documents(60)
    write_parquet_parts(tmp_path / "pq", documents, parts=3)
    return f"parquet:{tmp_path / 'pq'}/*.parquet", documents


def joined(documents: list[str]) -> np.ndarray:
    """Documents as the byte tokenizer tokenizes them, each followed by EOS, joined."""
    return np.concatenate(
        [np.append(np.frombuffer(d.encode(), np.uint8).astype(np.int64), EOS) for d in documents]
    )


def loaders(cfg, dp_rank=0, dp_size=1, micro_batch_size=2, seed=0):
    return build_dataloaders(
        cfg,
        model_vocab_size=264,
        micro_batch_size=micro_batch_size,
        seed=seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


def take(loader, count: int) -> list[torch.Tensor]:
    """`count` batches' inputs and labels, side by side as [micro_batch, 2, seq_len]."""
    return [torch.stack(next(loader), dim=1) for _ in range(count)]


def test_held_out_documents_are_every_nth():
    assert [d for d in range(400) if held_out(d, 0.01)] == [99, 199, 299, 399]
    assert [d for d in range(10) if held_out(d, 0.25)] == [3, 7]
    assert not any(held_out(d, 0.0) for d in range(100))


def test_streamed_sequences_are_the_training_documents_packed_as_prepared_data_is(parquet_source, cfg_for):
    source, documents = parquet_source
    cfg = cfg_for(source, streaming=True, prefetch=0, val_fraction=0.1)
    train, val = loaders(cfg, micro_batch_size=1)
    try:
        training = [d for i, d in enumerate(documents) if not held_out(i, 0.1)]
        stream = np.tile(joined(training), 3)  # epochs follow one another
        length = len(joined(training))
        rows = [next(train)[0][0] for _ in range(2 * length // 16)]  # two epochs' worth
        for i, inputs in enumerate(rows):
            assert inputs.tolist() == stream[i * 16 : i * 16 + 16].tolist()
        assert train.epoch == 1
        held = joined([d for i, d in enumerate(documents) if held_out(i, 0.1)])
        (inputs, labels), *_ = val.share(4)
        assert inputs[0].tolist() == held[:16].tolist() and labels[0].tolist() == held[1:17].tolist()
        count = (len(held) - 1) // 16
        batches = val.share(count + 1)  # one more than the held-out documents fill: it repeats the first
        assert torch.equal(batches[count][0], batches[0][0]) and not torch.equal(batches[1][0], batches[0][0])
        assert val.sequences.num_sequences == count  # all of them, read to the end (as `megascale eval` asks)
    finally:
        train.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_restored_state_continues_with_exactly_the_same_batches(parquet_source, cfg_for, prefetch):
    source, _ = parquet_source
    cfg = cfg_for(source, streaming=True, prefetch=prefetch)
    train, _ = loaders(cfg)
    try:
        states, batches = [], []
        for _ in range(120):  # past an epoch (~100 batches), through documents cut mid-way
            states.append(train.state_dict())
            batches.append(torch.stack(next(train), dim=1))
    finally:
        train.close()
    for at in (1, 7, 45, 99, 101):
        resumed, _ = loaders(dataclasses.replace(cfg, prefetch=2 - prefetch))  # prefetch toggled too
        try:
            resumed.load_state_dict(states[at])
            assert all(torch.equal(a, b) for a, b in zip(take(resumed, 12), batches[at : at + 12]))
        finally:
            resumed.close()


@pytest.mark.parametrize("dp_size", [2, 4])
def test_data_parallel_ranks_read_disjoint_slices_of_one_stream(parquet_source, cfg_for, dp_size):
    source, _ = parquet_source
    cfg = cfg_for(source, streaming=True, prefetch=1)
    one, _ = loaders(cfg, micro_batch_size=2 * dp_size)
    ranks = [loaders(cfg, dp_rank=rank, dp_size=dp_size)[0] for rank in range(dp_size)]
    try:
        for _ in range(30):
            everyone = torch.stack(next(one), dim=1)
            shares = [torch.stack(next(rank), dim=1) for rank in ranks]
            assert torch.equal(torch.cat(shares), everyone)  # rank r: its slice; no sample on two ranks
        state = ranks[0].state_dict()
        assert all(rank.state_dict() == state for rank in ranks)  # one global state, as DCP keeps it
        assert state == one.state_dict()
    finally:
        for loader in (one, *ranks):
            loader.close()


def test_a_streamed_mixture_keeps_its_weights_and_resumes(tmp_path, cfg_for):
    write_parquet_parts(tmp_path / "pq", make_documents(50), parts=2)
    upper = write_jsonl(tmp_path / "upper.jsonl", [d.upper() for d in make_documents(40, seed=5)])
    mixture = f"parquet:{tmp_path / 'pq'}/*.parquet=0.7\njson:{upper}=0.3"
    cfg = cfg_for("unused", streaming=True, mixture=mixture, seq_len=8, prefetch=1)
    train, val = loaders(cfg, micro_batch_size=10)
    try:
        batches = take(train, 100)
        state = train.state_dict()
        after = take(train, 5)
    finally:
        train.close()
    rows = torch.cat(batches)[:, 0]
    letters = [bytes([t for t in row.tolist() if 65 <= t <= 122]).decode() for row in rows]
    shouting = sum(text.isupper() for text in letters if text.isalpha())
    assert abs(shouting / sum(text.isalpha() for text in letters) - 0.3) < 0.03
    resumed, _ = loaders(cfg, micro_batch_size=10)
    try:
        resumed.load_state_dict(state)
        assert all(torch.equal(a, b) for a, b in zip(take(resumed, 5), after))
    finally:
        resumed.close()
    assert val.num_sequences > 0 and len(val.share(4)) == 1


def test_streaming_refuses_what_it_cannot_read_or_resume(tmp_path, parquet_source, cfg_for):
    source, _ = parquet_source
    with pytest.raises(ConfigError, match=r"data\.source = '/texts' cannot be streamed.*'json:/texts'"):
        loaders(cfg_for("/texts", streaming=True))
    with pytest.raises(ConfigError, match=r"data\.tokenizer = 'bpe' is trained on the whole corpus first"):
        loaders(cfg_for(source, streaming=True, tokenizer="bpe"))
    with pytest.raises(DataError, match=r"is not a field of data\.source .* it has 'text', 'id'"):
        train, _ = loaders(cfg_for(source, streaming=True, text_field="body"))
    train, _ = loaders(cfg_for(source, streaming=True))
    next(train)
    state = train.state_dict()
    train.close()
    write_parquet_parts(tmp_path / "pq", make_documents(61), parts=3)  # the files changed
    changed, _ = loaders(cfg_for(source, streaming=True))
    with pytest.raises(DataError, match=r"the files of data\.source = .* changed since the checkpoint"):
        changed.load_state_dict(state)
    changed.close()
    write_parquet_parts(tmp_path / "none", [], parts=1)
    empty, _ = loaders(cfg_for(f"parquet:{tmp_path / 'none'}/*.parquet", streaming=True, prefetch=0))
    with pytest.raises(DataError, match=r"has no training documents"):
        next(empty)
    empty.close()


def test_without_a_validation_fraction_nothing_is_held_out(parquet_source, cfg_for):
    source, documents = parquet_source
    train, val = loaders(cfg_for(source, streaming=True, prefetch=0, val_fraction=0.0), micro_batch_size=1)
    try:
        assert val.num_sequences == 0 and val.share(4) == []
        stream = joined(documents)  # every document, 9, 19, ... too
        for i in range((len(stream) - 1) // 16):
            assert next(train)[0][0].tolist() == stream[i * 16 : i * 16 + 16].tolist()
    finally:
        train.close()
