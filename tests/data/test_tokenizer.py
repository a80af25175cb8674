"""Tokenizers: byte round trip, BPE training and reload, users' tokenizer.json files."""

from __future__ import annotations

import numpy as np
import pytest
import tokenizers
from data_helpers import make_documents
from tokenizers import models, pre_tokenizers

from megascale.data.prepare import prepare_dataset
from megascale.data.shards import TokenShards
from megascale.data.tokenizer import (
    ByteTokenizer,
    JsonTokenizer,
    Tokenizer,
    load_tokenizer,
    open_tokenizer_file,
    train_bpe,
)
from megascale.errors import DataError


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "def f(x):\n    return 'naïve ☃ 🐍'\n"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (257, 256)
    assert tokenizer.decode(ids[:3] + [256] + ids[3:5]) == "def<|endoftext|> f"
    assert np.array_equal(tokenizer.encode_batch([text])[0], ids)
    assert isinstance(tokenizer, Tokenizer)
    assert isinstance(load_tokenizer(tokenizer.to_spec()), ByteTokenizer)


def test_bpe_trains_round_trips_and_reloads(tmp_path):
    documents = make_documents(60)
    tokenizer = train_bpe(documents, vocab_size=300)
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.vocab_size <= 300
    assert tokenizer.eos_id < tokenizer.vocab_size
    text = documents[3] + "unseen wörds ☃"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned
    spec = tokenizer.save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file() and spec["kind"] == "bpe"
    reloaded = load_tokenizer(spec, tmp_path)
    assert reloaded.encode(text) == ids
    assert [a.tolist() for a in reloaded.encode_batch([text])] == [ids]


def test_bpe_dataset_reopens_its_tokenizer(tmp_path, cfg_for, text_dir):
    directory, documents = text_dir
    dataset_dir = prepare_dataset(cfg_for(directory, tokenizer="bpe", bpe_vocab_size=300), progress=False)
    tokenizer = load_tokenizer(dataset_dir)
    shards = TokenShards.open(dataset_dir)
    first_doc = shards.tokens(0, int(shards.doc_ends[0]))
    assert first_doc[-1] == tokenizer.eos_id
    assert tokenizer.decode(first_doc[:-1].tolist()) in documents


def _user_tokenizer_file(path, eos: str | None, vocab_words: int = 50):
    vocab = {"[UNK]": 0} | {f"w{i}": i + 1 for i in range(vocab_words)}
    if eos is not None:
        vocab[eos] = len(vocab)
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if eos is not None:
        tokenizer.add_special_tokens([eos])
    tokenizer.save(str(path))
    return path


def test_user_tokenizer_json(tmp_path, cfg_for):
    path = _user_tokenizer_file(tmp_path / "mine.json", eos="</s>")
    tokenizer = open_tokenizer_file(path)
    assert isinstance(tokenizer, JsonTokenizer)
    assert tokenizer.eos_token == "</s>" and tokenizer.eos_id == 51 and tokenizer.vocab_size == 52
    assert tokenizer.encode("w1 w2 zz") == [2, 3, 0]

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "w1 w2 w3"}\n{"text": "w4 w5"}\n')
    dataset_dir = prepare_dataset(cfg_for(corpus, tokenizer=str(path)), progress=False)
    shards = TokenShards.open(dataset_dir)
    assert shards.meta["tokenizer"]["kind"] == "file"
    assert (dataset_dir / "tokenizer.json").read_bytes() == path.read_bytes()
    assert sorted(shards.tokens(0, shards.num_tokens).tolist()) == sorted([2, 3, 4, 51, 5, 6, 51])
    assert load_tokenizer(dataset_dir).encode("w1 w2") == [2, 3]


def test_user_tokenizer_without_eos_names_the_file(tmp_path):
    path = _user_tokenizer_file(tmp_path / "no-eos.json", eos=None)
    with pytest.raises(DataError, match=r"no-eos\.json.*no end-of-document token"):
        open_tokenizer_file(path)


def test_bad_or_missing_tokenizer_file(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(DataError, match=r"broken\.json.*not a valid tokenizer\.json"):
        open_tokenizer_file(broken)
    with pytest.raises(DataError, match=r"data\.tokenizer = '.*nope\.json' does not exist"):
        load_tokenizer(tmp_path / "nope.json")


def test_large_vocabulary_is_stored_as_uint32(tmp_path, cfg_for):
    path = _user_tokenizer_file(tmp_path / "big.json", eos="<|endoftext|>", vocab_words=70_000)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "w69999 w1"}\n{"text": "w2"}\n')
    shards = TokenShards.open(prepare_dataset(cfg_for(corpus, tokenizer=str(path)), progress=False))
    assert shards.meta["dtype"] == "uint32" and shards.vocab_size == 70_002
    assert 70_000 in shards.tokens(0, shards.num_tokens).tolist()
