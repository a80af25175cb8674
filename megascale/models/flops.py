"""Training FLOPs per token and parameter counts, from the model config alone.

Megatron-LM's accounting (Narayanan et al. 2021, which the MegaScale paper's MFU follows): every matmul
weight costs 6 FLOPs per token per parameter (forward 2, backward 4), and attention's two score matmuls
(QK^T and PV) cost 12 * layers * dim * span per token for fwd+bwd, where span is the number of keys a query
sees. Megatron counts the full sequence (no causal halving), so span = seq_len; with a sliding window
span = min(window, seq_len). Norms, activations and softmax are not counted, and neither is recomputation:
MFU counts model FLOPs, not hardware FLOPs. An MoE layer costs what a token computes: its router, its
`top_k` routed experts and the shared experts (the active parameters); the parameter count holds them all.
"""

from __future__ import annotations

from megascale.config import ModelConfig, head_dim_of
from megascale.models.feed_forward import ffn_dim_of
from megascale.models.moe import expert_dim_of


def _mlp_params(cfg: ModelConfig, hidden: int) -> int:
    return (3 if cfg.mlp == "swiglu" else 2) * cfg.dim * hidden


def attention_params(cfg: ModelConfig) -> int:
    head_dim = head_dim_of(cfg)
    return 2 * cfg.dim * cfg.attention.n_heads * head_dim + 2 * cfg.dim * cfg.attention.n_kv_heads * head_dim


def expert_params(cfg: ModelConfig) -> int:
    """Weights of one routed (or shared) expert of an MoE layer."""
    return _mlp_params(cfg, expert_dim_of(cfg))


def matmul_params_per_layer(cfg: ModelConfig) -> int:
    """Weights of one dense block's linear layers (q, k, v, o and the MLP)."""
    return attention_params(cfg) + _mlp_params(cfg, ffn_dim_of(cfg))


def matmul_params(cfg: ModelConfig, active: bool = False) -> int:
    """Weights of every block's linear layers; with `active`, of an MoE layer only those one token uses
    (router, top_k routed experts, shared experts)."""
    moe = cfg.moe
    dense = matmul_params_per_layer(cfg)
    if not moe.experts:
        return cfg.n_layers * dense
    expert = expert_params(cfg)
    routed = moe.top_k if active else moe.experts
    moe_layer = attention_params(cfg) + cfg.dim * moe.experts + (routed + moe.shared_experts) * expert
    return moe.dense_layers * dense + (cfg.n_layers - moe.dense_layers) * moe_layer


def num_params(cfg: ModelConfig) -> int:
    """All parameters of the model, embeddings included (tied ones counted once)."""
    norms_per_layer = (1 if cfg.block == "parallel" else 2) * cfg.dim
    norms_per_layer += 2 * head_dim_of(cfg) if cfg.attention.qk_norm else 0
    embeddings = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
    positions = cfg.max_seq_len * cfg.dim if cfg.position == "learned" else 0
    return matmul_params(cfg) + cfg.n_layers * norms_per_layer + embeddings + positions + cfg.dim


def attention_span(cfg: ModelConfig, seq_len: int) -> int:
    window = cfg.attention.window
    return seq_len if window is None else min(window, seq_len)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The attention scores' and weighted sum's FLOPs for one token, forward + backward, over its whole
    span (12 L h s: unhalved, whatever the mask, as Megatron-LM, PaLM and torchtitan count them)."""
    return 12 * cfg.n_layers * cfg.attention.n_heads * head_dim_of(cfg) * attention_span(cfg, seq_len)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs to train on one token (forward + backward) at this sequence length."""
    dense = matmul_params(cfg, active=True) + cfg.vocab_size * cfg.dim  # + the output layer
    return 6 * dense + attention_flops_per_token(cfg, seq_len)


def mfu(tokens_per_s: float, cfg: ModelConfig, seq_len: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak FLOP/s."""
    return tokens_per_s * flops_per_token(cfg, seq_len) / peak_flops
