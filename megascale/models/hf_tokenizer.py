"""A run's tokenizer as the files transformers loads beside an exported model (`AutoTokenizer`).

Written as `tokenizer.json` (the `tokenizers` format) with a `tokenizer_config.json` naming
`PreTrainedTokenizerFast`, so no tokenizer class of ours is needed on the other side. The byte tokenizer
(ids 0-255 the UTF-8 bytes, 256 end of document) becomes a byte-level BPE with no merges whose 256 symbols
are GPT-2's byte alphabet in byte order: each byte keeps its id. In training a document begins after an
end-of-document token, so for megascale's own tokenizers that token is also the beginning-of-sequence token
and the exported tokenizer puts it before every text it encodes (a post-processor): a prompt encoded by
transformers is the sequence `megascale generate` feeds the model. A user's tokenizer file is written
unchanged, with its own special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from megascale.data.tokenizer import BPE_EOS_TOKEN, TOKENIZER_FILE, ByteTokenizer, JsonTokenizer, Tokenizer

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value, in byte order (the ByteLevel pre-tokenizer's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [value for value in range(256) if value not in printable]
    stand_in = dict(zip(printable, printable)) | {value: 256 + n for n, value in enumerate(others)}
    return [chr(stand_in[value]) for value in range(256)]


def byte_level_tokenizer() -> tokenizers.Tokenizer:
    """The byte tokenizer in `tokenizers`' form: the same ids for every text."""
    vocab = {symbol: value for value, symbol in enumerate(byte_alphabet())}
    vocab[BPE_EOS_TOKEN] = ByteTokenizer.eos_id
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([BPE_EOS_TOKEN])
    return backend


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: Path, max_length: int) -> dict[str, int]:
    """Write `tokenizer` into the Hugging Face folder `out_dir`; returns the special token ids for the
    model's config.json."""
    if isinstance(tokenizer, ByteTokenizer):
        backend, eos, kind = byte_level_tokenizer(), BPE_EOS_TOKEN, "byte"
    else:
        assert isinstance(tokenizer, JsonTokenizer)
        backend = tokenizers.Tokenizer.from_str(tokenizer.to_json())
        eos, kind = tokenizer.eos_token, tokenizer.kind
    settings: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    ids = {"eos_token_id": tokenizer.eos_id}
    if kind in ("byte", "bpe"):  # ours: a document begins after an end of document
        backend.post_processor = processors.TemplateProcessing(
            single=f"{eos} $A", pair=f"{eos} $A {eos} $B", special_tokens=[(eos, tokenizer.eos_id)]
        )
        settings["bos_token"] = eos
        ids["bos_token_id"] = tokenizer.eos_id
    backend.save(str(out_dir / TOKENIZER_FILE))
    (out_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    return ids
