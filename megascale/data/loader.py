"""The loaders the trainer uses: an endless, resumable training stream and a fixed validation set.

`build_dataloaders` is the single entry point: it prepares (or finds) the dataset (each source's, for a
mixture), opens and verifies it, checks that the tokenizer fits the model's embedding, splits it by
documents and packs each split into sequences; with data.streaming it builds streaming.py's loaders
instead. A batch is a memmap slice copied into int64 tensors. MegaScale's two improvements to the
pipeline (paper §3.4) are options of the training loader: a background thread prepares the next step's
batches while this step runs (data.prefetch, prefetch.py), and the ranks of a node that take the same
batches read them once, into shared memory (data.share_per_node, node_share.py). Reading from the page
cache costs microseconds; both matter when storage is slow or remote.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from megascale.config import DataConfig
from megascale.data.dataset import Batch, PackedSequences, split_by_documents, split_rows
from megascale.data.mixture import ConcatSequences, MixtureSampler, ScheduledSequences
from megascale.data.node_share import RingReader, RingWriter, open_shared_ring
from megascale.data.prefetch import Prefetcher
from megascale.data.prepare import prepare_sources
from megascale.data.sampler import SequenceSampler
from megascale.data.shards import TokenShards
from megascale.data.sources import Source, data_sources
from megascale.data.streaming import StreamingTrainLoader, build_streaming_loaders
from megascale.data.tokenizer import Tokenizer
from megascale.data.validation import ValLoader, mixed_validation
from megascale.errors import DataError

log = logging.getLogger(__name__)


class TrainLoader(Stateful):
    """Iterator of (inputs, labels), int64 [micro_batch_size, seq_len]; never ends. Its state is the
    sampler's position after the last batch the trainer took (never a prefetched one), so a resumed run
    continues with exactly the batches it would have seen, whether or not either run prefetched.

    With `prefetch_batches` > 0 a daemon thread keeps that many batches ready ahead (prefetch.py). With a
    `ring` this rank either reads each batch and publishes it to the others of its node (a RingWriter) or
    takes each batch from the one that reads (a RingReader, which then never touches the shards). `stop`
    is the flag the ring's waits watch; `timeout_s` bounds a wait for a prefetched batch. `close()` ends
    the thread and leaves the ring; call it when training ends.
    """

    def __init__(
        self,
        sequences: PackedSequences | ConcatSequences,
        sampler: SequenceSampler,
        tokenizer: Tokenizer,
        *,
        prefetch_batches: int = 0,
        ring: RingWriter | RingReader | None = None,
        stop: threading.Event | None = None,
        timeout_s: float | None = None,
    ):
        self.sequences = sequences
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.dataset_dir: Path = sequences.directory
        self.num_tokens = sequences.num_tokens
        self.num_sequences = sequences.num_sequences
        self.seq_len = sequences.seq_len
        self.micro_batch_size = sampler.micro_batch_size
        self.ring = ring
        self.timeout_s = timeout_s
        self._closed = False
        # The thread gets the batch source, never the loader: dropping the loader then ends the thread.
        source = TakeShared(ring) if isinstance(ring, RingReader) else ReadShards(sequences, sampler, ring)
        self._source = source
        self._prefetcher = (
            Prefetcher(
                source, sampler.positions_per_batch, prefetch_batches, stop=stop, name="megascale-data"
            )
            if prefetch_batches
            else None
        )

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise RuntimeError("data: the training loader is closed")
        position = self.sampler.consumed_sequences
        if self._prefetcher is None:
            batch = self._source(position)
        else:
            batch = self._prefetcher.take(position, self.timeout_s, self._waiting_for)
        if isinstance(self._source, ReadShards):
            self.sequences.check_unchanged()  # the batch was read from the prepared shards
        self.sampler.consumed_sequences = position + self.sampler.positions_per_batch  # taken: now state
        return batch

    def _waiting_for(self) -> str:
        return self.ring.waiting_for() if self.ring is not None else "its read of the shards"

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Move the stream; batches prepared for the old position are discarded."""
        self.sampler.load_state_dict(state_dict)
        if self._prefetcher is not None:
            self._prefetcher.stop()

    def close(self) -> None:
        """End the prefetch thread and leave the node's shared ring; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._prefetcher is not None:
            self._prefetcher.stop()
        if self.ring is not None:
            self.ring.close()


class ReadShards:
    """This rank's batch at a stream position, read from the shards; published to the node's other ranks
    too when this rank is their reader."""

    def __init__(
        self, sequences: PackedSequences | ConcatSequences, sampler: SequenceSampler, ring: RingWriter | None
    ):
        self.sequences, self.sampler, self.ring = sequences, sampler, ring

    def __call__(self, position: int) -> Batch:
        rows = self.sequences.rows(self.sampler.indices_for(position))
        if self.ring is not None:
            self.ring.publish(position, rows)
        return split_rows(rows)


class TakeShared:
    """This rank's batch at a stream position, taken from the node's shared ring (read by another rank)."""

    def __init__(self, ring: RingReader):
        self.ring = ring

    def __call__(self, position: int) -> Batch:
        return split_rows(self.ring.take(position))


def build_dataloaders(
    cfg: DataConfig,
    *,
    model_vocab_size: int,
    micro_batch_size: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    micro_batches_per_step: int = 1,
    timeout_s: float = 600.0,
    progress: bool = True,
) -> tuple[TrainLoader | StreamingTrainLoader, ValLoader]:
    """Prepare or reuse the dataset of `cfg` (every source of data.mixture), check it fits the model, and
    return its two loaders; with data.streaming, the streaming loaders (streaming.py) instead.

    Every rank calls this; preparation is shared through the cache (the first rank writes, the others
    wait on its lock), and only rank 0 draws a progress bar. In a multi-process job with
    data.share_per_node it is collective over the default process group (ranks find the others of their
    node that take the same batches: same `dp_rank`); waits on another rank give up after `timeout_s`.
    `micro_batches_per_step` (the gradient accumulation) scales data.prefetch, counted in steps.
    """
    if cfg.streaming:
        return build_streaming_loaders(
            cfg,
            model_vocab_size=model_vocab_size,
            micro_batch_size=micro_batch_size,
            seed=seed,
            dp_rank=dp_rank,
            dp_size=dp_size,
            micro_batches_per_step=micro_batches_per_step,
        )
    sources = data_sources(cfg)
    dataset_dirs = prepare_sources(cfg, progress=progress and dp_rank == 0)
    splits = [open_split(cfg, directory, model_vocab_size) for directory in dataset_dirs]
    check_same_tokenizer(sources, splits)
    train: PackedSequences | ConcatSequences
    val: PackedSequences | ScheduledSequences | None
    sampler: SequenceSampler
    if len(splits) == 1:
        train, val = splits[0].train, splits[0].val
        sampler = SequenceSampler(train.num_sequences, seed, micro_batch_size, dp_rank, dp_size)
    else:
        weights = [source.weight for source in sources]
        train = ConcatSequences([split.train for split in splits])
        sampler = MixtureSampler(
            [len(split.train) for split in splits], weights, seed, micro_batch_size, dp_rank, dp_size
        )
        val = mixed_validation([split.val for split in splits], weights)
    prefetch_batches = cfg.prefetch * micro_batches_per_step
    stop = threading.Event()  # ends the ring's waits when the prefetch thread is stopped
    ring = None
    if cfg.share_per_node and dist.is_initialized() and dist.get_world_size() > 1:
        ring = open_shared_ring(
            dp_rank,
            micro_batch_size,
            cfg.seq_len + 1,
            slots=micro_batches_per_step * (cfg.prefetch + 2),
            stop=stop,
            timeout_s=timeout_s,
            wait_timeout_s=None if prefetch_batches else timeout_s,  # else the prefetcher bounds it
        )
    if isinstance(ring, RingWriter):
        log.info("data: this rank reads the batches of ranks %s too (shared memory)", list(ring.group.takers))
    elif isinstance(ring, RingReader):
        log.info("data: this rank takes its batches from rank %d (shared memory)", ring.group.reader)
    loader = TrainLoader(
        train,
        sampler,
        splits[0].tokenizer,
        prefetch_batches=prefetch_batches,
        ring=ring,
        stop=stop,
        timeout_s=timeout_s if ring is not None else None,
    )
    return loader, ValLoader(val, micro_batch_size, splits[0].tokenizer, train.directory)


@dataclass
class Split:
    """One prepared dataset, opened and split into packed training and validation sequences."""

    shards: TokenShards
    tokenizer: Tokenizer
    train: PackedSequences
    val: PackedSequences | None


def open_split(cfg: DataConfig, dataset_dir: Path, model_vocab_size: int) -> Split:
    """Open (and verify) a prepared dataset, check its tokenizer fits the model, split and pack it."""
    shards = TokenShards.open(dataset_dir, verify=cfg.verify)
    if shards.vocab_size > model_vocab_size:
        raise DataError(
            f"data: tokenizer of {dataset_dir} has {shards.vocab_size} tokens but "
            f"model.vocab_size = {model_vocab_size}; set --model.vocab_size={shards.vocab_size} "
            "(or a larger multiple of 8)"
        )
    split = split_by_documents(shards.doc_ends, cfg.val_fraction)
    train = PackedSequences(shards, split.train_tokens, cfg.seq_len, "training", split.num_train_documents)
    val = None
    if split.num_val_documents:
        val = PackedSequences(shards, split.val_tokens, cfg.seq_len, "validation", split.num_val_documents)
    elif cfg.val_fraction > 0:
        log.warning("data: %s has a single document, so there is no validation split", dataset_dir)
    log.info(
        "data: %s: %d training tokens (%d sequences of %d), %d validation tokens",
        dataset_dir,
        train.num_tokens,
        train.num_sequences,
        cfg.seq_len,
        val.num_tokens if val else 0,
    )
    return Split(shards, shards.tokenizer(), train, val)


def check_same_tokenizer(sources: list[Source], splits: list[Split]) -> None:
    """The sources of a mixture must be tokenized alike: same vocabulary, EOS and tokenizer file."""

    def signature(split: Split) -> tuple:
        spec = split.shards.meta["tokenizer"]
        return split.shards.vocab_size, split.shards.eos_id, spec.get("sha256")

    for source, split in zip(sources[1:], splits[1:]):
        if signature(split) != signature(splits[0]):
            raise DataError(
                f"data: {source.where} is prepared with another tokenizer ({split.shards.directory}) than "
                f"{sources[0].text!r} ({splits[0].shards.directory}); the sources of a mixture need one: "
                "set data.tokenizer to one tokenizer.json for all"
            )
