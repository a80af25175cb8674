"""Document split and sequence packing, checked against a token stream read with plain numpy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megascale.data import prepare as prepare_module
from megascale.data.dataset import PackedSequences, split_by_documents
from megascale.data.prepare import prepare_dataset
from megascale.data.shards import TokenShards
from megascale.errors import DataError


@pytest.mark.parametrize(
    ("num_documents", "val_fraction", "num_val"),
    [
        (10, 0.1, 1),
        (10, 0.25, 3),
        (10, 0.0, 0),
        (1, 0.5, 0),
        (2, 0.01, 1),
        (2, 0.99, 1),
        (100, 0.07, 7),
        (1000, 0.001, 1),
    ],
)
def test_split_sizes(num_documents, val_fraction, num_val):
    doc_ends = np.cumsum(np.full(num_documents, 5))
    split = split_by_documents(doc_ends, val_fraction)
    assert split.num_val_documents == num_val
    assert split.num_train_documents == num_documents - num_val
    assert split.train_tokens == (0, 5 * (num_documents - num_val))
    assert split.val_tokens == (5 * (num_documents - num_val), 5 * num_documents)


def _reference(dataset_dir):
    """The whole token stream and its documents, from the raw files (independent of TokenShards)."""
    meta = json.loads((dataset_dir / "meta.json").read_text())
    files = [dataset_dir / entry["tokens_file"] for entry in meta["shards"]]
    stream = np.concatenate([np.fromfile(path, dtype="<u2") for path in files])
    documents, current = [], []
    for token in stream.tolist():
        current.append(token)
        if token == meta["eos_id"]:
            documents.append(current)
            current = []
    assert current == []  # the stream ends with EOS
    return stream.astype(np.int64), documents


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64])
def test_packing_reconstructs_the_stream(tmp_path, cfg_for, text_dir, monkeypatch, seq_len):
    monkeypatch.setattr(prepare_module, "SHARD_TOKENS", 300)
    dataset_dir = prepare_dataset(cfg_for(text_dir[0]), out_dir=tmp_path / "ds", progress=False)
    stream, documents = _reference(dataset_dir)
    shards = TokenShards.open(dataset_dir)
    assert len(shards.shards) > 3
    split = split_by_documents(shards.doc_ends, 0.1)
    num_val = 4  # ceil(0.1 * 40)
    train_tokens = sum(len(d) for d in documents[:-num_val])
    assert split.train_tokens == (0, train_tokens)
    assert split.val_tokens == (train_tokens, len(stream))

    for (start, stop), name in [(split.train_tokens, "training"), (split.val_tokens, "validation")]:
        sequences = PackedSequences(shards, (start, stop), seq_len, name, 1)
        assert sequences.num_sequences == (stop - start - 1) // seq_len
        inputs, labels = sequences.batch(range(sequences.num_sequences))
        assert inputs.dtype == labels.dtype == torch.int64
        assert inputs.shape == labels.shape == (sequences.num_sequences, seq_len)
        covered = sequences.num_sequences * seq_len
        assert np.array_equal(inputs.reshape(-1).numpy(), stream[start : start + covered])
        assert np.array_equal(labels.reshape(-1).numpy(), stream[start + 1 : start + covered + 1])
        assert stop - (start + covered + 1) < seq_len  # only a partial sequence is left over


def test_validation_is_the_last_documents(tmp_path, cfg_for, text_dir):
    dataset_dir = prepare_dataset(cfg_for(text_dir[0]), out_dir=tmp_path / "ds", progress=False)
    stream, documents = _reference(dataset_dir)
    shards = TokenShards.open(dataset_dir)
    split = split_by_documents(shards.doc_ends, 0.25)
    assert split.num_val_documents == 10
    start, stop = split.val_tokens
    assert stream[start:stop].tolist() == [t for d in documents[-10:] for t in d]
    assert stream[start - 1] == shards.eos_id  # the training split ends with a whole document


def test_too_little_data_for_one_sequence(tmp_path, cfg_for, text_dir):
    shards = TokenShards.open(prepare_dataset(cfg_for(text_dir[0]), out_dir=tmp_path / "ds", progress=False))
    with pytest.raises(DataError) as error:
        PackedSequences(shards, (0, 100), 100, "validation", 2)
    assert str(error.value).startswith(
        f"data: the validation split of {shards.directory} has 100 tokens "
        "(2 documents) but data.seq_len = 100 needs at least 101; lower"
    )
    assert PackedSequences(shards, (0, 101), 100, "validation", 2).num_sequences == 1
