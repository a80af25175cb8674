"""The small model every parallelism test shards: 2 layers, dim 64, 4 query / 2 key-value heads."""

from megascale.config import AttentionConfig, ModelConfig

VOCAB = 96
SEQ = 32


def tiny_model_config(block: str = "serial", window: int | None = None, **options) -> ModelConfig:
    shape = dict(dim=64, n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ) | options
    return ModelConfig(
        block=block, attention=AttentionConfig(n_heads=4, n_kv_heads=2, window=window), **shape
    )
