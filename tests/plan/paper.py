"""The models and layouts the planner's tests price: the MegaScale paper's (configs/paper-*.toml, its §6.1
setup) and the shapes of published GPTs and Llamas."""

import dataclasses
from pathlib import Path

from megascale.config import AttentionConfig, ModelConfig, MoEConfig, load_config

REPO = Path(__file__).resolve().parents[2]
MODEL_175B = load_config(REPO / "configs" / "paper-175b.toml").model
MODEL_530B = load_config(REPO / "configs" / "paper-530b.toml").model
# MegaScale §6.1: TP 8, PP 8 with 6 chunks a rank, ZeRO-2; micro-batch 1 (the paper does not say).
LAYOUT_175B = dict(tp=8, pp=8, virtual_stages=6, micro_batch=1, zero_stage=2, recompute="selective")


def with_ptb_swa(model: ModelConfig, ptb: bool = True, swa: bool = True) -> ModelConfig:
    """The paper's algorithmic changes (§3.1): the parallel block, a 512-token sliding window."""
    attention = dataclasses.replace(model.attention, window=512 if swa else None)
    return dataclasses.replace(model, block="parallel" if ptb else model.block, attention=attention)


def gpt(dim: int, layers: int, heads: int, vocab: int, seq_len: int, tied: bool = True) -> ModelConfig:
    """A GPT of Megatron's shape: LayerNorm, GeLU MLP 4h wide, learned positions, multi-head attention."""
    return ModelConfig(
        dim=dim,
        n_layers=layers,
        vocab_size=vocab,
        ffn_dim=4 * dim,
        max_seq_len=seq_len,
        norm="layernorm",
        mlp="gelu",
        position="learned",
        tie_embeddings=tied,
        attention=AttentionConfig(n_heads=heads, n_kv_heads=heads),
    )


def llama(
    dim: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq_len: int
) -> ModelConfig:
    """A Llama: RMSNorm, SwiGLU, RoPE, grouped-query attention, untied embeddings."""
    return ModelConfig(
        dim=dim,
        n_layers=layers,
        vocab_size=vocab,
        ffn_dim=ffn,
        max_seq_len=seq_len,
        tie_embeddings=False,
        attention=AttentionConfig(n_heads=heads, n_kv_heads=kv_heads),
    )


# MegaScale-MoE's Internal-352B (arXiv:2505.11432 §6), one shared expert a layer (which 352B needs).
MODEL_352B = ModelConfig(
    dim=4096,
    n_layers=60,
    vocab_size=65536,
    max_seq_len=8192,
    mlp="swiglu",
    attention=AttentionConfig(n_heads=32, n_kv_heads=8),
    moe=MoEConfig(experts=32, top_k=3, expert_dim=14336, shared_experts=1),
)
