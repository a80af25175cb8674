"""Megatron-LM .bin/.idx input: documents are copied into shards with exactly one EOS each."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from megascale.data.prepare import prepare_dataset
from megascale.data.shards import TokenShards
from megascale.errors import DataError


def _write_megatron(prefix, documents, dtype=np.uint16, code=8):
    """Writes the pair as Megatron-LM's IndexedDatasetBuilder does: each document one or more sequences."""
    lengths, pointers, boundaries, offset = [], [], [0], 0
    with open(f"{prefix}.bin", "wb") as data:
        for sequences in documents:
            for sequence in sequences:
                array = np.asarray(sequence, dtype=dtype)
                data.write(array.tobytes())
                lengths.append(len(array))
                pointers.append(offset)
                offset += array.nbytes
            boundaries.append(len(lengths))
    with open(f"{prefix}.idx", "wb") as index:
        index.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(lengths), len(boundaries)))
        index.write(np.asarray(lengths, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes())
        index.write(np.asarray(boundaries, "<i8").tobytes())


def test_megatron_documents_become_shards(tmp_path, cfg_for):
    documents = [[[1, 2, 3], [4, 5]], [[6, 256]], [[7] * 10, [8, 9, 256]]]  # EOD (256) already on some
    _write_megatron(tmp_path / "corpus_text_document", documents)
    for source in ("corpus_text_document", "corpus_text_document.bin", "corpus_text_document.idx"):
        dataset_dir = prepare_dataset(cfg_for(tmp_path / source), progress=False)
        shards = TokenShards.open(dataset_dir)
        assert shards.num_documents == 3 and shards.meta["source"]["kind"] == "megatron"
        got = [shards.tokens(s, e).tolist() for s, e in zip([0, *shards.doc_ends[:-1]], shards.doc_ends)]
        expected = [[1, 2, 3, 4, 5, 256], [6, 256], [7] * 10 + [8, 9, 256]]
        assert sorted(got) == sorted(expected)


def test_megatron_errors(tmp_path, cfg_for):
    _write_megatron(tmp_path / "big", [[[1, 300]]])
    with pytest.raises(DataError, match=r"token id 300 .*outside the 257 ids of data\.tokenizer"):
        prepare_dataset(cfg_for(tmp_path / "big.bin"), progress=False)
    with pytest.raises(DataError, match=r"already tokenized, so data\.tokenizer = 'bpe' cannot apply"):
        prepare_dataset(cfg_for(tmp_path / "big.bin", tokenizer="bpe"), progress=False)
    (tmp_path / "bad.idx").write_bytes(b"NOTANINDEX" + bytes(40))
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"is not a Megatron index \(no MMIDIDX header\)"):
        prepare_dataset(cfg_for(tmp_path / "bad.idx"), progress=False)
    _write_megatron(tmp_path / "short", [[[1, 2, 3, 4]]])
    (tmp_path / "short.bin").write_bytes(b"\x01\x00")
    with pytest.raises(DataError, match=r"short\.bin is truncated \(2 bytes, its index points up to 8\)"):
        prepare_dataset(cfg_for(tmp_path / "short"), progress=False)
