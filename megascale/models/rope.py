"""Rotary position embeddings: the tables of cos and sin per position, with the context-extension scalings
that Hugging Face's `rope_parameters` name (linear, dynamic, YaRN, Llama 3.1's), computed as transformers
computes them so that imported checkpoints keep their logits.

Each scaling changes only the inverse frequencies (and YaRN the tables' magnitude), so the attention code is
the same for all of them. 'dynamic' (NTK-aware) depends on the length of the sequence being run and
changes nothing up to max_position_embeddings: within model.max_seq_len, the only lengths the model takes,
it is plain RoPE; the setting is kept so that an exported model extrapolates as the source did.
"""

from __future__ import annotations

import math

import torch

from megascale.config import RopeScalingConfig


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScalingConfig | None = None
) -> torch.Tensor:
    """[head_dim / 2] float64: the angle each pair of channels turns per position."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / theta**exponents
    kind = scaling.type if scaling is not None else "none"
    if scaling is None or kind in ("none", "dynamic"):
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling.factor
    original = scaling.original_max_seq_len
    assert original is not None  # validated: 'yarn' and 'llama3' need it
    if kind == "llama3":
        return _llama3(inv_freq, scaling, original)
    return _yarn(inv_freq, head_dim, theta, scaling, original)


def _llama3(inv_freq: torch.Tensor, scaling: RopeScalingConfig, original: int) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original / low_freq_factor divided by factor, shorter than
    original / high_freq_factor kept, and those between blended by how many turns fit in `original`."""
    wavelength = 2 * math.pi / inv_freq
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    scaled = torch.where(wavelength > original / low, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(between, blended, scaled)


def _yarn(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScalingConfig, original: int
) -> torch.Tensor:
    """YaRN (Peng et al. 2023): frequencies turning more than beta_fast times over `original` kept,
    fewer than beta_slow times interpolated (divided by factor), a linear ramp over the channels between."""

    def channel_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel_of(scaling.beta_fast), channel_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return inv_freq / scaling.factor * (1 - kept) + inv_freq * kept


def table_scale(scaling: RopeScalingConfig | None) -> float:
    """What the cos and sin tables are multiplied by: YaRN's attention factor, else 1."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


def rope_tables(
    head_dim: int, seq_len: int, theta: float, scaling: RopeScalingConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, each [seq_len, head_dim], in rotate-half layout (each frequency twice).

    The sine's first half is negated so that rotate_half(x) * sin == roll(x, half) * signed_sin: one roll
    instead of two slices, a negation and a concatenation, with bit-identical results.
    """
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    scale = table_scale(scaling)
    cos, sin = angles.cos() * scale, angles.sin() * scale
    return torch.cat([cos, cos], dim=-1).float(), torch.cat([-sin, sin], dim=-1).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim] by position; tables from `rope_tables`."""
    return (x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin).type_as(x)
