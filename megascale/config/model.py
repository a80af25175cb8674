"""The model section: the decoder-only Transformer's shape and its attention."""

from __future__ import annotations

from dataclasses import dataclass

from megascale.options import option, section


@dataclass
class RopeScalingConfig:
    """RoPE scaling for a context longer than pre-training's, as Hugging Face's rope_parameters define it."""

    type: str = option(
        "none",
        "'none': plain RoPE; 'linear': every frequency divided by factor (position interpolation); "
        "'dynamic': NTK-aware, which changes nothing within model.max_seq_len (Hugging Face applies it past "
        "max_position_embeddings, at inference; kept for export); 'yarn': frequencies blended between "
        "interpolated and original by rotations over original_max_seq_len, cos/sin times attention_factor; "
        "'llama3': Llama 3.1's, long wavelengths divided by factor, short ones kept, a ramp between.",
        choices=("none", "linear", "dynamic", "yarn", "llama3"),
    )
    factor: float = option(1.0, "How many times longer the context is than original_max_seq_len.", gt=0)
    original_max_seq_len: int | None = option(
        None, "The pre-training context length ('yarn', 'llama3': required).", ge=1
    )
    low_freq_factor: float = option(
        1.0, "'llama3': wavelengths over original_max_seq_len / this are divided by factor.", gt=0
    )
    high_freq_factor: float = option(
        4.0, "'llama3': wavelengths under original_max_seq_len / this are kept as they are.", gt=0
    )
    beta_fast: float = option(32.0, "'yarn': rotations above which a frequency is kept as it is.", gt=0)
    beta_slow: float = option(1.0, "'yarn': rotations below which a frequency is interpolated.", gt=0)
    truncate: bool = option(True, "'yarn': round the blended range of frequencies outward to whole ones.")
    attention_factor: float | None = option(
        None,
        "'yarn': cos/sin are multiplied by this; unset: 0.1 ln(factor) + 1, or with mscale and "
        "mscale_all_dim the ratio of that formula with each (DeepSeek).",
        gt=0,
    )
    mscale: float | None = option(None, "'yarn': see attention_factor.", gt=0)
    mscale_all_dim: float | None = option(None, "'yarn': see attention_factor.", gt=0)


@dataclass
class AttentionConfig:
    """Attention: heads, grouped-query key/value heads, positions and the sliding window."""

    n_heads: int = option(8, "Number of query heads; must divide model.dim unless head_dim is set.", ge=1)
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
    head_dim: int | None = option(
        None, "Size of each attention head; unset: model.dim / n_heads (Qwen3 sets it apart).", ge=1
    )
    qk_norm: bool = option(
        False,
        "RMSNorm over each head's queries and keys before RoPE (Qwen3); its gain is shared by the heads.",
    )
    rope_scaling: RopeScalingConfig = section(RopeScalingConfig)


@dataclass
class MoEConfig:
    """Mixture of experts in the feed-forward layers (docs/moe.md): routed experts chosen per token by a
    top-k router, optional shared experts every token passes through."""

    experts: int = option(0, "Routed experts per MoE layer; 0 makes a dense model.", ge=0)
    top_k: int = option(2, "Experts each token is routed to; at most `experts`.", ge=1)
    expert_dim: int | None = option(
        None, "Hidden size of each expert (and of each shared expert); unset: model.ffn_dim's.", ge=1
    )
    shared_experts: int = option(
        0, "Shared experts every token passes through (DeepSeek, Qwen2-MoE style), added to the routed.", ge=0
    )
    dense_layers: int = option(
        0, "The first this many layers keep a dense feed-forward layer (DeepSeek-V3: 3 of 61).", ge=0
    )
    score: str = option(
        "softmax",
        "Router scores: 'softmax' over the experts (Mixtral, Qwen3-MoE) or each expert's 'sigmoid' "
        "(DeepSeek-V3).",
        choices=("softmax", "sigmoid"),
    )
    normalize_weights: bool = option(
        True,
        "Divide the chosen experts' scores by their sum (Mixtral; Qwen3-MoE's norm_topk_prob); sigmoid "
        "scores are always normalised.",
    )
    route_scale: float = option(
        1.0, "Factor on the routed experts' weights (DeepSeek-V3's routed_scaling_factor: 2.5).", gt=0
    )
    aux_loss_coeff: float = option(
        0.0,
        "Weight of the load-balancing loss E * sum_i(f_i * P_i) (Switch Transformer) of each MoE layer, "
        "per sequence and averaged over the step's sequences; 0 turns it off.",
        ge=0,
    )
    bias_update_rate: float = option(
        0.0,
        "Auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's routing bias moves by "
        "this much toward the mean load (up if under-loaded, down if over-loaded); 0 turns it off.",
        ge=0,
    )
    capacity_factor: float | None = option(
        None,
        "Unset: dropless, every routed token is computed. Set: each expert takes at most "
        "ceil(factor * seq_len * top_k / experts) token slots of each sequence, the later tokens beyond it "
        "are dropped (they pass through the residual only), however the step is split into micro-batches.",
        gt=0,
    )


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
    moe: MoEConfig = section(MoEConfig)


def head_dim_of(cfg: ModelConfig) -> int:
    """Each attention head's size: model.attention.head_dim, or model.dim / n_heads."""
    return cfg.attention.head_dim or cfg.dim // cfg.attention.n_heads
