"""Single-device decoder-only transformer: Llama-style by default, GPT-style by options.

Llama: RMSNorm, rotary positions, grouped-query attention, SwiGLU. GPT: LayerNorm, learned positions, GeLU.
MegaScale's algorithmic options (paper §3.1): the parallel block y = x + Attn(LN(x)) + MLP(LN(x)) (Eq. 2)
and sliding-window attention. No parallelism lives here: tensor, pipeline and data parallelism are applied
from outside by megascale.parallel. Layers sit in a ModuleDict keyed by index so a pipeline stage can
drop the ones it does not own and keep checkpoint names stable; embedding, norm and output may be None
on stages that do not hold them.

RoPE uses the rotate-half layout of Hugging Face's Llama, so weights convert without permutation, and its
context-extension scalings (models/rope.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megascale.config import ModelConfig, head_dim_of
from megascale.models.attention import WholeSequenceAttention
from megascale.models.feed_forward import FeedForward
from megascale.models.moe import MoE
from megascale.models.norm import LayerNorm, RMSNorm
from megascale.models.rope import apply_rope, rope_tables


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.dim, eps=cfg.norm_eps)
    return LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=False)


class Attention(nn.Module):
    """Grouped-query causal self-attention, optionally restricted to a sliding window."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.attention.n_heads
        self.n_kv_heads = cfg.attention.n_kv_heads
        self.head_dim = head_dim_of(cfg)
        self.window = cfg.attention.window
        self.core: WholeSequenceAttention = WholeSequenceAttention()  # what attends (context parallelism)
        # Qwen3's QK-norm: each head's queries and keys normalised (one gain over head_dim) before RoPE.
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.attention.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.attention.qk_norm else None
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        return self.wo(self.mix(self.wq(x), self.wk(x), self.wv(x), rope))

    def mix(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The part between the projections, the only one that needs the whole sequence: the projections
        [batch, seq, heads * head_dim] split into heads, rotated, attended; [batch, seq, heads * head_dim]."""
        batch, seq, _ = q.shape
        # -1 instead of the head counts lets tensor parallelism shard the heads without touching this code.
        q = q.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            # The tables cover max_seq_len; slice here, where the whole sequence (or this rank's slice of
            # it, under context parallelism) is present: the residual stream around this module may be
            # sequence-sharded.
            positions = self.core.positions(seq, q.device)
            where = slice(seq) if positions is None else positions
            cos, signed_sin = rope[0][where], rope[1][where]
            q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
        out = self.core.attend(q, k, v, self.window)
        return out.transpose(1, 2).reshape(batch, seq, -1)


class TransformerBlock(nn.Module):
    """Serial (pre-norm) or parallel transformer block (paper §3.1, Eq. 1 vs Eq. 2)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.parallel = cfg.block == "parallel"
        self.attention = Attention(cfg)
        moe = cfg.moe.experts > 0 and layer >= cfg.moe.dense_layers
        self.feed_forward = MoE(cfg) if moe else FeedForward(cfg)
        self.attention_norm = make_norm(cfg)
        # The parallel block feeds one normalised input to both branches, so it has a single norm.
        self.ffn_norm = None if self.parallel else make_norm(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if self.parallel:
            normed = self.attention_norm(x)
            return x + self.attention(normed, rope) + self.feed_forward(normed)
        h = x + self.attention(self.attention_norm(x), rope)
        assert self.ffn_norm is not None  # a serial block has its own
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab] (or hidden states on a non-final pipeline stage)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.position == "learned" else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = make_norm(cfg)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if cfg.position == "rope":
            attention = cfg.attention
            cos, sin = rope_tables(
                head_dim_of(cfg), cfg.max_seq_len, attention.rope_theta, attention.rope_scaling
            )
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) weights (experts' too); output projections of each residual branch (every
        expert's, the shared experts') scaled by 1/sqrt(2L)."""
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if param.ndim == 1:
                nn.init.ones_(param)
            elif name.endswith(("attention.wo.weight", "w2.weight", "experts.w2")):  # into the residual
                nn.init.normal_(param, std=residual_std)
            else:
                nn.init.normal_(param, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """`tokens` are ids [batch, seq] on the stage holding the embedding, else hidden states."""
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {tokens.shape[1]} tokens exceeds model.max_seq_len = {self.cfg.max_seq_len}"
            )
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.pos_embeddings is not None:
            # A module call (not a slice of the weight) so that sharding can treat it like the embedding.
            h = h + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device)[None])
        rope = (self.rope_cos, self.rope_sin) if self.cfg.position == "rope" else None
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h
