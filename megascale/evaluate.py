"""`megascale eval`: a checkpoint's loss, perplexity and bits per byte on a split of a dataset.

The checkpoint of any layout is loaded into one process (`convert.load_trained`, which verifies it as
`megascale generate` does) and scored on the split of the run's dataset, or of another one given by
`--data.*` overrides (its tokenizer must be the run's), over the same sequences the trainer validates on:
the split's first `training.val_sequences` by default (`--sequences N` for more, 0 for the whole split),
packed as in training, with the run's compute dtype. So on the run's own validation split the loss is the
one the trainer logged at that step.

Bits per byte divide the summed loss (in bits) by the UTF-8 bytes of the tokens scored: a figure that
does not depend on the tokenizer, which is what compares runs with different vocabularies. A token's
bytes are its byte-level symbols (megascale's byte and BPE tokenizers, GPT-2-style files), or the UTF-8 of
its decoded text for other tokenizer files; special tokens count none.

Benchmarks (lm-evaluation-harness) run on the Hugging Face export, which carries the tokenizer
(docs/models.md, "Sampling from and scoring a checkpoint").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megascale.config import JobConfig, apply_overrides
from megascale.data.dataset import IGNORE_INDEX
from megascale.data.tokenizer import ByteTokenizer, JsonTokenizer, Tokenizer
from megascale.errors import ConfigError
from megascale.parallel.distributed import pick_device


@dataclass(frozen=True)
class Score:
    """What `evaluate` measured."""

    loss: float  # mean next-token loss over the tokens scored, in nats
    tokens: int
    bytes: int
    sequences: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float:
        return self.loss * self.tokens / math.log(2) / max(self.bytes, 1)


def token_bytes(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens)."""
    if isinstance(tokenizer, ByteTokenizer):
        counts = np.ones(tokenizer.vocab_size, dtype=np.int64)
        counts[tokenizer.eos_id] = 0
        return counts
    assert isinstance(tokenizer, JsonTokenizer)
    inner = tokenizer.backend
    special = {token.content for token in inner.get_added_tokens_decoder().values() if token.special}
    byte_level = type(inner.decoder).__name__ == "ByteLevel"  # each symbol is one byte (GPT-2's alphabet)
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for piece, token_id in inner.get_vocab(with_added_tokens=True).items():
        if piece not in special:
            counts[token_id] = len(piece) if byte_level else len(tokenizer.decode([token_id]).encode())
    return counts


@torch.no_grad()
def evaluate(
    source: Path,
    overrides: list[str] | None = None,
    split: str = "validation",
    sequences: int | None = None,
    device: str = "cpu",
) -> Score:
    """Score the model of `source` (a run directory or a checkpoint) on `split` ('validation' or
    'training') of its dataset with `overrides` (`--data.*=...`) applied, over its first `sequences` (the
    run's training.val_sequences by default, 0 for all), on `device` ('auto': the accelerator if there is
    one; untested on GPU)."""
    from megascale.convert import load_trained
    from megascale.data import build_dataloaders
    from megascale.trainer import next_token_loss

    on = pick_device(device)
    trained = load_trained(source, on)
    model, job = trained.model, _with_data_overrides(trained.job, overrides or [])
    if split not in ("validation", "training"):
        raise ConfigError(f"eval: --split {split!r} is not a split; use 'validation' or 'training'")
    train, val = build_dataloaders(
        job.data,
        model_vocab_size=job.model.vocab_size,
        micro_batch_size=job.training.micro_batch_size,
        seed=job.training.seed,
        progress=False,
    )
    train.close()  # only its sequences are read, never its stream
    packed = val.sequences if split == "validation" else train.sequences
    if packed is None and job.data.streaming:
        raise ConfigError(
            f"eval: --split {split} of a streamed source (data.streaming = true) is read only in order; "
            "score --split validation, or the prepared source with --data.streaming=false"
        )
    if packed is None:
        raise ConfigError(f"eval: {val.dataset_dir} has no {split} split (data.val_fraction = 0?)")
    count = job.training.val_sequences if sequences is None else sequences or packed.num_sequences
    bytes_of = torch.from_numpy(token_bytes(val.tokenizer))
    autocast = torch.autocast(on.type, torch.bfloat16, enabled=job.training.dtype == "bfloat16")
    loss_sum, tokens, scored_bytes = 0.0, 0, 0
    step = job.training.micro_batch_size
    for start in range(0, count, step):
        indices = [index % packed.num_sequences for index in range(start, min(start + step, count))]
        inputs, labels = packed.batch(indices)
        with autocast:  # a sum over the real labels (next_token_loss divides by every slot)
            loss_sum += float(next_token_loss(model(inputs.to(on)), labels.to(on))) * labels.numel()
        real = labels[labels != IGNORE_INDEX]
        tokens += real.numel()
        scored_bytes += int(bytes_of[real].sum())
    return Score(loss=loss_sum / tokens, tokens=tokens, bytes=scored_bytes, sequences=count)


def _with_data_overrides(job: JobConfig, overrides: list[str]) -> JobConfig:
    """The run's config with `--data.*` overrides: another dataset (or split of it) to score on."""
    for override in overrides:
        if not override.startswith("--data."):
            raise ConfigError(f"eval: {override} is not a data field; eval takes --data.* overrides only")
    return apply_overrides(job, overrides)
