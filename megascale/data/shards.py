"""The on-disk token format and its reader: flat token shards, memory-mapped, checked against meta.json.

A dataset directory holds `shard-NNNNN.tokens` (raw little-endian uint16, or uint32 for vocabularies
over 65,535), `shard-NNNNN.docs` (little-endian int64 document end offsets within the shard; so
docs[-1] equals the shard's token count) and `meta.json`, written last. See docs/data.md.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megascale.data.tokenizer import Tokenizer, file_sha256, load_tokenizer
from megascale.errors import DataError

FORMAT_NAME = "megascale-tokens"
FORMAT_VERSION = 1
META_FILE = "meta.json"
DOCS_DTYPE = np.dtype("<i8")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned type that holds ids below `vocab_size`."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def shard_names(index: int) -> tuple[str, str]:
    return f"shard-{index:05d}.tokens", f"shard-{index:05d}.docs"


@dataclass
class Shard:
    tokens: np.ndarray  # read-only memmap (or an empty array), dtype from meta.json
    doc_ends: np.ndarray  # int64, document end offsets within this shard
    path: Path | None = None  # the tokens file, mapped
    identity: tuple[int, ...] = ()  # its inode, size and times when it was opened (`file_identity`)


def file_identity(path: Path) -> tuple[int, ...]:
    """What changes when a file is written or replaced: inode, size, modification and change times."""
    stat = path.stat()
    return stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


class TokenShards:
    """All shards of one prepared dataset as a single token stream with document boundaries.

    `doc_ends` are global: document d spans tokens [doc_ends[d-1], doc_ends[d]) of the whole stream, its
    last token being EOS.
    """

    def __init__(self, directory: Path, meta: dict, shards: list[Shard]):
        self.directory = directory
        self.meta = meta
        self.vocab_size = int(meta["vocab_size"])
        self.eos_id = int(meta["eos_id"])
        self.shards = shards
        sizes = [len(shard.tokens) for shard in shards]
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self.num_tokens = int(self.shard_starts[-1])
        self.doc_ends = np.concatenate(
            [shard.doc_ends + start for shard, start in zip(shards, self.shard_starts[:-1], strict=True)]
            or [np.zeros(0, dtype=np.int64)]
        )
        self.num_documents = len(self.doc_ends)
        self.touched: set[int] = set()  # shards read since the last `check_unchanged`
        self._touched_lock = threading.Lock()  # reads happen in the prefetch thread

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> TokenShards:
        """Map every shard read-only. File presence and sizes are always checked (a short file would
        otherwise fail later inside numpy); `verify` adds sha256 sums, the document index and the token
        id range, which read every byte once."""
        directory = Path(path).expanduser()
        meta = read_meta(directory)
        dtype = np.dtype(meta["dtype"]).newbyteorder("<")
        shards = []
        for entry in meta["shards"]:
            tokens_path = _checked_file(directory, entry["tokens_file"], entry["tokens_bytes"])
            docs_path = _checked_file(directory, entry["docs_file"], entry["docs_bytes"])
            if entry["tokens_bytes"] != entry["num_tokens"] * dtype.itemsize:
                raise DataError(
                    f"data: {directory / META_FILE} says {tokens_path.name} has "
                    f"{entry['num_tokens']} tokens but {entry['tokens_bytes']} bytes; "
                    f"delete {directory} and run `megascale prepare` again"
                )
            if verify:
                for file_path, key in ((tokens_path, "tokens_sha256"), (docs_path, "docs_sha256")):
                    if file_sha256(file_path) != entry[key]:
                        raise DataError(
                            f"data: shard {file_path} is corrupt (its sha256 differs from "
                            f"meta.json); delete {directory} and run `megascale prepare` again"
                        )
            tokens = (
                np.memmap(tokens_path, dtype=dtype, mode="r")
                if entry["num_tokens"]
                else np.zeros(0, dtype=dtype)
            )
            doc_ends = np.fromfile(docs_path, dtype=DOCS_DTYPE).astype(np.int64)
            shard = Shard(tokens, doc_ends, tokens_path, file_identity(tokens_path))
            if verify:
                _check_shard(shard, tokens_path, docs_path, int(meta["vocab_size"]), directory)
            shards.append(shard)
        dataset = cls(directory, meta, shards)
        if dataset.num_tokens != meta["num_tokens"] or dataset.num_documents != meta["num_documents"]:
            raise DataError(
                f"data: {directory / META_FILE} totals ({meta['num_tokens']} tokens, "
                f"{meta['num_documents']} documents) disagree with its shards "
                f"({dataset.num_tokens}, {dataset.num_documents}); delete {directory} and run "
                "`megascale prepare` again"
            )
        return dataset

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.meta["tokenizer"], self.directory)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the whole stream as int64, crossing shard boundaries as needed."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        first = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        pieces = []
        shard_index = first
        while start < stop:
            shard_start = int(self.shard_starts[shard_index])
            shard_stop = int(self.shard_starts[shard_index + 1])
            take_stop = min(stop, shard_stop)
            pieces.append(self.shards[shard_index].tokens[start - shard_start : take_stop - shard_start])
            with self._touched_lock:
                self.touched.add(shard_index)
            start = take_stop
            shard_index += 1
        if len(pieces) == 1:
            return np.array(pieces[0], dtype=np.int64)
        return np.concatenate(pieces or [np.zeros(0, dtype=np.int64)]).astype(np.int64)

    def check_unchanged(self) -> None:
        """Refuse to go on with tokens read from a shard written or replaced since it was opened: the shards
        are mapped, not copied, so an overwrite mid-run changes the batches (checksums are only checked at
        open). A stat per shard read since the last call."""
        with self._touched_lock:
            touched, self.touched = self.touched, set()
        for index in sorted(touched):
            shard = self.shards[index]
            if shard.path is None:
                continue
            try:
                unchanged = file_identity(shard.path) == shard.identity
            except OSError:
                unchanged = False
            if not unchanged:
                raise DataError(
                    f"data: shard {shard.path} was changed or removed while this run read it, so its "
                    f"batches since are not the prepared dataset's; delete {self.directory} and run "
                    "`megascale prepare` again, then resume from a checkpoint taken before the change"
                )


def read_meta(directory: Path) -> dict:
    """meta.json of a prepared dataset, checked for the fields the reader relies on."""
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise DataError(
            f"data: {directory} has no {META_FILE} (not a prepared dataset, or preparing it was "
            f"interrupted); run `megascale prepare --out {directory}` or point data.source "
            "at the raw text"
        )
    fix = f"delete {directory} and run `megascale prepare` again"
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"data: {meta_path} is not valid JSON ({err}); {fix}") from None
    required = (
        "format_version",
        "tokenizer",
        "vocab_size",
        "eos_id",
        "dtype",
        "num_tokens",
        "num_documents",
        "shards",
    )
    missing = [key for key in required if key not in meta] if isinstance(meta, dict) else list(required)
    if missing:
        raise DataError(f"data: {meta_path} lacks {', '.join(missing)}; {fix}")
    if meta["format_version"] > FORMAT_VERSION:
        raise DataError(
            f"data: {meta_path} has format_version {meta['format_version']} but this megascale "
            f"reads up to {FORMAT_VERSION}; upgrade megascale or prepare the dataset again"
        )
    return meta


def _checked_file(directory: Path, name: str, expected_bytes: int) -> Path:
    path = directory / name
    if not path.is_file():
        raise DataError(
            f"data: shard {path} is missing (meta.json lists it); delete {directory} and run "
            "`megascale prepare` again"
        )
    actual_bytes = path.stat().st_size
    if actual_bytes != expected_bytes:
        state = "truncated" if actual_bytes < expected_bytes else "too long"
        raise DataError(
            f"data: shard {path} is {state} ({actual_bytes} bytes, meta.json says "
            f"{expected_bytes}); delete {directory} and run `megascale prepare` again"
        )
    return path


def _check_shard(shard: Shard, tokens_path: Path, docs_path: Path, vocab_size: int, directory: Path) -> None:
    """The document index must be non-decreasing and end at the token count; ids below vocab_size."""
    fix = f"delete {directory} and run `megascale prepare` again"
    ends = shard.doc_ends
    if len(ends) and (ends[0] < 0 or np.any(np.diff(ends) < 0) or ends[-1] != len(shard.tokens)):
        raise DataError(
            f"data: document index {docs_path} is inconsistent (must be non-decreasing and end "
            f"at {len(shard.tokens)} tokens); {fix}"
        )
    if len(shard.tokens) and not len(ends):
        raise DataError(f"data: document index {docs_path} is empty but its shard has tokens; {fix}")
    if len(shard.tokens):
        max_id = int(shard.tokens.max())
        if max_id >= vocab_size:
            raise DataError(
                f"data: shard {tokens_path} has token id {max_id}, not below vocab_size "
                f"{vocab_size} in meta.json; {fix}"
            )
