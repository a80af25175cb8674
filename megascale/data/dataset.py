"""The train/validation split and packing of a token stream into fixed-length training sequences.

The split is by documents (the last ones are validation), so no document is seen by both; documents
were shuffled once at prepare time, so the held-out tail is a representative sample. Each split is one
token stream with EOS between documents; sequence i is tokens[i*L : i*L + L + 1], giving L inputs and
the L labels shifted by one. Sequences cross document and shard boundaries, so no token is padding and
every token after the first is a label exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megascale.data.shards import TokenShards
from megascale.errors import DataError

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels), int64 [sequences, seq_len] each

# A label that adds nothing to a loss (cross-entropy's default ignore_index): validation pads with it.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class DocumentSplit:
    """Token ranges [start, stop) of the two splits in the whole stream."""

    train_tokens: tuple[int, int]
    val_tokens: tuple[int, int]
    num_train_documents: int
    num_val_documents: int


def split_by_documents(doc_ends: np.ndarray, val_fraction: float) -> DocumentSplit:
    """The last ceil(val_fraction * n) documents are validation: at least one when val_fraction > 0 and
    there are two or more documents, and never all of them."""
    num_documents = len(doc_ends)
    num_val = 0
    if val_fraction > 0 and num_documents >= 2:
        # round() first so that e.g. 0.07 * 100 = 7.000000000000001 does not become 8 documents
        num_val = min(max(math.ceil(round(val_fraction * num_documents, 9)), 1), num_documents - 1)
    num_train = num_documents - num_val
    boundary = int(doc_ends[num_train - 1]) if num_train else 0
    total = int(doc_ends[-1]) if num_documents else 0
    return DocumentSplit((0, boundary), (boundary, total), num_train, num_val)


class PackedSequences:
    """Fixed-length sequences over one split: item i holds seq_len + 1 tokens (inputs and labels)."""

    def __init__(
        self,
        shards: TokenShards,
        token_range: tuple[int, int],
        seq_len: int,
        split_name: str,
        num_documents: int,
    ):
        self.shards = shards
        self.start, self.stop = token_range
        self.seq_len = seq_len
        self.num_tokens = self.stop - self.start
        self.num_sequences = max(self.num_tokens - 1, 0) // seq_len
        if self.num_sequences < 1:
            raise DataError(
                f"data: the {split_name} split of {shards.directory} has {self.num_tokens} tokens "
                f"({num_documents} documents) but data.seq_len = {seq_len} needs at least {seq_len + 1}; "
                f"lower --data.seq_len{_more_data_hint(split_name)}"
            )

    def __len__(self) -> int:
        return self.num_sequences

    @property
    def directory(self) -> Path:
        """The prepared dataset the sequences are read from."""
        return self.shards.directory

    def check_unchanged(self) -> None:
        """`TokenShards.check_unchanged` of the shards read since the last call."""
        self.shards.check_unchanged()

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_sequences:
            raise IndexError(f"sequence {index} outside [0, {self.num_sequences})")
        begin = self.start + index * self.seq_len
        return self.shards.tokens(begin, begin + self.seq_len + 1)

    def rows(self, indices: Sequence[int]) -> np.ndarray:
        """The sequences `indices` as one int64 array [len(indices), seq_len + 1]."""
        return np.stack([self[int(i)] for i in indices])

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), both int64 of shape [len(indices), seq_len]."""
        return split_rows(self.rows(indices))


def split_rows(rows: np.ndarray) -> Batch:
    """(inputs, labels) of packed rows [n, seq_len + 1]: all but the last token, all but the first."""
    tokens = torch.from_numpy(rows)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _more_data_hint(split_name: str) -> str:
    if split_name == "validation":
        return ", raise --data.val_fraction (or set it to 0 to skip validation) or use more data"
    return " or use more data"
