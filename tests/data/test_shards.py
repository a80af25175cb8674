"""TokenShards: reading across shards, and every kind of damage caught by open()."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from megascale.data import prepare as prepare_module
from megascale.data.prepare import prepare_dataset
from megascale.data.shards import TokenShards
from megascale.errors import DataError


@pytest.fixture
def dataset_dir(tmp_path, cfg_for, text_dir, monkeypatch):
    monkeypatch.setattr(prepare_module, "SHARD_TOKENS", 400)
    return prepare_dataset(cfg_for(text_dir[0]), out_dir=tmp_path / "dataset", progress=False)


def _raw_stream(dataset_dir) -> np.ndarray:
    meta = json.loads((dataset_dir / "meta.json").read_text())
    return np.concatenate([np.fromfile(dataset_dir / e["tokens_file"], dtype="<u2") for e in meta["shards"]])


def _rewrite_meta(dataset_dir, edit) -> None:
    meta = json.loads((dataset_dir / "meta.json").read_text())
    edit(meta)
    (dataset_dir / "meta.json").write_text(json.dumps(meta))


def test_tokens_cross_shard_boundaries(dataset_dir):
    shards = TokenShards.open(dataset_dir)
    assert len(shards.shards) >= 3
    stream = _raw_stream(dataset_dir)
    assert shards.num_tokens == len(stream)
    boundary = int(shards.shard_starts[1])
    for start, stop in [(0, 10), (boundary - 5, boundary + 5), (0, len(stream)), (boundary, boundary)]:
        piece = shards.tokens(start, stop)
        assert piece.dtype == np.int64
        assert np.array_equal(piece, stream[start:stop])
    assert shards.doc_ends[-1] == len(stream)
    assert np.all(stream[shards.doc_ends - 1] == shards.eos_id)


def test_truncated_shard(dataset_dir):
    path = dataset_dir / "shard-00001.tokens"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-6])
    with pytest.raises(DataError) as error:
        TokenShards.open(dataset_dir, verify=False)  # sizes are checked even without verify
    assert str(error.value) == (
        f"data: shard {path} is truncated ({size - 6} bytes, meta.json says {size}); "
        f"delete {dataset_dir} and run `megascale prepare` again"
    )


def test_corrupt_byte_of_same_size(dataset_dir):
    path = dataset_dir / "shard-00000.tokens"
    data = bytearray(path.read_bytes())
    data[7] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard-00000\.tokens is corrupt \(its sha256 differs"):
        TokenShards.open(dataset_dir)
    assert TokenShards.open(dataset_dir, verify=False).num_tokens > 0  # verify=False trusts the bytes


def test_missing_files(dataset_dir):
    (dataset_dir / "shard-00001.docs").unlink()
    with pytest.raises(DataError, match=r"shard-00001\.docs is missing"):
        TokenShards.open(dataset_dir)
    (dataset_dir / "meta.json").unlink()
    with pytest.raises(DataError, match=r"has no meta\.json"):
        TokenShards.open(dataset_dir)


def test_token_id_out_of_vocabulary(dataset_dir):
    path = dataset_dir / "shard-00000.tokens"
    tokens = np.fromfile(path, dtype="<u2")
    tokens[3] = 300
    tokens.tofile(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    _rewrite_meta(dataset_dir, lambda meta: meta["shards"][0].update(tokens_sha256=digest))
    with pytest.raises(DataError, match=r"has token id 300, not below vocab_size 257"):
        TokenShards.open(dataset_dir)


def test_inconsistent_document_index(dataset_dir):
    path = dataset_dir / "shard-00000.docs"
    ends = np.fromfile(path, dtype="<i8")
    ends[0], ends[1] = ends[1], ends[0]
    ends.tofile(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    _rewrite_meta(dataset_dir, lambda meta: meta["shards"][0].update(docs_sha256=digest))
    with pytest.raises(DataError, match=r"document index .*shard-00000\.docs is inconsistent"):
        TokenShards.open(dataset_dir)


def test_newer_format_is_refused(dataset_dir):
    _rewrite_meta(dataset_dir, lambda meta: meta.update(format_version=99))
    with pytest.raises(DataError, match=r"format_version 99 but this megascale reads up to 1"):
        TokenShards.open(dataset_dir)
