"""prepare_dataset: shard layout, cache hits, atomic output, and the real stdlib corpus."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from data_helpers import make_documents, write_text_dir

from megascale.config import DataConfig
from megascale.data import prepare as prepare_module
from megascale.data.prepare import ShardWriter, prepare_dataset
from megascale.data.shards import TokenShards
from megascale.errors import DataError


def test_shards_hold_every_document_once_with_eos(tmp_path, cfg_for, text_dir, monkeypatch):
    monkeypatch.setattr(prepare_module, "SHARD_TOKENS", 500)
    directory, documents = text_dir
    dataset_dir = prepare_dataset(cfg_for(directory), progress=False)
    meta = json.loads((dataset_dir / "meta.json").read_text())
    assert meta["format_version"] == 1 and meta["dtype"] == "uint16" and meta["eos_id"] == 256
    assert meta["num_documents"] == len(documents)
    assert len(meta["shards"]) > 2

    # Read the files with plain numpy (not TokenShards) and check them against meta.json.
    stream, ends = [], []
    for entry in meta["shards"]:
        tokens_bytes = (dataset_dir / entry["tokens_file"]).read_bytes()
        docs_bytes = (dataset_dir / entry["docs_file"]).read_bytes()
        assert hashlib.sha256(tokens_bytes).hexdigest() == entry["tokens_sha256"]
        assert hashlib.sha256(docs_bytes).hexdigest() == entry["docs_sha256"]
        tokens = np.frombuffer(tokens_bytes, dtype="<u2")
        docs = np.frombuffer(docs_bytes, dtype="<i8")
        assert len(tokens) == entry["num_tokens"] and docs[-1] == len(tokens)
        ends += (docs + len(stream)).tolist()
        stream += tokens.tolist()
    assert len(stream) == meta["num_tokens"]

    starts = [0] + ends[:-1]
    pieces = [stream[s:e] for s, e in zip(starts, ends, strict=True)]
    assert all(piece[-1] == 256 and 256 not in piece[:-1] for piece in pieces)
    texts = [bytes(piece[:-1]).decode() for piece in pieces]
    assert sorted(texts) == sorted(documents)
    order = np.random.default_rng(prepare_module.SHUFFLE_SEED).permutation(len(documents))
    assert texts == [documents[i] for i in order]  # sorted file names, shuffled once with the fixed seed


def test_cache_hit_returns_same_dir_without_rewriting(cfg_for, text_dir):
    directory, _ = text_dir
    cfg = cfg_for(directory)
    first = prepare_dataset(cfg, progress=False)
    before = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    second = prepare_dataset(cfg, progress=True)
    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in second.iterdir()} == before
    assert first.parent.name == "datasets" and first.name.startswith("corpus-byte-")
    assert prepare_dataset(cfg_for(first), progress=False) == first  # a prepared dir is its own source


def test_cache_key_follows_source_and_tokenizer(cfg_for, text_dir):
    directory, _ = text_dir
    byte_dir = prepare_dataset(cfg_for(directory), progress=False)
    bpe_dir = prepare_dataset(cfg_for(directory, tokenizer="bpe", bpe_vocab_size=280), progress=False)
    assert bpe_dir != byte_dir
    (directory / "doc-0000.txt").write_text("edited\n")
    assert prepare_dataset(cfg_for(directory), progress=False) != byte_dir


def test_default_cache_dir_follows_megascale_cache(tmp_path, text_dir, monkeypatch):
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path / "env-cache"))
    dataset_dir = prepare_dataset(DataConfig(source=str(text_dir[0])), progress=False)
    assert dataset_dir.parent == tmp_path / "env-cache" / "datasets"
    explicit = prepare_dataset(
        DataConfig(source=str(text_dir[0]), cache_dir=str(tmp_path / "mine")), progress=False
    )
    assert explicit.parent == tmp_path / "mine" / "datasets"


def test_explicit_out_dir(tmp_path, cfg_for, text_dir):
    directory, _ = text_dir
    out = tmp_path / "out"
    out.mkdir()  # an empty directory may be filled
    assert prepare_dataset(cfg_for(directory), out_dir=out, progress=False) == out
    assert TokenShards.open(out).num_documents == 40
    other = write_text_dir(tmp_path / "other", make_documents(3, seed=1))
    with pytest.raises(DataError, match=r"already holds another dataset.*choose another --out"):
        prepare_dataset(cfg_for(other), out_dir=out, progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match=r"busy exists, is not empty and has no meta\.json"):
        prepare_dataset(cfg_for(directory), out_dir=tmp_path / "busy", progress=False)


def test_crash_midway_leaves_no_dataset(tmp_path, cfg_for, text_dir, monkeypatch):
    directory, _ = text_dir
    monkeypatch.setattr(prepare_module, "SHARD_TOKENS", 200)
    monkeypatch.setattr(prepare_module, "ENCODE_BATCH_DOCUMENTS", 4)
    calls = {"flushes": 0}
    real_flush = ShardWriter._flush

    def failing_flush(self):
        calls["flushes"] += 1
        if calls["flushes"] == 3:
            raise OSError("disk full")
        real_flush(self)

    monkeypatch.setattr(ShardWriter, "_flush", failing_flush)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        prepare_dataset(cfg_for(directory), out_dir=out, progress=False)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == [".out.lock"]

    monkeypatch.setattr(ShardWriter, "_flush", real_flush)
    (tmp_path / ".out.tmp-stale").mkdir()  # left by a killed preparer: removed on the next run
    assert prepare_dataset(cfg_for(directory), out_dir=out, progress=False) == out
    assert not (tmp_path / ".out.tmp-stale").exists()


def test_prepare_stdlib_with_byte_tokenizer(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    dataset_dir = prepare_dataset(cfg, progress=False)
    assert dataset_dir.name.startswith("stdlib-byte-")
    meta = json.loads((dataset_dir / "meta.json").read_text())
    assert meta["num_documents"] > 500 and meta["num_tokens"] > 5_000_000
    assert meta["source"]["kind"] == "stdlib"
    names = sorted(p.name for p in dataset_dir.iterdir())
    expected = ["meta.json"] + sorted(n for e in meta["shards"] for n in (e["tokens_file"], e["docs_file"]))
    assert names == expected
    shards = TokenShards.open(dataset_dir, verify=True)
    assert shards.num_tokens == meta["num_tokens"]
    assert int(shards.tokens(0, shards.num_tokens).max()) == 256
