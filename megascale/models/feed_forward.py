"""The dense feed-forward layer: SwiGLU (Llama) or GeLU (GPT), and its default hidden size."""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from megascale.config import ModelConfig


def ffn_dim_of(cfg: ModelConfig) -> int:
    """The MLP hidden size: the configured one, else 4*dim (GeLU) or 8/3*dim rounded to 64 (SwiGLU)."""
    if cfg.ffn_dim is not None:
        return cfg.ffn_dim
    if cfg.mlp == "gelu":
        return 4 * cfg.dim
    return 64 * math.ceil(8 * cfg.dim / 3 / 64)


class FeedForward(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x)) or GeLU (w2(gelu(w1 x))) MLP."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or ffn_dim_of(cfg)
        self.gated = cfg.mlp == "swiglu"
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False) if self.gated else None
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.activate(self.w1(x), cast(nn.Linear, self.w3)(x) if self.gated else None))

    def activate(self, up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The element-wise middle: silu(w1 x) * w3 x, or gelu(w1 x)."""
        if gate is not None:
            return F.silu(up) * gate
        return F.gelu(up, approximate="tanh")
