"""Streaming mode's packing: a source's documents read in order, tokenized as they come, cut into sequences.

A source is read in file order, each row one document (hf.DocumentReader), and split by documents as
prepared data is: document d (counted from 0 in each pass over the files) is held out for validation when
floor((d + 1) * f) > floor(d * f), f = data.val_fraction, i.e. every (1/f)-th document, spread over the
whole source (f = 0.01: documents 99, 199, 299, ...). Training reads the others, pass after pass (an
epoch each), forever; validation reads the held-out ones once.

Documents are joined with EOS after each and cut as dataset.py cuts a split: sequence i is tokens
[i*L, i*L + L + 1) of the joined stream, so neighbours share one token and nothing is padded. Where the
next sequence starts is a `Cursor`: the document (epoch, file, row; its number d) and how many of its
tokens lie before the start. A cursor is a few integers however long the document, and a packer made from
one (reading from that file and row, dropping `offset` tokens) continues exactly where the old one was.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megascale.data.hf import DocumentReader
from megascale.data.sources import Source
from megascale.data.tokenizer import Tokenizer
from megascale.errors import DataError


@dataclass(frozen=True)
class Cursor:
    """Where a source's next sequence starts: `offset` tokens into document `document` of epoch `epoch`,
    which is row `row` of file `file` (files in sorted order)."""

    epoch: int = 0
    file: int = 0
    row: int = 0
    document: int = 0
    offset: int = 0

    def to_list(self) -> list[int]:
        return [self.epoch, self.file, self.row, self.document, self.offset]

    @classmethod
    def from_list(cls, values: list[int]) -> Cursor:
        return cls(*(int(value) for value in values))


def held_out(document: int, fraction: float) -> bool:
    """Whether document number `document` (from 0 in each epoch) is a validation document."""
    if fraction <= 0:
        return False
    # round() first so that e.g. 0.07 * 100 = 7.000000000000001 counts as 7, as split_by_documents does
    return math.floor(round((document + 1) * fraction, 9)) > math.floor(round(document * fraction, 9))


class SourceStream:
    """One source's documents as int64 token arrays, each ending in EOS, from a cursor on."""

    def __init__(
        self, source: Source, text_field: str, tokenizer: Tokenizer, val_fraction: float, cache_dir: Path
    ):
        self.source = source
        self.reader = DocumentReader(source, text_field, cache_dir)
        self.tokenizer = tokenizer
        self.val_fraction = val_fraction
        self._eos = np.array([tokenizer.eos_id], dtype=np.int64)

    def documents(self, cursor: Cursor, validation: bool = False) -> Iterator[tuple[Cursor, np.ndarray]]:
        """(the document's cursor at offset 0, its tokens) of each training document from `cursor` on,
        epoch after epoch; with `validation`, of each held-out document of the first epoch from it on."""
        epoch, file, row, document = cursor.epoch, cursor.file, cursor.row, cursor.document
        while True:
            whole_epoch, found = (file, row) == (0, 0), False
            for file_index, first_row, texts in self.reader.batches(file, row):
                kept = [
                    i for i in range(len(texts)) if held_out(document + i, self.val_fraction) == validation
                ]
                encoded = self.tokenizer.encode_batch([texts[i] for i in kept])
                for i, ids in zip(kept, encoded, strict=True):
                    place = Cursor(epoch, file_index, first_row + i, document + i)
                    yield place, np.concatenate([ids.astype(np.int64), self._eos])
                document += len(texts)
                found = found or bool(kept)
            if validation:
                return
            if whole_epoch and not found:
                raise DataError(
                    f"{self.source.where} has no training documents (every one is empty or held out by "
                    "data.val_fraction); give more data or lower --data.val_fraction"
                )
            epoch, file, row, document = epoch + 1, 0, 0, 0


class Packer:
    """Sequences of seq_len + 1 tokens cut from documents in order; `cursor` is where the next starts."""

    def __init__(self, documents: Iterator[tuple[Cursor, np.ndarray]], seq_len: int, offset: int = 0):
        self._documents = documents
        self.seq_len = seq_len
        self._pieces: deque[tuple[Cursor, np.ndarray]] = deque()  # documents not yet wholly behind
        self._offset = offset  # tokens of the first piece before the next sequence's start
        self._tokens = 0  # tokens in the pieces

    @property
    def cursor(self) -> Cursor | None:
        """Where the next sequence starts; None when the documents have ended there."""
        if not self._pieces and not self._pull():
            return None
        return dataclasses.replace(self._pieces[0][0], offset=self._offset)

    def next_sequence(self) -> np.ndarray | None:
        """The next sequence (int64, seq_len + 1 tokens), or None when the documents cannot fill one."""
        length = self.seq_len + 1
        while self._tokens - self._offset < length:
            if not self._pull():
                return None
        sequence = np.empty(length, dtype=np.int64)
        filled, skip = 0, self._offset
        for _, tokens in self._pieces:
            part = tokens[skip : skip + length - filled]
            sequence[filled : filled + len(part)] = part
            filled, skip = filled + len(part), 0
            if filled == length:
                break
        self._offset += self.seq_len  # the last token is the next sequence's first
        while self._offset >= len(self._pieces[0][1]):
            self._offset -= len(self._pieces[0][1])
            self._tokens -= len(self._pieces.popleft()[1])
        return sequence

    def _pull(self) -> bool:
        document = next(self._documents, None)
        if document is None:
            return False
        self._pieces.append(document)
        self._tokens += len(document[1])
        return True


class HeldOut:
    """A source's validation sequences, its held-out documents packed: read as far as asked, kept, and
    repeated from the first when they end (as a shorter prepared validation split is)."""

    def __init__(self, stream: SourceStream, seq_len: int):
        self.seq_len = seq_len
        self._packer = Packer(stream.documents(Cursor(), validation=True), seq_len)
        self.sequences: list[np.ndarray] = []
        self.ended = False

    def fill(self, count: int) -> None:
        """Read until `count` sequences are known or the held-out documents end."""
        while len(self.sequences) < count and not self.ended:
            sequence = self._packer.next_sequence()
            if sequence is None:
                self.ended = True
            else:
                self.sequences.append(sequence)

    def __call__(self, index: int) -> np.ndarray:
        self.fill(index + 1)
        return self.sequences[index % len(self.sequences)]
