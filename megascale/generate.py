"""`megascale generate`: sample text from a checkpoint, to see what a run has learnt.

The checkpoint of any layout is loaded into one process (`convert.load_trained`: DCP reshards on load) and
its tokenizer reopened from the run's dataset (`run_tokenizer`). It is verified first, as a resume verifies
it: a run directory's newest checkpoint whose files match their manifest's sizes and CRC-32s (a damaged
newer one passed over with a warning), or the checkpoint named, refused in one line if it is damaged.

A prompt is a document's beginning, so it follows an end-of-document token as every document does in
training. Each new token is drawn from the last position's logits: greedy at temperature 0, else
softmax(logits / temperature) cut to the `top_k` most likely and to the smallest set whose probability
reaches `top_p`, drawn with a generator seeded by `seed`, so one seed gives one text. Sampling stops at
the end-of-document token or after `max_new_tokens`.

No KV cache: each token runs the model over the last `model.max_seq_len` tokens again (the model code is
the training code, parallelism-free and cache-free), which is quick at the sizes a CPU trains and enough to
check a checkpoint; serving belongs to an inference engine reading the Hugging Face export.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

import torch

from megascale.convert import load_trained, run_tokenizer
from megascale.data.tokenizer import Tokenizer
from megascale.errors import ConfigError
from megascale.models.llama import Transformer
from megascale.parallel.distributed import pick_device


def next_token(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator
) -> int:
    """One token from a position's logits [vocab]: the most likely at temperature 0, else a draw."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        threshold = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, -torch.inf)
    probabilities = torch.softmax(logits, dim=-1)
    if top_p < 1:
        ordered, order = probabilities.sort(descending=True)
        before = ordered.cumsum(0) - ordered  # probability of the more likely tokens
        ordered = ordered.masked_fill(before >= top_p, 0.0)  # the most likely always stays
        probabilities = torch.zeros_like(probabilities).scatter(0, order, ordered)
    return int(torch.multinomial(probabilities, 1, generator=generator))


@torch.no_grad()
def sample(
    model: Transformer,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    eos_id: int,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    vocab_size: int | None = None,
) -> Iterator[int]:
    """The tokens after `prompt`, one at a time, up to `max_new_tokens` or the end-of-document token
    (included), drawn from the first `vocab_size` ids (the tokenizer's: the model's vocabulary may be
    padded, e.g. to a multiple of 8, with ids no text has)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    ids = list(prompt)
    context = model.cfg.max_seq_len
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-context:]], device=device)
        token = next_token(model(window)[0, -1, :vocab_size], temperature, top_k, top_p, generator)
        yield token
        if token == eos_id:
            return
        ids.append(token)


def stream_text(tokens: Iterator[int], tokenizer: Tokenizer, out: TextIO) -> str:
    """Write the text of `tokens` to `out` as they come, holding back a character still incomplete (a
    byte or BPE token may end inside one); returns the whole text."""
    ids: list[int] = []
    written = 0
    text = ""
    for token in tokens:
        ids.append(token)
        text = tokenizer.decode(ids)
        ready = len(text.rstrip("\ufffd"))
        if ready > written:
            out.write(text[written:ready])
            out.flush()
            written = ready
    out.write(text[written:] + "\n")
    out.flush()
    return text


def generate(
    source: Path,
    prompt: str = "",
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    tokenizer: str | None = None,
    device: str = "cpu",
    out: TextIO = sys.stdout,
) -> str:
    """Sample from the model of `source` (a run directory or a checkpoint) after `prompt`, on `device`
    ('auto': the accelerator if there is one; untested on GPU), streaming the text to `out`; returns the
    generated text (the prompt not included)."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_new_tokens < 1:
        raise ConfigError(
            f"generate: --temperature {temperature}, --top-k {top_k}, --top-p {top_p}, --max-new-tokens "
            f"{max_new_tokens}: need temperature >= 0, top-k >= 0 (0: all), 0 < top-p <= 1, max-new-tokens "
            ">= 1"
        )
    trained = load_trained(source, pick_device(device))
    model = trained.model
    if tokenizer is None and not trained.records_data:
        raise ConfigError(
            f"generate: {trained.checkpoint} records no dataset (an imported model); give its tokenizer "
            "with --tokenizer PATH/tokenizer.json"
        )
    vocabulary = run_tokenizer(trained.job.data, tokenizer)
    if vocabulary.vocab_size > model.cfg.vocab_size:
        raise ConfigError(
            f"generate: the tokenizer has {vocabulary.vocab_size} tokens, the model's vocabulary "
            f"{model.cfg.vocab_size}; give the run's tokenizer with --tokenizer"
        )
    ids = [vocabulary.eos_id, *vocabulary.encode(prompt)]  # a document begins after an end of document
    tokens = sample(
        model,
        ids,
        max_new_tokens=max_new_tokens,
        eos_id=vocabulary.eos_id,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        vocab_size=vocabulary.vocab_size,
    )
    out.write(prompt)
    return stream_text(tokens, vocabulary, out)
