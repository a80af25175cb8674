"""Causal attention kernels: full causal, and sliding-window in linear time and memory.

Sliding-window attention (paper §3.1, after Longformer) lets token i attend to positions (i-W, i], so its
cost is O(seq * W) instead of O(seq^2). SDPA has no window argument and a dense boolean mask costs
O(seq^2) memory; flex_attention needs torch.compile to avoid materialising the scores on CPU. So the window
is computed by blocks: queries are cut into blocks of B = max(W, 64) positions; block s only needs keys
[s*B - W + 1, s*B + B), which are gathered with `unfold` (a view) and attended with one batched SDPA call and
a (B, B+W-1) band mask shared by every block. Work and memory grow linearly in seq at fixed W.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MIN_BLOCK = 64  # below this, per-block overhead dominates the batched SDPA call
# Where CPU attention in bfloat16 runs faster as float32 (`attends_in_float32`).
_FLOAT32_MAX_HEAD_DIM = 32
_FLOAT32_MAX_SEQ = 256


class WholeSequenceAttention:
    """An attention layer's core as it sees its input: whole sequences, positions 0..seq-1, attended here. A
    layer given a slice of each sequence gets an object with the same methods that knows the slice's
    positions and attends across the slices (context parallelism, parallel/context.py)."""

    def positions(self, seq: int, device: torch.device) -> torch.Tensor | None:
        """The global positions of the `seq` tokens the layer holds; None for 0..seq-1."""
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
        return causal_attention(q, k, v, window)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Attention of q [batch, heads, seq, head_dim] over k, v [batch, kv_heads, seq, head_dim].

    kv_heads must divide heads (grouped-query attention: query head h reads kv head h // (heads/kv_heads)).
    With `window` unset, or not smaller than seq, this is plain causal attention.
    """
    seq = q.shape[-2]
    if window is None or window >= seq:
        # SDPA's GQA reads each kv head in place; repeating k/v first costs a copy and, in the backward,
        # a reduction over the copies (the default model's attention, float32 on CPU: forward + backward
        # 57 ms of CPU time with k/v repeated, 49 without).
        gqa = k.shape[1] != q.shape[1]
        if attends_in_float32(q.device.type, q.dtype, q.shape[-1], seq):
            with torch.autocast("cpu", enabled=False):  # autocast would cast the inputs back to bfloat16
                out = F.scaled_dot_product_attention(
                    q.float(), k.float(), v.float(), is_causal=True, enable_gqa=gqa
                )
            return out.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    repeats = q.shape[1] // k.shape[1]
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    return sliding_window_attention(q, k, v, window)


def attends_in_float32(device_type: str, dtype: torch.dtype, head_dim: int, seq: int) -> bool:
    """Whether causal attention of bfloat16 queries runs in float32, inputs and output cast, because it is
    faster so (the planner's memory model asks too: `megascale.plan.memory`).

    Only on CPU, with short heads (head_dim <= 32) over short sequences (<= 256): there torch's CPU
    flash-attention kernel is slower in bfloat16 than in float32, its backward most (fwd + bwd of
    [16, 8, 256, 32] queries over 4 kv heads, 2 threads: 65 ms CPU time in bfloat16, 56 ms in float32
    casts included; at head_dim 16, 110 against 66 ms). At head_dim >= 48, or 512 positions and more,
    bfloat16 is as fast or faster, so it is kept. On CUDA bfloat16 keeps the flash kernel, which has no
    float32 version.
    """
    return (
        device_type == "cpu"
        and dtype == torch.bfloat16
        and head_dim <= _FLOAT32_MAX_HEAD_DIM
        and seq <= _FLOAT32_MAX_SEQ
    )


def _band_mask(block: int, window: int, n_blocks: int, device: torch.device) -> torch.Tensor:
    """[n_blocks, block, block + window - 1] mask: query i of block s sees local key j iff i <= j <= i+W-1.

    Local key j of block s stands at absolute position s*block - window + 1 + j; keys before position 0 are
    padding and masked out.
    """
    i = torch.arange(block, device=device)[:, None]
    j = torch.arange(block + window - 1, device=device)[None, :]
    band = (j >= i) & (j <= i + window - 1)
    key_pos = torch.arange(n_blocks, device=device)[:, None] * block - window + 1 + j
    return band[None] & (key_pos >= 0)[:, None, :].expand(n_blocks, block, -1)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Token i attends to positions (i-window, i]; O(seq * window) time and memory."""
    batch, heads, seq, head_dim = q.shape
    block = max(window, _MIN_BLOCK)
    n_blocks = -(-seq // block)
    pad_end = n_blocks * block - seq
    # Queries padded at the end to whole blocks; keys/values also padded at the front by window-1.
    q_blocks = F.pad(q, (0, 0, 0, pad_end)).view(batch, heads, n_blocks, block, head_dim)
    k_padded = F.pad(k, (0, 0, window - 1, pad_end))
    v_padded = F.pad(v, (0, 0, window - 1, pad_end))
    span = block + window - 1
    k_blocks = k_padded.unfold(2, span, block).transpose(-1, -2)  # [b, h, n_blocks, span, d]
    v_blocks = v_padded.unfold(2, span, block).transpose(-1, -2)
    mask = _band_mask(block, window, n_blocks, q.device)
    out = F.scaled_dot_product_attention(q_blocks, k_blocks, v_blocks, attn_mask=mask)
    return out.reshape(batch, heads, n_blocks * block, head_dim)[:, :, :seq]
