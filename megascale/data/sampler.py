"""A deterministic, resumable order over training sequences, shared out across data-parallel ranks.

All ranks walk one global sample stream: position p is sequence perm_e[p % n] of epoch e = p // n, where
perm_e is a permutation seeded by (seed, e). A step hands each rank its contiguous slice of the next
micro_batch_size * dp_size positions, so the union over ranks is the dp_size = 1 stream. The only state
is the global position, a plain int: a checkpoint saved with one data-parallel layout resumes the same
stream under another.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

EPOCH_SEED_STRIDE = 1_000_003  # a prime, so (seed, epoch) pairs do not collide for epochs below it


class SequenceSampler(Stateful):
    """Yields this rank's micro-batch of sequence indices, forever (epochs roll over)."""

    def __init__(
        self, num_sequences: int, seed: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1
    ):
        if num_sequences < 1 or micro_batch_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"sampler: need num_sequences >= 1, micro_batch_size >= 1 and "
                f"0 <= dp_rank < dp_size; got {num_sequences}, {micro_batch_size}, "
                f"{dp_rank}, {dp_size}"
            )
        self.num_sequences = num_sequences
        self.seed = seed
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_sequences = 0  # global stream position, summed over all ranks
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def epoch(self) -> int:
        return self.consumed_sequences // self.num_sequences

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of epoch `epoch`; neighbouring epochs stay cached (a batch may straddle two)."""
        if epoch not in self._permutations:
            generator = torch.Generator().manual_seed(self.seed * EPOCH_SEED_STRIDE + epoch)
            self._permutations[epoch] = torch.randperm(self.num_sequences, generator=generator).numpy()
            for cached_epoch in [e for e in self._permutations if abs(e - epoch) > 1]:
                del self._permutations[cached_epoch]
        return self._permutations[epoch]

    def indices_at(self, start: int, count: int) -> list[int]:
        """Sequence indices of global stream positions [start, start + count)."""
        indices = []
        for position in range(start, start + count):
            epoch, offset = divmod(position, self.num_sequences)
            indices.append(int(self.permutation(epoch)[offset]))
        return indices

    @property
    def positions_per_batch(self) -> int:
        """How far the global stream moves for each micro-batch a rank takes (all ranks take one)."""
        return self.micro_batch_size * self.dp_size

    def indices_for(self, position: int) -> list[int]:
        """This rank's micro-batch when the global stream stands at `position`. A pure function of the
        position, so a prefetching thread can compute batches ahead without touching the state."""
        return self.indices_at(position + self.dp_rank * self.micro_batch_size, self.micro_batch_size)

    def __iter__(self) -> SequenceSampler:
        return self

    def __next__(self) -> list[int]:
        indices = self.indices_for(self.consumed_sequences)
        self.consumed_sequences += self.positions_per_batch
        return indices

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_sequences": self.consumed_sequences}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        consumed = int(state_dict["consumed_sequences"])
        if consumed < 0:
            raise ValueError(f"sampler: consumed_sequences = {consumed} must be >= 0")
        self.consumed_sequences = consumed
