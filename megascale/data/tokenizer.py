"""Tokenizers behind one small protocol: raw bytes, a byte-level BPE trained locally, or a user's file.

A prepared dataset records its tokenizer as a spec (a small dict in meta.json) and, for BPE and user
tokenizers, a copy of tokenizer.json inside the dataset directory, so a dataset can always be decoded
again without its original source, the user's file or the network.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from megascale.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
BPE_EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizer families (GPT-2/NeoX, Llama 3, Llama 2/T5/Mistral, Gemma).
EOS_TOKEN_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<EOS>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer; ids are in [0, vocab_size)."""

    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text as an integer array (no EOS added); the fast path of `prepare`."""
        ...

    def to_spec(self) -> dict:
        """A JSON-able description stored in meta.json; `load_tokenizer(spec, dataset_dir)` reopens it."""
        ...

    def save(self, dataset_dir: Path) -> dict:
        """Write whatever files the tokenizer needs into `dataset_dir`; return its spec."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus EOS = 256: no training, no files, never an unknown token."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; EOS is shown as '<|endoftext|>' and broken UTF-8 as U+FFFD."""
        pieces, current = [], bytearray()
        for token_id in ids:
            token_id = int(token_id)
            if token_id == self.eos_id:
                pieces.append(current.decode("utf-8", errors="replace") + BPE_EOS_TOKEN)
                current = bytearray()
            elif 0 <= token_id < 256:
                current.append(token_id)
            else:
                raise ValueError(f"byte tokenizer: id {token_id} is outside [0, {self.vocab_size})")
        pieces.append(current.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def to_spec(self) -> dict:
        return {"kind": "byte", "vocab_size": self.vocab_size, "eos_id": self.eos_id}

    def save(self, dataset_dir: Path) -> dict:
        return self.to_spec()


class JsonTokenizer:
    """A Hugging Face `tokenizers` tokenizer: trained here ('bpe') or given by the user ('file').

    Text is encoded without the tokenizer's own special tokens (no BOS from a post-processor): the
    pipeline adds exactly one EOS after each document itself.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        kind: str,
        origin: str | None = None,
        source_file: Path | None = None,
    ):
        self._tokenizer = tokenizer
        self.kind = kind
        self.origin = origin  # the user's path, recorded in the spec for the record only
        self._source_file = source_file  # copied byte for byte by save(), so its sha256 still names it
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        # Ids may have holes; the embedding must cover the largest one.
        self.vocab_size = max(vocab.values()) + 1
        found = [name for name in EOS_TOKEN_NAMES if name in vocab]
        if not found:
            where = origin or "the trained tokenizer"
            raise DataError(
                f"data.tokenizer = {where!r} has no end-of-document token (looked for "
                f"{', '.join(EOS_TOKEN_NAMES)}); add one of them as a special token"
            )
        self.eos_token = found[0]
        self.eos_id = vocab[self.eos_token]

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` object itself (its vocabulary, decoder and special tokens)."""
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.uint32) for encoding in encodings]

    def to_json(self) -> str:
        return self._tokenizer.to_str()

    def to_spec(self) -> dict:
        spec = {
            "kind": self.kind,
            "file": TOKENIZER_FILE,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
        }
        if self.origin is not None:
            spec["origin"] = self.origin
        return spec

    def save(self, dataset_dir: Path) -> dict:
        target = Path(dataset_dir) / TOKENIZER_FILE
        if self._source_file is not None:
            if not target.exists() or not target.samefile(self._source_file):
                shutil.copyfile(self._source_file, target)
        else:
            self._tokenizer.save(str(target))
        return self.to_spec() | {"sha256": file_sha256(target)}


def train_bpe(texts: Iterable[str], vocab_size: int, num_texts: int | None = None) -> JsonTokenizer:
    """A GPT-2-style byte-level BPE with '<|endoftext|>' as its only special token (id 0).

    Byte-level means every string round-trips exactly: the 256 byte symbols are the initial alphabet.
    """
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=num_texts)
    return JsonTokenizer(tokenizer, kind="bpe")


def open_tokenizer_file(path: str | Path) -> JsonTokenizer:
    """A user's tokenizer.json, checked to exist, parse and have an EOS token."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(
            f"data.tokenizer = {str(path)!r} does not exist; give 'byte', 'bpe' or the path "
            "of a tokenizer.json"
        )
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust side raises a plain Exception on malformed files
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(
            f"data.tokenizer = {str(path)!r} is not a valid tokenizer.json ({reason}); "
            "give a file saved by the Hugging Face `tokenizers` library"
        ) from None
    return JsonTokenizer(tokenizer, kind="file", origin=str(path.resolve()), source_file=path)


def tokenizer_identity(name: str, bpe_vocab_size: int) -> dict:
    """What determines the tokenizer's output, for the dataset cache key (a file counts by content)."""
    if name == "byte":
        return {"kind": "byte"}
    if name == "bpe":
        return {"kind": "bpe", "vocab_size": bpe_vocab_size}
    path = Path(name).expanduser()
    if not path.is_file():
        raise DataError(
            f"data.tokenizer = {name!r} does not exist; give 'byte', 'bpe' or the path of a tokenizer.json"
        )
    return {"kind": "file", "sha256": file_sha256(path)}


def load_tokenizer(spec_or_path: dict | str | Path, dataset_dir: str | Path | None = None) -> Tokenizer:
    """Reopen a tokenizer from a meta.json spec (files relative to `dataset_dir`), a prepared dataset
    directory, 'byte', or a tokenizer.json path."""
    if isinstance(spec_or_path, dict):
        return _from_spec(spec_or_path, dataset_dir)
    if str(spec_or_path) == "byte":
        return ByteTokenizer()
    path = Path(spec_or_path).expanduser()
    meta_path = path / "meta.json"
    if meta_path.is_file():
        try:
            spec = json.loads(meta_path.read_text())["tokenizer"]
        except (ValueError, KeyError, TypeError):
            raise DataError(
                f"data: {meta_path} has no readable 'tokenizer' entry; delete {path} and run "
                "`megascale prepare` again"
            ) from None
        return _from_spec(spec, path)
    return open_tokenizer_file(path)


def _from_spec(spec: dict, dataset_dir: str | Path | None) -> Tokenizer:
    kind = spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind not in ("bpe", "file") or dataset_dir is None:
        raise DataError(
            f"data: tokenizer spec {spec!r} is not readable here (kind 'byte', 'bpe' or "
            "'file' with its dataset directory); prepare the dataset again"
        )
    path = Path(dataset_dir) / spec.get("file", TOKENIZER_FILE)
    if not path.is_file():
        raise DataError(
            f"data: tokenizer file {path} is missing; delete {dataset_dir} and run `megascale prepare` again"
        )
    if "sha256" in spec and file_sha256(path) != spec["sha256"]:
        raise DataError(
            f"data: tokenizer file {path} does not match the sha256 in meta.json; delete "
            f"{dataset_dir} and run `megascale prepare` again"
        )
    return JsonTokenizer(
        tokenizers.Tokenizer.from_file(str(path)), kind=kind, origin=spec.get("origin"), source_file=path
    )


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
