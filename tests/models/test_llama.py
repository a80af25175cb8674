"""The transformer blocks against their formulas, the GPT-style options, and the parameter/FLOP counts."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megascale.config import AttentionConfig, ModelConfig
from megascale.models.flops import flops_per_token, num_params
from megascale.models.llama import Transformer, TransformerBlock
from megascale.models.rope import rope_tables

SMALL = ModelConfig(
    dim=64, n_layers=2, vocab_size=128, max_seq_len=64, attention=AttentionConfig(n_heads=4, n_kv_heads=2)
)


def block_inputs(cfg: ModelConfig, seq: int = 20) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    x = torch.randn(2, seq, cfg.dim, generator=torch.Generator().manual_seed(0))
    return x, rope_tables(cfg.dim // cfg.attention.n_heads, seq, cfg.attention.rope_theta)


def make_block(cfg: ModelConfig) -> TransformerBlock:
    torch.manual_seed(0)
    block = TransformerBlock(cfg)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(std=0.1 if param.ndim > 1 else 1.0)
    return block


@torch.no_grad()
def test_parallel_block_is_one_norm_feeding_both_branches():
    cfg = dataclasses.replace(SMALL, block="parallel")
    block = make_block(cfg)
    assert block.ffn_norm is None
    x, rope = block_inputs(cfg)
    normed = block.attention_norm(x)
    expected = x + block.attention(normed, rope) + block.feed_forward(normed)
    torch.testing.assert_close(block(x, rope), expected, rtol=0, atol=1e-6)


@torch.no_grad()
def test_serial_block_feeds_the_mlp_the_attention_output():
    block = make_block(SMALL)
    x, rope = block_inputs(SMALL)
    h = x + block.attention(block.attention_norm(x), rope)
    expected = h + block.feed_forward(block.ffn_norm(h))
    torch.testing.assert_close(block(x, rope), expected, rtol=0, atol=1e-6)
    normed = block.attention_norm(x)
    parallel = x + block.attention(normed, rope) + block.feed_forward(normed)
    assert (block(x, rope) - parallel).abs().max() > 1e-2


@torch.no_grad()
def test_swiglu_and_rmsnorm_match_their_formulas():
    block = make_block(SMALL)
    x, _ = block_inputs(SMALL)
    mlp = block.feed_forward
    swiglu = (F.silu(x @ mlp.w1.weight.T) * (x @ mlp.w3.weight.T)) @ mlp.w2.weight.T
    torch.testing.assert_close(mlp(x), swiglu, rtol=1e-5, atol=1e-5)
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + SMALL.norm_eps) * block.attention_norm.weight
    torch.testing.assert_close(block.attention_norm(x), rms, rtol=1e-5, atol=1e-5)


GPT_STYLE = dataclasses.replace(SMALL, norm="layernorm", mlp="gelu", position="learned")


@pytest.mark.parametrize("block", ["serial", "parallel"])
def test_gpt_style_options_build_and_train(block):
    cfg = dataclasses.replace(GPT_STYLE, block=block)
    torch.manual_seed(0)
    model = Transformer(cfg)
    assert isinstance(model.norm, torch.nn.LayerNorm) and model.pos_embeddings is not None
    assert model.layers["0"].feed_forward.w3 is None
    tokens = torch.randint(0, cfg.vocab_size, (2, 30))
    logits = model(tokens)
    assert logits.shape == (2, 30, cfg.vocab_size) and torch.isfinite(logits).all()
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    assert all(param.grad is not None and torch.isfinite(param.grad).all() for param in model.parameters())
    # Learned positions are used: with no RoPE, they are what makes position 1 differ from position 0.
    same_token = torch.full((1, 2), 5)
    first, second = model(same_token)[0]
    assert not torch.allclose(first, second)

    mlp = model.layers["0"].feed_forward
    x = torch.randn(3, cfg.dim)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), F.gelu(x @ mlp.w1.weight.T, approximate="tanh") @ mlp.w2.weight.T)


PARAM_CONFIGS = {
    "llama_gqa": SMALL,
    "mha_tied": dataclasses.replace(
        SMALL, tie_embeddings=True, attention=AttentionConfig(n_heads=4, n_kv_heads=4)
    ),
    "parallel": dataclasses.replace(SMALL, block="parallel"),
    "gpt_style": GPT_STYLE,
    "gpt_parallel_tied_ffn": dataclasses.replace(
        GPT_STYLE, block="parallel", tie_embeddings=True, ffn_dim=100
    ),
    "odd_sizes": ModelConfig(
        dim=96,
        n_layers=3,
        vocab_size=259,
        ffn_dim=200,
        max_seq_len=33,
        attention=AttentionConfig(n_heads=6, n_kv_heads=1, window=8),
    ),
}


@pytest.mark.parametrize("name", PARAM_CONFIGS)
def test_parameter_count_matches_flops_module(name):
    cfg = PARAM_CONFIGS[name]
    model = Transformer(cfg)
    assert sum(param.numel() for param in model.parameters()) == num_params(cfg)


def test_flops_per_token_by_hand():
    # SMALL: dim 64, 2 layers, vocab 128, 4 heads of 16, 2 kv heads, SwiGLU hidden 64 * ceil(8*64/3/64) = 192.
    attention_weights = 64 * 64 + 2 * (64 * 2 * 16) + 64 * 64  # q, k and v (2 kv heads), o = 12,288
    mlp_weights = 3 * 64 * 192  # gate, up, down = 36,864
    dense = 2 * (attention_weights + mlp_weights) + 128 * 64  # + the output layer = 106,496
    assert dense == 106_496
    # 6 FLOPs per weight per token; QK^T and PV cost 12 * layers * dim * span fwd+bwd.
    assert flops_per_token(SMALL, seq_len=32) == 6 * 106_496 + 12 * 2 * 64 * 32 == 688_128
    windowed = dataclasses.replace(SMALL, attention=AttentionConfig(n_heads=4, n_kv_heads=2, window=8))
    assert flops_per_token(windowed, seq_len=32) == 6 * 106_496 + 12 * 2 * 64 * 8 == 651_264
    # A window at least as long as the sequence is full causal attention: span = min(window, seq).
    wide = dataclasses.replace(SMALL, attention=AttentionConfig(n_heads=4, n_kv_heads=2, window=100))
    assert flops_per_token(wide, seq_len=32) == flops_per_token(SMALL, seq_len=32)


def test_sequence_longer_than_max_seq_len_raises():
    model = Transformer(SMALL)
    model(torch.zeros(1, SMALL.max_seq_len, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, SMALL.max_seq_len + 1, dtype=torch.long))
