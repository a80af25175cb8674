"""The loaders the trainer uses: an endless, resumable training stream and a fixed validation set.

`build_dataloaders` is the single entry point: it prepares (or finds) the dataset, opens and verifies
it, checks that the tokenizer fits the model's embedding, splits it by documents and packs each split
into sequences. A batch is a memmap slice copied into int64 tensors; there is no worker process or
prefetching, because reading 16 x 257 tokens from the page cache costs microseconds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from megascale.config import DataConfig
from megascale.data.dataset import PackedSequences, split_by_documents
from megascale.data.prepare import prepare_dataset
from megascale.data.sampler import SequenceSampler
from megascale.data.shards import TokenShards
from megascale.data.tokenizer import Tokenizer
from megascale.errors import DataError

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


class TrainLoader(Stateful):
    """Iterator of (inputs, labels), int64 [micro_batch_size, seq_len]; never ends. Its state is the
    sampler's position, so a resumed run continues with exactly the batches it would have seen."""

    def __init__(self, sequences: PackedSequences, sampler: SequenceSampler, tokenizer: Tokenizer):
        self.sequences = sequences
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.dataset_dir: Path = sequences.shards.directory
        self.num_tokens = sequences.num_tokens
        self.num_sequences = sequences.num_sequences
        self.seq_len = sequences.seq_len
        self.micro_batch_size = sampler.micro_batch_size

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> Batch:
        return self.sequences.batch(next(self.sampler))

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state_dict)


class ValLoader:
    """The validation split in order, as fixed micro-batches: every call to batches(n) yields the same.

    Every data-parallel rank sees the same batches, so the validation loss does not depend on the
    layout. With data.val_fraction = 0 (or a one-document dataset) there are no sequences and
    batches() yields nothing.
    """

    def __init__(
        self,
        sequences: PackedSequences | None,
        micro_batch_size: int,
        tokenizer: Tokenizer,
        dataset_dir: Path,
    ):
        self.sequences = sequences
        self.micro_batch_size = micro_batch_size
        self.tokenizer = tokenizer
        self.dataset_dir = dataset_dir
        self.num_tokens = sequences.num_tokens if sequences else 0
        self.num_sequences = sequences.num_sequences if sequences else 0

    def batches(self, n: int) -> Iterator[Batch]:
        """The first n micro-batches of the split; sequence indices wrap when the split is shorter."""
        if self.sequences is None:
            return
        for batch_index in range(n):
            first = batch_index * self.micro_batch_size
            indices = [(first + k) % self.num_sequences for k in range(self.micro_batch_size)]
            yield self.sequences.batch(indices)


def build_dataloaders(
    cfg: DataConfig,
    *,
    model_vocab_size: int,
    micro_batch_size: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    progress: bool = True,
) -> tuple[TrainLoader, ValLoader]:
    """Prepare or reuse the dataset of `cfg`, check it fits the model, and return its two loaders.

    Every rank calls this; preparation is shared through the cache (the first rank writes, the others
    wait on its lock), and only rank 0 draws a progress bar.
    """
    dataset_dir = prepare_dataset(cfg, progress=progress and dp_rank == 0)
    shards = TokenShards.open(dataset_dir, verify=cfg.verify)
    tokenizer = shards.tokenizer()
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
    sampler = SequenceSampler(train.num_sequences, seed, micro_batch_size, dp_rank, dp_size)
    log.info(
        "data: %s: %d training tokens (%d sequences of %d), %d validation tokens",
        dataset_dir,
        train.num_tokens,
        train.num_sequences,
        cfg.seq_len,
        val.num_tokens if val else 0,
    )
    return TrainLoader(train, sampler, tokenizer), ValLoader(val, micro_batch_size, tokenizer, dataset_dir)
