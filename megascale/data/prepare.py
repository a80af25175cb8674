"""Turn a text corpus into token shards once; later runs find them in the cache.

The output directory is named by a hash of everything that decides its bytes (the corpus identity, the
tokenizer, the format version), so `megascale train` with no flags prepares the default corpus on first
use and reuses it afterwards. The dataset is written into a temporary sibling directory and renamed into
place at the end: a crash never leaves a half-written dataset under the final name, and a directory that
exists under the final name is complete. A file lock next to the target makes concurrent preparers (one
per rank on a node) wait for the first instead of repeating its work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import itertools
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from megascale.config import DataConfig, fail
from megascale.data.corpus import Corpus, open_corpus
from megascale.data.hf import HFCorpus
from megascale.data.megatron import MegatronCorpus, megatron_prefix
from megascale.data.shards import DOCS_DTYPE, FORMAT_NAME, FORMAT_VERSION, META_FILE, shard_names, token_dtype
from megascale.data.sources import Source, data_sources, text_field
from megascale.data.tokenizer import (
    ByteTokenizer,
    Tokenizer,
    open_tokenizer_file,
    tokenizer_identity,
    train_bpe,
)
from megascale.errors import DataError

log = logging.getLogger(__name__)

SHUFFLE_SEED = 20240214  # fixed: the document order is part of the dataset, not of the run's seed
SHARD_TOKENS = 16 * 2**20  # a shard closes after the document that reaches this many tokens
ENCODE_BATCH_DOCUMENTS = 256  # documents per tokenizer call: big enough for encode_batch's threads
BPE_TRAIN_MAX_BYTES = 256 * 2**20  # BPE merges stabilise long before this; bounds time and memory


def prepare_dataset(cfg: DataConfig, out_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Tokenize cfg.source into shards and return the dataset directory (a cached one if present).

    A cfg.source that is already a prepared dataset (has meta.json) is returned unchanged. Otherwise the
    dataset goes to `out_dir`, or by default to <cache_dir>/datasets/<name>-<tokenizer kind>-<key>. With
    data.mixture every source is prepared into the cache (`prepare_sources`) and the first one's
    directory is returned.
    """
    if cfg.mixture.strip():
        if out_dir is not None:
            fail(
                "data.mixture",
                cfg.mixture,
                "names several sources and --out takes one; leave --out out (each source goes to the "
                "cache) or prepare each source with --data.source=SOURCE --out DIR",
            )
        return prepare_sources(cfg, progress)[0]
    return _prepare_source(cfg, Source(cfg.source), out_dir, progress)


def prepare_sources(cfg: DataConfig, progress: bool = True) -> list[Path]:
    """The prepared dataset directory of each source of `cfg` (data.mixture's, or data.source alone)."""
    sources = data_sources(cfg)
    if len(sources) > 1 and cfg.tokenizer == "bpe":
        fail(
            "data.tokenizer",
            "bpe",
            "would train one tokenizer per source, and the sources of data.mixture must share one; "
            "prepare one source with it, then set data.tokenizer to <its dataset>/tokenizer.json",
        )
    return [
        _prepare_source(dataclasses.replace(cfg, source=source.text, mixture=""), source, None, progress)
        for source in sources
    ]


def _prepare_source(cfg: DataConfig, source: Source, out_dir: str | Path | None, progress: bool) -> Path:
    """`prepare_dataset` of cfg.source, which is `source` (named so in messages)."""
    source_dir = Path(cfg.source).expanduser()
    if source_dir.is_dir() and (source_dir / META_FILE).is_file():
        return source_dir
    corpus = _open_source(cfg, source, progress)
    tokenizer_id = tokenizer_identity(cfg.tokenizer, cfg.bpe_vocab_size)
    key = dataset_key(corpus.identity, tokenizer_id)
    if out_dir is None:
        dirname = f"{corpus.name}-{tokenizer_id['kind']}-{key}"
        target = cache_root(cfg) / "datasets" / dirname
    else:
        target = Path(out_dir).expanduser()
    if _is_complete(target, key):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target):
        if _is_complete(target, key):  # another process finished it while we waited
            return target
        _remove_stale_temporaries(target)
        started_s = time.perf_counter()
        meta = _build(cfg, corpus, target, key, progress)
    log.info(
        "data: prepared %s: %d tokens in %d documents, %d shards, %.1f s (%d documents skipped as "
        "binary or not UTF-8)",
        target,
        meta["num_tokens"],
        meta["num_documents"],
        len(meta["shards"]),
        time.perf_counter() - started_s,
        meta["source"]["skipped_documents"],
    )
    return target


def cache_root(cfg: DataConfig) -> Path:
    """data.cache_dir; when left at its default, $MEGASCALE_CACHE overrides it (as for calibration), so a
    test suite or a shared machine can move every megascale cache at once."""
    if cfg.cache_dir == DataConfig().cache_dir and os.environ.get("MEGASCALE_CACHE"):
        return Path(os.environ["MEGASCALE_CACHE"]).expanduser()
    return Path(cfg.cache_dir).expanduser()


def dataset_key(corpus_identity: dict, tokenizer_id: dict) -> str:
    """Short hash of what decides a dataset's bytes: same key, same shards."""
    blob = json.dumps(
        {
            "corpus": corpus_identity,
            "tokenizer": tokenizer_id,
            "format": FORMAT_VERSION,
            "shuffle_seed": SHUFFLE_SEED,
            "shard_tokens": SHARD_TOKENS,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _is_complete(target: Path, key: str) -> bool:
    """True for a finished dataset of this key; a DataError for a directory we must not overwrite."""
    if not target.exists():
        return False
    if not target.is_dir():
        raise DataError(f"data: output {target} exists and is not a directory; choose another --out")
    meta_path = target / META_FILE
    if not meta_path.is_file():
        if any(target.iterdir()):
            raise DataError(
                f"data: output {target} exists, is not empty and has no {META_FILE}; delete it "
                "or choose another --out"
            )
        return False  # an empty directory: the final rename replaces it
    try:
        found_key = json.loads(meta_path.read_text()).get("cache_key")
    except (ValueError, AttributeError):
        raise DataError(f"data: {meta_path} is not valid JSON; delete {target} and prepare again") from None
    if found_key != key:
        raise DataError(
            f"data: output {target} already holds another dataset (key {found_key}, wanted "
            f"{key}: other source or tokenizer); delete it or choose another --out"
        )
    return True


@contextlib.contextmanager
def _exclusive_lock(target: Path) -> Iterator[None]:
    """Block until no other process is preparing `target` (advisory flock on a hidden sibling file)."""
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_stale_temporaries(target: Path) -> None:
    """Temporary directories of preparers that were killed (we hold the lock, so none is live)."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _build(cfg: DataConfig, corpus: Corpus, target: Path, key: str, progress: bool) -> dict:
    """Write the whole dataset into a temporary sibling, then rename it to `target`; returns meta."""
    # Not tempfile.mkdtemp: its 0700 mode would make a shared cache or --out directory private.
    work_dir = target.parent / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    work_dir.mkdir()
    try:
        order = np.random.default_rng(SHUFFLE_SEED).permutation(corpus.num_documents)
        with _progress_display(progress) as display:
            tokenizer = _make_tokenizer(cfg, corpus, order, display)
            tokenizer_spec = tokenizer.save(work_dir)
            writer = ShardWriter(work_dir, tokenizer.vocab_size, tokenizer.eos_id, SHARD_TOKENS)
            task = None
            if display:
                task = display.add_task("tokenizing", total=corpus.num_documents, unit="documents")
            skipped = 0
            for done, ids in enumerate(_token_documents(corpus, tokenizer, order), start=1):
                if ids is None:
                    skipped += 1
                else:
                    writer.add_document(ids)
                if display and (done % ENCODE_BATCH_DOCUMENTS == 0 or done == corpus.num_documents):
                    assert task is not None  # added with the display
                    display.update(task, completed=done)
            writer.close()
        if writer.num_documents == 0:
            raise DataError(
                f"data.source = {cfg.source!r} has no readable documents ({skipped} skipped as "
                "binary or not UTF-8); give text files, or files for Hugging Face `datasets` named by their "
                "format: parquet:PATH, json:PATH (JSON Lines), arrow:PATH or hf-disk:DIR"
            )
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "cache_key": key,
            "source": corpus.describe() | {"skipped_documents": skipped},
            "shuffle_seed": SHUFFLE_SEED,
            "tokenizer": tokenizer_spec,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "dtype": writer.dtype.name,
            "byte_order": "little",
            "num_tokens": writer.num_tokens,
            "num_documents": writer.num_documents,
            "shards": writer.shards,
        }
        (work_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if target.exists():
            target.rmdir()  # only ever an empty directory here (checked by _is_complete)
        try:
            os.rename(work_dir, target)
        except OSError:
            # Without a working flock (some network filesystems) another node may have won the race.
            if not _is_complete(target, key):
                raise
            shutil.rmtree(work_dir, ignore_errors=True)
        return meta
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise


def _open_source(cfg: DataConfig, source: Source, progress: bool) -> Corpus:
    if source.hf_kind is not None:
        return HFCorpus(source, text_field(cfg), cache_root(cfg) / "hf", progress)
    prefix = megatron_prefix(cfg.source)
    if prefix is None:
        return open_corpus(cfg.source, text_field(cfg))
    if cfg.tokenizer == "bpe":
        raise DataError(
            f"data.source = {cfg.source!r} is already tokenized, so data.tokenizer = 'bpe' "
            "cannot apply; set --data.tokenizer to the tokenizer.json it was made with"
        )
    return MegatronCorpus(prefix)


def _token_documents(corpus: Corpus, tokenizer: Tokenizer, order: np.ndarray) -> Iterator[np.ndarray | None]:
    """Each document's ids (no EOS) in `order`, None for a skipped file; text is encoded in batches."""
    if isinstance(corpus, MegatronCorpus):
        yield from corpus.token_documents(order, tokenizer.vocab_size, tokenizer.eos_id)
        return
    texts = corpus.texts(order)
    while batch := list(itertools.islice(texts, ENCODE_BATCH_DOCUMENTS)):
        encoded = iter(tokenizer.encode_batch([text for text in batch if text is not None]))
        for text in batch:
            yield None if text is None else next(encoded)


def _make_tokenizer(
    cfg: DataConfig, corpus: Corpus, order: np.ndarray, display: Progress | None
) -> Tokenizer:
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer != "bpe":
        return open_tokenizer_file(cfg.tokenizer)
    task = None
    if display:
        task = display.add_task(f"training a {cfg.bpe_vocab_size}-token BPE", total=None, unit="")

    def training_texts() -> Iterator[str]:
        budget_bytes = BPE_TRAIN_MAX_BYTES
        for text in corpus.texts(order):
            if text is not None:
                yield text
                budget_bytes -= len(text)
                if budget_bytes <= 0:
                    return

    tokenizer = train_bpe(training_texts(), cfg.bpe_vocab_size)
    if display:
        assert task is not None  # added with the display
        display.update(task, total=1, completed=1)
    return tokenizer


@contextlib.contextmanager
def _progress_display(enabled: bool) -> Iterator[Progress | None]:
    if not enabled:
        yield None
        return
    columns = (
        SpinnerColumn(),
        TextColumn("[bold]data[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[unit]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns) as display:
        yield display


class ShardWriter:
    """Appends documents (each followed by EOS) and cuts ~SHARD_TOKENS-token shards at document ends."""

    def __init__(self, directory: Path, vocab_size: int, eos_id: int, shard_tokens: int = SHARD_TOKENS):
        self.directory = directory
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = vocab_size
        self.shard_tokens = shard_tokens
        self._eos = np.array([eos_id], dtype=self.dtype)
        self._pieces: list[np.ndarray] = []
        self._doc_ends: list[int] = []
        self._shard_token_count = 0
        self.shards: list[dict] = []
        self.num_tokens = 0
        self.num_documents = 0

    def add_document(self, ids: np.ndarray) -> None:
        if len(ids) and int(ids.max()) >= self.vocab_size:  # a tokenizer bug must not reach the shards
            raise ValueError(f"token id {int(ids.max())} >= vocab_size {self.vocab_size}")
        self._pieces += [ids.astype(self.dtype, copy=False), self._eos]
        self._shard_token_count += len(ids) + 1
        self._doc_ends.append(self._shard_token_count)
        if self._shard_token_count >= self.shard_tokens:
            self._flush()

    def close(self) -> None:
        if self._doc_ends:
            self._flush()

    def _flush(self) -> None:
        tokens = np.concatenate(self._pieces)
        doc_ends = np.asarray(self._doc_ends, dtype=DOCS_DTYPE)
        tokens_name, docs_name = shard_names(len(self.shards))
        self.shards.append(
            {
                "tokens_file": tokens_name,
                "docs_file": docs_name,
                "num_tokens": len(tokens),
                "num_documents": len(doc_ends),
                "tokens_bytes": tokens.nbytes,
                "docs_bytes": doc_ends.nbytes,
                "tokens_sha256": _write(self.directory / tokens_name, tokens),
                "docs_sha256": _write(self.directory / docs_name, doc_ends),
            }
        )
        self.num_tokens += len(tokens)
        self.num_documents += len(doc_ends)
        self._pieces, self._doc_ends, self._shard_token_count = [], [], 0


def _write(path: Path, array: np.ndarray) -> str:
    """Write the array's raw bytes; return their sha256."""
    data = np.ascontiguousarray(array).data.cast("B")
    with open(path, "wb") as file:
        file.write(data)
    return hashlib.sha256(data).hexdigest()
