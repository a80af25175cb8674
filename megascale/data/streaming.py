"""Streaming mode (data.streaming): train on `datasets` sources read, tokenized and packed while training.

There is no prepare step and nothing is cached: each source is read in file order and packed into
sequences as it goes (packing.py). The global sample stream is the same as for prepared data: position p
of the stream is a sequence of the source the mixture schedule picks for p (mixture.py; a lone source
takes every position), the next one that source's packer cuts. Data-parallel rank r takes positions
[pos + r*mb, pos + (r+1)*mb) of each micro-batch's mb * dp positions, as `SequenceSampler` hands them
out, so no two ranks train on the same sample and their union is the one-rank stream.

Every rank walks the whole stream (it reads and tokenizes every rank's sequences and keeps its own): that
makes the position one global state, identical on every rank, as a checkpoint needs it (DCP keeps one copy
of a value all ranks share, and a replicated restore broadcasts it), and lets a run resume under another
data-parallel layout. It costs each rank the tokenization of the whole global batch; where that is too
much, prepare the data (normal mode) instead.

The state is the position plus each source's `Cursor` after the last batch the trainer took, JSON in the
checkpoint beside the position. A resumed run reopens each source at its cursor's file and row and drops
the tokens before the offset: exactly the batches an uninterrupted run would have seen. Prefetching works
as for prepared data (prefetch.py): each batch comes with the state after it, and the loader adopts that
state only when the trainer takes the batch.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.distributed.checkpoint.stateful import Stateful

from megascale.config import DataConfig, fail
from megascale.data.dataset import Batch, split_rows
from megascale.data.mixture import MixtureSchedule
from megascale.data.packing import Cursor, HeldOut, Packer, SourceStream
from megascale.data.prefetch import Prefetcher
from megascale.data.prepare import cache_root
from megascale.data.sources import Source, data_sources, files_fingerprint, text_field
from megascale.data.tokenizer import Tokenizer, load_tokenizer
from megascale.data.validation import ValLoader
from megascale.errors import ConfigError, DataError

log = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclass(frozen=True)
class StreamState:
    """The global stream position and each source's cursor there."""

    position: int
    cursors: tuple[Cursor, ...]


class StreamProducer:
    """The batches of one data-parallel rank at a stream position, cut from the sources' packers; with each,
    the state after it. Positions must follow one another unless `rewind` moved the stream."""

    def __init__(
        self,
        streams: Sequence[SourceStream],
        schedule: MixtureSchedule | None,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ):
        self.streams, self.schedule, self.seq_len = list(streams), schedule, seq_len
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self._position = 0
        self._packers: list[Packer] = []
        self._restore(StreamState(0, tuple(Cursor() for _ in streams)))
        self._pending: StreamState | None = None

    @property
    def positions_per_batch(self) -> int:
        return self.micro_batch_size * self.dp_size

    def rewind(self, state: StreamState) -> None:
        """Go to `state` before the next batch (not at once: a packer already there is kept)."""
        self._pending = state

    def state(self) -> StreamState:
        cursors = [packer.cursor for packer in self._packers]
        assert all(cursor is not None for cursor in cursors)  # training documents never end
        return StreamState(self._position, tuple(c for c in cursors if c is not None))

    def __call__(self, position: int) -> tuple[np.ndarray, StreamState]:
        if self._pending is not None:
            if self._pending != self.state():
                self._restore(self._pending)
            self._pending = None
        if position != self._position:
            raise RuntimeError(f"data: the stream stands at position {self._position}, not {position}")
        first = position + self.dp_rank * self.micro_batch_size
        rows = []
        for at in range(position, position + self.positions_per_batch):
            source = self.schedule.locate(at)[0] if self.schedule is not None else 0
            sequence = self._packers[source].next_sequence()
            assert sequence is not None  # training documents never end
            if first <= at < first + self.micro_batch_size:
                rows.append(sequence)
        self._position = position + self.positions_per_batch
        return np.stack(rows), self.state()

    def _restore(self, state: StreamState) -> None:
        self._position = state.position
        self._packers = [
            Packer(stream.documents(cursor), self.seq_len, cursor.offset)
            for stream, cursor in zip(self.streams, state.cursors, strict=True)
        ]


class StreamingTrainLoader(Stateful):
    """Iterator of (inputs, labels), int64 [micro_batch_size, seq_len], read from the sources as it goes;
    never ends. `Stateful` like `TrainLoader`: its state is the position and cursors after the last batch
    the trainer took (`{"consumed_sequences": int, "stream": JSON}`)."""

    def __init__(
        self,
        producer: StreamProducer,
        sources: Sequence[Source],
        fingerprints: Sequence[str],
        tokenizer: Tokenizer,
        *,
        prefetch_batches: int = 0,
    ):
        self.producer, self.sources, self.fingerprints = producer, list(sources), list(fingerprints)
        self.tokenizer = tokenizer
        self.seq_len = producer.seq_len
        self.micro_batch_size = producer.micro_batch_size
        self.dataset_dir = f"{' + '.join(source.text for source in sources)} (streamed)"
        self.sequences = None  # nothing to index: the sequences exist only as they are read
        self.num_sequences = 0  # unknown until read
        self._state = StreamState(0, tuple(Cursor() for _ in sources))
        self._closed = False
        self._prefetcher = (
            Prefetcher(producer, producer.positions_per_batch, prefetch_batches, name="megascale-data")
            if prefetch_batches
            else None
        )

    @property
    def num_tokens(self) -> int:
        """Tokens of the global stream taken so far (the sources' sizes are not known ahead)."""
        return self._state.position * self.seq_len

    @property
    def epoch(self) -> int:
        return min(cursor.epoch for cursor in self._state.cursors)

    def __iter__(self) -> StreamingTrainLoader:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise RuntimeError("data: the training loader is closed")
        position = self._state.position
        if self._prefetcher is None:
            self.producer.rewind(self._state)
            rows, state = self.producer(position)
        else:
            if not self._prefetcher.running:  # (re)starting: from the state taken last
                self.producer.rewind(self._state)
            rows, state = self._prefetcher.take(position)
        self._state = state  # taken: now state
        return split_rows(rows)

    def state_dict(self) -> dict[str, Any]:
        sources = [
            {"source": source.text, "files": fingerprint, "cursor": cursor.to_list()}
            for source, fingerprint, cursor in zip(self.sources, self.fingerprints, self._state.cursors)
        ]
        stream = {"version": STATE_VERSION, "sources": sources}
        return {"consumed_sequences": self._state.position, "stream": json.dumps(stream)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Move the stream to a saved state; batches prepared for the old position are discarded. A source
        the state does not know (one added to data.mixture) starts at its beginning."""
        position = int(state_dict["consumed_sequences"])
        stream = json.loads(state_dict["stream"])
        if stream.get("version") != STATE_VERSION:
            raise DataError(
                f"data: the checkpoint's stream state has version {stream.get('version')!r}, this megascale "
                f"reads version {STATE_VERSION}; resume it with the megascale that wrote it"
            )
        saved = {entry["source"]: entry for entry in stream["sources"]}
        cursors = []
        for source, fingerprint in zip(self.sources, self.fingerprints, strict=True):
            entry = saved.get(source.text)
            if entry is None:
                log.info(
                    "data: %s is not in the checkpoint's stream; it starts at its beginning", source.where
                )
                cursors.append(Cursor())
            elif entry["files"] != fingerprint:
                raise DataError(
                    f"data: the files of {source.where} changed since the checkpoint (other paths or sizes), "
                    "so its position in them is lost; put the files back as they were, or train from a new "
                    "--training.run_dir"
                )
            else:
                cursors.append(Cursor.from_list(entry["cursor"]))
        if self._prefetcher is not None:
            self._prefetcher.stop()
        self._state = StreamState(position, tuple(cursors))

    def close(self) -> None:
        """End the prefetch thread; idempotent."""
        if not self._closed:
            self._closed = True
            if self._prefetcher is not None:
                self._prefetcher.stop()


class HeldOutSequences:
    """Streamed sources' validation sequences, mixed by the schedule of their weights (seed 0): sequence j is
    sequence k of source i, (i, k) = schedule.locate(j), a source's held-out sequences repeating from its
    first when they end. Read as far as they are asked for; `num_sequences` reads them all (once)."""

    def __init__(self, parts: Sequence[HeldOut], schedule: MixtureSchedule, seq_len: int):
        self.parts, self.schedule, self.seq_len = list(parts), schedule, seq_len

    @property
    def num_sequences(self) -> int:
        for part in self.parts:
            part.fill(sys.maxsize)
        return sum(len(part.sequences) for part in self.parts)

    @property
    def num_tokens(self) -> int:
        return self.num_sequences * self.seq_len

    def __getitem__(self, index: int) -> np.ndarray:
        source, k = self.schedule.locate(index)
        return self.parts[source](k)

    def batch(self, indices: Sequence[int]) -> Batch:
        return split_rows(np.stack([self[int(i)] for i in indices]))


class StreamingValLoader(ValLoader):
    """`ValLoader` over the sources' held-out documents (`HeldOutSequences`), read as far as validation asks;
    sources whose held-out documents fill no sequence are left out. `num_sequences` counts those read."""

    def __init__(
        self,
        held_out: Sequence[HeldOut],
        weights: Sequence[float],
        micro_batch_size: int,
        tokenizer: Tokenizer,
        description: str,
    ):
        super().__init__(None, micro_batch_size, tokenizer, description)
        for part in held_out:
            part.fill(1)
        usable = [(part, weight) for part, weight in zip(held_out, weights, strict=True) if part.sequences]
        if usable:
            schedule = MixtureSchedule([weight for _, weight in usable], seed=0)
            self.sequences = HeldOutSequences([part for part, _ in usable], schedule, held_out[0].seq_len)
            self.num_sequences = 1

    def share(self, sequences: int, rank: int = 0, ranks: int = 1, unit: int = 1) -> list[Batch]:
        if self.sequences is not None:  # every index exists (a source repeats its own): no wrap here
            self.num_sequences = max(self.num_sequences, sequences)
        return super().share(sequences, rank, ranks, unit)


def build_streaming_loaders(
    cfg: DataConfig,
    *,
    model_vocab_size: int,
    micro_batch_size: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    micro_batches_per_step: int = 1,
) -> tuple[StreamingTrainLoader, StreamingValLoader]:
    """The streaming loaders of `cfg` (data.streaming = true) for data-parallel rank `dp_rank`."""
    sources = data_sources(cfg)
    for source in sources:
        if source.hf_kind is None:
            raise ConfigError(
                f"config: {source.where} cannot be streamed: data.streaming reads parquet:, json:, arrow: "
                f"or hf-disk: sources (e.g. 'json:{source.text}'); name it so, or set data.streaming = false"
            )
    tokenizer = streaming_tokenizer(cfg, model_vocab_size)
    field = text_field(cfg)
    weights = [source.weight for source in sources]
    hf_cache = cache_root(cfg) / "hf"
    streams = [SourceStream(source, field, tokenizer, cfg.val_fraction, hf_cache) for source in sources]
    schedule = MixtureSchedule(weights, seed) if len(sources) > 1 else None
    producer = StreamProducer(streams, schedule, cfg.seq_len, micro_batch_size, dp_rank, dp_size)
    fingerprints = [files_fingerprint(stream.reader.files) for stream in streams]
    train = StreamingTrainLoader(
        producer, sources, fingerprints, tokenizer, prefetch_batches=cfg.prefetch * micro_batches_per_step
    )
    held_out = [  # none at val_fraction 0: reading on to find a held-out document would read everything
        HeldOut(SourceStream(source, field, tokenizer, cfg.val_fraction, hf_cache), cfg.seq_len)
        for source in sources
        if cfg.val_fraction > 0
    ]
    val = StreamingValLoader(
        held_out, weights[: len(held_out)], micro_batch_size, tokenizer, train.dataset_dir
    )
    if val.sequences is None and cfg.val_fraction > 0:
        log.warning("data: the held-out documents of %s fill no sequence: no validation", train.dataset_dir)
    log.info(
        "data: %s: %d files, tokenized as read; every rank reads the whole stream and takes its share",
        train.dataset_dir,
        sum(len(stream.reader.files) for stream in streams),
    )
    return train, val


def streaming_tokenizer(cfg: DataConfig, model_vocab_size: int) -> Tokenizer:
    """data.tokenizer for streaming: 'byte', a tokenizer.json or a prepared dataset's; checked against the
    model's embedding. 'bpe' is refused: it is trained on a whole corpus, before any of it is tokenized."""
    if cfg.tokenizer == "bpe":
        fail(
            "data.tokenizer",
            "bpe",
            "is trained on the whole corpus first, which streaming does not read ahead; prepare the data "
            "once with it (data.streaming = false) and set data.tokenizer to <its dataset>/tokenizer.json",
        )
    tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > model_vocab_size:
        raise DataError(
            f"data: tokenizer {cfg.tokenizer!r} has {tokenizer.vocab_size} tokens but model.vocab_size = "
            f"{model_vocab_size}; set --model.vocab_size={tokenizer.vocab_size} (or a larger multiple of 8)"
        )
    return tokenizer
