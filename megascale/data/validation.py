"""The validation loader: a fixed set of held-out sequences, shared out among data-parallel ranks."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from megascale.data.dataset import IGNORE_INDEX, Batch, PackedSequences
from megascale.data.mixture import MixtureSchedule, ScheduledSequences
from megascale.data.tokenizer import Tokenizer


class ValSequences(Protocol):
    """What validation reads: a split's packed sequences, a mixture of them, or streamed held-out ones."""

    @property
    def num_sequences(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    def batch(self, indices: Sequence[int]) -> Batch: ...


class ValLoader:
    """The validation split in order: a fixed set of sequences, shared out among data-parallel ranks.

    The first n sequences are the same whatever the layout, so the validation loss does not depend on it.
    With data.val_fraction = 0 (or a one-document dataset) there are no sequences and every share is
    empty.
    """

    def __init__(
        self,
        sequences: ValSequences | None,
        micro_batch_size: int,
        tokenizer: Tokenizer,
        dataset_dir: Path | str,
    ):
        self.sequences: ValSequences | None = sequences
        self.micro_batch_size = micro_batch_size
        self.tokenizer = tokenizer
        self.dataset_dir = dataset_dir
        self.num_tokens = sequences.num_tokens if sequences is not None else 0
        self.num_sequences = sequences.num_sequences if sequences is not None else 0

    def share(self, sequences: int, rank: int = 0, ranks: int = 1, unit: int = 1) -> list[Batch]:
        """Rank `rank` of `ranks`' share of the split's first `sequences` sequences (indices wrap where the
        split is shorter): a contiguous ceil(sequences / ranks) of them, in micro-batches, padded to a whole
        number of `unit` micro-batches with sequences whose labels are all IGNORE_INDEX. So every rank runs
        the same number of forwards (the collectives inside them pair up), and each of the `sequences`
        counts once in a loss summed over tokens."""
        if self.sequences is None:
            return []
        per_rank = -(-sequences // ranks)
        unit_sequences = unit * self.micro_batch_size
        slots = -(-per_rank // unit_sequences) * unit_sequences
        first = rank * per_rank
        real = max(0, min(per_rank, sequences - first))
        batches = []
        for start in range(0, slots, self.micro_batch_size):
            positions = range(start, start + self.micro_batch_size)
            inputs, labels = self.sequences.batch([(first + p) % self.num_sequences for p in positions])
            padding = torch.tensor([p >= real for p in positions])[:, None]
            labels = torch.where(padding, IGNORE_INDEX, labels)  # a new tensor: labels may view inputs' rows
            batches.append((inputs, labels))
        return batches


def mixed_validation(splits: list[PackedSequences | None], weights: list[float]) -> ScheduledSequences | None:
    """A mixture's validation sequences: the sources' validation splits, mixed by their weights (seed 0, so
    the set does not depend on the run's seed); a source without one (None) is left out."""
    parts = [(split, weight) for split, weight in zip(splits, weights, strict=True) if split is not None]
    if not parts:
        return None
    schedule = MixtureSchedule([weight for _, weight in parts], seed=0)
    return ScheduledSequences(
        [functools.partial(_cyclic, split) for split, _ in parts],
        schedule,
        sum(split.num_sequences for split, _ in parts),
        sum(split.num_tokens for split, _ in parts),
    )


def _cyclic(sequences: PackedSequences, index: int) -> np.ndarray:
    return sequences[index % sequences.num_sequences]
