"""Sliding-window and causal attention against a dense-mask float64 reference written here."""

import math

import pytest
import torch
import torch.nn.functional as F

from megascale.config import AttentionConfig, ModelConfig
from megascale.models.attention import causal_attention, sliding_window_attention
from megascale.models.llama import Attention, Transformer
from megascale.models.rope import apply_rope, rope_tables

WINDOWS = (1, 3, 16, 63, 64, 65, 200)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v with a dense [seq, seq] mask: key j is seen by query i iff
    i - window < j <= i (j <= i alone without a window). k and v may have fewer heads (GQA)."""
    seq, head_dim = q.shape[-2], q.shape[-1]
    group = q.shape[1] // k.shape[1]
    k, v = k[:, torch.arange(q.shape[1]) // group], v[:, torch.arange(q.shape[1]) // group]
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    visible = j <= i
    if window is not None:
        visible &= j > i - window
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def random_qkv(batch: int, heads: int, seq: int, head_dim: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, heads, seq, head_dim, generator=generator, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    ]


def forward_and_grads(attention, q, k, v, seed: int = 1) -> list[torch.Tensor]:
    out = attention(q, k, v)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    return [out.detach(), *grads]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("seq", [150, 257])
def test_sliding_window_matches_dense_mask(window, seq):
    q, k, v = random_qkv(batch=2, heads=3, seq=seq, head_dim=8)
    expected = forward_and_grads(lambda *qkv: reference_attention(*qkv, window), q, k, v)
    kernels = {
        "causal_attention": lambda *qkv: causal_attention(*qkv, window),
        # The blocked kernel itself, also where causal_attention would dispatch to plain SDPA (W >= seq).
        "sliding_window_attention": lambda *qkv: sliding_window_attention(*qkv, window),
    }
    for name, kernel in kernels.items():
        for what, got, want in zip(("out", "dq", "dk", "dv"), forward_and_grads(kernel, q, k, v), expected):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"{name} {what}")


@pytest.mark.parametrize("window", [3, 64, 65])
def test_sliding_window_float32_close_to_float64_reference(window):
    q, k, v = random_qkv(batch=2, heads=2, seq=200, head_dim=16)
    expected = reference_attention(q, k, v, window)
    got = causal_attention(q.float(), k.float(), v.float(), window)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq", [1, 5, 130])
def test_full_causal_matches_dense_mask(seq):
    q, k, v = random_qkv(batch=2, heads=3, seq=seq, head_dim=8)
    expected = forward_and_grads(lambda *qkv: reference_attention(*qkv, None), q, k, v)
    got = forward_and_grads(lambda *qkv: causal_attention(*qkv, None), q, k, v)
    for what, got_tensor, want in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(got_tensor, want, rtol=1e-10, atol=1e-10, msg=what)


def reference_attention_module(module: Attention, x: torch.Tensor, rope, window: int | None) -> torch.Tensor:
    """The Attention module recomputed from its weights; the reference does GQA by indexing kv heads."""
    batch, seq, _ = x.shape
    head_dim = module.head_dim

    def heads(linear: torch.nn.Linear) -> torch.Tensor:
        return (x @ linear.weight.T).view(batch, seq, -1, head_dim).transpose(1, 2)

    q, k, v = heads(module.wq), heads(module.wk), heads(module.wv)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    out = reference_attention(q, k, v, window)
    return out.transpose(1, 2).reshape(batch, seq, -1) @ module.wo.weight.T


@pytest.mark.parametrize("window", [None, 1, 5, 64, 100])
def test_gqa_attention_module_matches_reference(window):
    seq = 90
    cfg = ModelConfig(
        dim=48,
        n_layers=1,
        vocab_size=32,
        max_seq_len=128,
        attention=AttentionConfig(n_heads=6, n_kv_heads=2, window=window),
    )
    torch.manual_seed(0)
    module = Attention(cfg).double()
    for linear in (module.wq, module.wk, module.wv, module.wo):
        torch.nn.init.normal_(linear.weight, std=0.3)
    cos, sin = rope_tables(cfg.dim // cfg.attention.n_heads, seq, cfg.attention.rope_theta)
    rope = (cos.double(), sin.double())
    x = torch.randn(3, seq, cfg.dim, dtype=torch.float64, requires_grad=True)

    upstream = torch.randn(3, seq, cfg.dim, dtype=torch.float64)
    params = [x, *module.parameters()]
    got = module(x, rope)
    got_grads = torch.autograd.grad(got, params, upstream)
    expected = reference_attention_module(module, x, rope, window)
    expected_grads = torch.autograd.grad(expected, params, upstream)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    for got_grad, expected_grad in zip(got_grads, expected_grads):
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-10, atol=1e-10)


def test_window_at_least_seq_is_full_causal_in_the_model():
    tokens = torch.randint(0, 32, (2, 40), generator=torch.Generator().manual_seed(0))
    logits = {}
    for window in (None, 40, 1000):
        cfg = ModelConfig(
            dim=32,
            n_layers=2,
            vocab_size=32,
            max_seq_len=64,
            attention=AttentionConfig(n_heads=4, n_kv_heads=2, window=window),
        )
        torch.manual_seed(0)
        logits[window] = Transformer(cfg)(tokens)
    assert torch.equal(logits[None], logits[40]) and torch.equal(logits[None], logits[1000])


def test_bfloat16_cpu_attention_of_short_heads_runs_in_float32():
    """Short heads over short sequences (the default model's 32 over 256) attend in float32 on CPU, where
    torch's bfloat16 flash kernel is slower; autocast does not cast the inputs back. Longer heads keep it."""
    generator = torch.Generator().manual_seed(0)
    for head_dim, in_float32 in ((32, True), (64, False)):
        q = torch.randn(2, 4, 64, head_dim, generator=generator).bfloat16()
        k, v = (torch.randn(2, 2, 64, head_dim, generator=generator).bfloat16() for _ in range(2))
        inputs = (q.float(), k.float(), v.float()) if in_float32 else (q, k, v)
        expected = F.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=True).bfloat16()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = causal_attention(q, k, v, None)
        plain = causal_attention(q, k, v, None)
        assert under_autocast.dtype == plain.dtype == torch.bfloat16
        torch.testing.assert_close(under_autocast, expected, rtol=0, atol=0)
        torch.testing.assert_close(plain, expected, rtol=0, atol=0)
        reference = reference_attention(q.double(), k.double(), v.double(), None)
        torch.testing.assert_close(plain.double(), reference, rtol=2e-2, atol=2e-2)
