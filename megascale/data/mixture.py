"""Data mixtures: which source each position of the global sample stream draws from, in the sources' weights.

The schedule cuts the stream into blocks of about BLOCK positions. Source i holds
c_i(b) = floor(b * BLOCK * w_i + 1/2) of the positions before block b (w normalised to sum to 1), so block
b holds c_i(b + 1) - c_i(b) positions of source i, shuffled by a generator seeded with (seed, b). Every
quantity is a pure function of the position: the k-th position of a source is found without walking the
stream, and a resumed run continues the same schedule. At each block end a source's count is within one
position of n * w_i, and inside a block it strays only by the block's shuffle, so the proportions converge
to the weights whatever they are (a weight of 0.0004 gets a position every 25 blocks).

`MixtureSampler` applies it to prepared sources (normal mode): position p is sequence k of source i's own
shuffled order (a `SequenceSampler` per source, each with its own epochs). The streaming loader applies it
to sources read in order. Validation mixes the sources' validation sequences by the same rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from megascale.data.dataset import PackedSequences, split_rows
from megascale.data.sampler import SequenceSampler

BLOCK = 100  # positions per block (about: a block's length varies by the rounding)
SCHEDULE_SALT = 0x6D697874  # keeps the block shuffles apart from other generators seeded by the run's seed
# Source i's own order is seeded with seed + i * SOURCE_SEED_STRIDE: distinct for seeds below the stride.
SOURCE_SEED_STRIDE = 2**20
CACHED_BLOCKS = 4


class MixtureSchedule:
    """Position -> (source, index of that position among the source's positions), for weights `weights`."""

    def __init__(self, weights: Sequence[float], seed: int):
        if not weights or min(weights) <= 0:
            raise ValueError(f"mixture: weights {list(weights)} must be positive, and at least one")
        total = float(np.sum(np.asarray(weights, dtype=np.float64)))
        self.shares = np.asarray(weights, dtype=np.float64) / total
        self.seed = seed
        self._blocks: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}

    @property
    def num_sources(self) -> int:
        return len(self.shares)

    def before(self, block: int) -> np.ndarray:
        """Positions of each source in the blocks before `block` (int64 per source)."""
        return np.floor(block * BLOCK * self.shares + 0.5).astype(np.int64)

    def locate(self, position: int) -> tuple[int, int]:
        """(source, k): `position` is the k-th position (from 0) that draws from `source`."""
        block = self._block_of(position)
        start, sources, indices = self._block(block)
        return int(sources[position - start]), int(indices[position - start])

    def _block_of(self, position: int) -> int:
        block = position // BLOCK
        while int(self.before(block).sum()) > position:
            block -= 1
        while int(self.before(block + 1).sum()) <= position:
            block += 1
        return block

    def _block(self, block: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(first position, source of each position, its index within its source) of `block`."""
        if block not in self._blocks:
            first, last = self.before(block), self.before(block + 1)
            sources = np.repeat(np.arange(self.num_sources), last - first)
            generator = np.random.default_rng([SCHEDULE_SALT, self.seed, block])
            sources = sources[generator.permutation(len(sources))]
            indices = np.empty(len(sources), dtype=np.int64)
            for source in range(self.num_sources):
                mine = sources == source
                indices[mine] = first[source] + np.arange(int(mine.sum()))
            if len(self._blocks) >= CACHED_BLOCKS:
                self._blocks.pop(next(iter(self._blocks)))  # the oldest: the stream moves forward
            self._blocks[block] = (int(first.sum()), sources, indices)
        return self._blocks[block]


class MixtureSampler(SequenceSampler):
    """A `SequenceSampler` over several prepared sources, their sequences numbered one after another
    (source i's first is `offsets[i]`): position p is sequence k of source i's own order, where
    (i, k) = schedule.locate(p). The state is the global position alone, as for one source."""

    def __init__(
        self,
        sizes: Sequence[int],
        weights: Sequence[float],
        seed: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        super().__init__(sum(sizes), seed, micro_batch_size, dp_rank, dp_size)
        self.schedule = MixtureSchedule(weights, seed)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.orders = [
            SequenceSampler(size, seed + i * SOURCE_SEED_STRIDE, 1) for i, size in enumerate(sizes)
        ]

    def indices_at(self, start: int, count: int) -> list[int]:
        indices = []
        for position in range(start, start + count):
            source, index = self.schedule.locate(position)
            indices.append(int(self.offsets[source]) + self.orders[source].indices_at(index, 1)[0])
        return indices


class ConcatSequences:
    """Several sources' packed sequences as one index space (source i's sequence j is offsets[i] + j): the
    training sequences of a mixture, for `TrainLoader`."""

    def __init__(self, parts: Sequence[PackedSequences]):
        self.parts = list(parts)
        self.offsets = np.concatenate([[0], np.cumsum([len(part) for part in parts])]).astype(np.int64)
        self.seq_len = parts[0].seq_len
        self.num_sequences = int(self.offsets[-1])
        self.num_tokens = sum(part.num_tokens for part in parts)
        self.directory = parts[0].directory

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, index: int) -> np.ndarray:
        source = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.parts[source][index - int(self.offsets[source])]

    def rows(self, indices: Sequence[int]) -> np.ndarray:
        return np.stack([self[int(i)] for i in indices])

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return split_rows(self.rows(indices))

    def check_unchanged(self) -> None:
        for part in self.parts:
            part.check_unchanged()


class ScheduledSequences:
    """Validation sequences of a mixture: sequence j is sequence k of source i, (i, k) = schedule.locate(j),
    each source's own sequences taken in order and repeated when it has fewer. `sequence_of[i](k)` gives
    source i's k-th (wrapping itself)."""

    def __init__(
        self,
        sequence_of: Sequence[Callable[[int], np.ndarray]],
        schedule: MixtureSchedule,
        num_sequences: int,
        num_tokens: int,
    ):
        self.sequence_of = list(sequence_of)
        self.schedule = schedule
        self.num_sequences = num_sequences
        self.num_tokens = num_tokens

    def __getitem__(self, index: int) -> np.ndarray:
        source, k = self.schedule.locate(index)
        return self.sequence_of[source](k)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return split_rows(np.stack([self[int(i)] for i in indices]))
