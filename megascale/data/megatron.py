"""Megatron-LM's indexed dataset (`.bin` + `.idx`, header MMIDIDX) as a source of token documents.

Data already tokenized for Megatron-LM can be trained on without the original text: `prepare` copies its
documents into megascale shards. The index holds, after a 9-byte header, a little-endian u64 version
(1), a u8 dtype code, u64 sequence and document counts, then int32 sequence lengths, int64 byte offsets
of the sequences in `.bin`, and int64 document boundaries (indices into the sequences, starting at 0
and ending at the sequence count). The file carries no tokenizer, so data.tokenizer must name the one
the data was made with.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megascale.data.corpus import Corpus, safe_name
from megascale.errors import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


@dataclass
class MegatronIndex:
    dtype: np.dtype
    sequence_lengths: np.ndarray  # tokens per sequence
    sequence_pointers: np.ndarray  # byte offset of each sequence in .bin
    document_indices: np.ndarray  # document d is sequences [document_indices[d], document_indices[d+1])


def megatron_prefix(source: str) -> Path | None:
    """The path prefix if `source` names a Megatron pair (prefix, prefix.bin or prefix.idx), else None."""
    expanded = os.path.expanduser(source)
    prefix = expanded[:-4] if expanded.endswith((".bin", ".idx")) else expanded
    if os.path.isfile(prefix + ".idx") and (expanded != prefix or not os.path.exists(expanded)):
        return Path(prefix)
    return None


def read_megatron_index(idx_path: Path) -> MegatronIndex:
    fix = "give the .idx written with its .bin by Megatron-LM's preprocess_data.py"
    data = idx_path.read_bytes()
    fixed_bytes = len(INDEX_HEADER) + 8 + 1 + 8 + 8
    if len(data) < fixed_bytes or not data.startswith(INDEX_HEADER):
        raise DataError(f"data.source = {str(idx_path)!r} is not a Megatron index (no MMIDIDX header); {fix}")
    version, code, num_sequences, num_boundaries = struct.unpack_from("<QBQQ", data, len(INDEX_HEADER))
    if version != 1 or code not in INDEX_DTYPES or np.dtype(INDEX_DTYPES[code]).kind == "f":
        raise DataError(
            f"data.source = {str(idx_path)!r} has index version {version} and dtype code {code}; "
            f"only version 1 with integer tokens is readable; {fix}"
        )
    expected_bytes = fixed_bytes + num_sequences * (4 + 8) + num_boundaries * 8
    if len(data) < expected_bytes:
        raise DataError(
            f"data.source = {str(idx_path)!r} is truncated ({len(data)} bytes, its header "
            f"needs {expected_bytes}); {fix}"
        )
    lengths = np.frombuffer(data, "<i4", num_sequences, fixed_bytes)
    pointers = np.frombuffer(data, "<i8", num_sequences, fixed_bytes + 4 * num_sequences)
    boundaries = np.frombuffer(data, "<i8", num_boundaries, fixed_bytes + 12 * num_sequences)
    if (
        num_boundaries < 1
        or boundaries[0] != 0
        or boundaries[-1] != num_sequences
        or np.any(np.diff(boundaries) < 0)
    ):
        raise DataError(f"data.source = {str(idx_path)!r} has inconsistent document indices; {fix}")
    return MegatronIndex(
        np.dtype(INDEX_DTYPES[code]).newbyteorder("<"),
        lengths.astype(np.int64),
        pointers.astype(np.int64),
        boundaries.astype(np.int64),
    )


class MegatronCorpus(Corpus):
    """Documents of token ids (not text) read from a Megatron `.bin`/`.idx` pair."""

    def __init__(self, prefix: Path):
        self.kind, self.name, self.location = "megatron", safe_name(prefix.name), str(prefix)
        self.bin_path, self.idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
        if not self.bin_path.is_file():
            raise DataError(
                f"data.source = {str(prefix)!r}: {self.bin_path} is missing; put the .bin next to its .idx"
            )
        self.index = read_megatron_index(self.idx_path)
        ends = self.index.sequence_pointers + self.index.sequence_lengths * self.index.dtype.itemsize
        bin_bytes = self.bin_path.stat().st_size
        if len(ends) and int(ends.max()) > bin_bytes:
            raise DataError(
                f"data.source = {str(prefix)!r}: {self.bin_path} is truncated ({bin_bytes} "
                f"bytes, its index points up to {int(ends.max())}); copy the file again"
            )
        self.num_documents = len(self.index.document_indices) - 1
        stats = [path.stat() for path in (self.bin_path, self.idx_path)]
        self.identity = {
            "kind": "megatron",
            "prefix": str(prefix.resolve()),
            "files": [[s.st_size, s.st_mtime_ns] for s in stats],
        }

    def texts(self, order: Iterable[int]) -> Iterator[str | None]:
        raise DataError(
            f"data.source = {self.location!r} is already tokenized; it cannot train a BPE "
            "tokenizer: set --data.tokenizer to the tokenizer.json it was made with"
        )

    def token_documents(self, order: Iterable[int], vocab_size: int, eos_id: int) -> Iterator[np.ndarray]:
        """Each document's ids in `order`, without a trailing EOS (the shard writer adds one, and
        Megatron's --append-eod may already have)."""
        tokens = np.memmap(self.bin_path, dtype=self.index.dtype, mode="r")
        itemsize = self.index.dtype.itemsize
        for document in order:
            first, stop = self.index.document_indices[document], self.index.document_indices[document + 1]
            pieces = [
                tokens[pointer // itemsize : pointer // itemsize + length]
                for pointer, length in zip(
                    self.index.sequence_pointers[first:stop], self.index.sequence_lengths[first:stop]
                )
            ]
            ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=self.index.dtype)
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                raise DataError(
                    f"data.source = {self.location!r} has token id {int(ids.max())} (or "
                    f"{int(ids.min())}) outside the {vocab_size} ids of data.tokenizer; set "
                    "--data.tokenizer to the tokenizer.json the data was made with"
                )
            if len(ids) and ids[-1] == eos_id:
                ids = ids[:-1]
            yield ids
