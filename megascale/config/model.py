"""The model section: the decoder-only Transformer's shape and its attention."""

from __future__ import annotations

from dataclasses import dataclass

from megascale.options import option, section


@dataclass
class AttentionConfig:
    """Attention: heads, grouped-query key/value heads, positions and the sliding window."""

    n_heads: int = option(8, "Number of query heads; must divide model.dim.", ge=1)
    n_kv_heads: int = option(
        4,
        "Key/value heads (grouped-query attention); must divide n_heads. "
        "Equal to n_heads gives multi-head attention.",
        ge=1,
    )
    window: int | None = option(
        None,
        "Sliding-window size W: token i attends to positions (i-W, i]. "
        "Unset means full causal attention (paper §3.1).",
        ge=1,
    )
    rope_theta: float = option(10000.0, "RoPE base frequency.", gt=0)


@dataclass
class ModelConfig:
    """Decoder-only transformer shape; Llama-style by default, GPT-style by options."""

    dim: int = option(256, "Hidden size.", ge=1)
    n_layers: int = option(4, "Number of transformer blocks.", ge=1)
    vocab_size: int = option(
        264,
        "Embedding rows; at least the tokenizer's vocabulary (the rest is "
        "padding, e.g. to a multiple of 8 or of the TP degree).",
        ge=2,
    )
    ffn_dim: int | None = option(
        None,
        "MLP hidden size; unset means 4*dim for GeLU and 8/3*dim rounded up to a multiple of 64 for SwiGLU.",
        ge=1,
    )
    max_seq_len: int = option(
        256,
        "Longest sequence the model accepts (size of the learned position table when position = 'learned').",
        ge=1,
    )
    block: str = option(
        "serial",
        "'serial': h = x + Attn(LN(x)); y = h + MLP(LN(h)). 'parallel': "
        "y = x + Attn(LN(x)) + MLP(LN(x)) (paper §3.1, Eq. 2).",
        choices=("serial", "parallel"),
    )
    norm: str = option("rmsnorm", "Normalisation layer.", choices=("rmsnorm", "layernorm"))
    mlp: str = option("swiglu", "MLP type: gated SiLU (Llama) or GeLU (GPT).", choices=("swiglu", "gelu"))
    position: str = option(
        "rope", "Positions: rotary (Llama) or a learned table (GPT).", choices=("rope", "learned")
    )
    norm_eps: float = option(1e-5, "Epsilon of the normalisation layers.", gt=0)
    tie_embeddings: bool = option(False, "Share the input embedding with the output projection.")
    init_std: float = option(
        0.02,
        "Standard deviation of the normal weight initialisation; output "
        "projections are scaled by 1/sqrt(2*n_layers).",
        gt=0,
    )
    attention: AttentionConfig = section(AttentionConfig)
