"""RMSNorm with a hand-written backward for float32 activations on CPU.

torch's `rms_norm` is, on CPU, a chain of element-wise ops (square, mean, rsqrt, two products) that autograd
differentiates op by op: over [16, 256, 256] float32 activations its forward and backward take ~6 ms of CPU
time on 2 threads, where the closed-form gradient below takes ~2 ms. A Llama block has two such norms and
the model one more, run on the float32 residual stream also under bfloat16 autocast. Elsewhere (CUDA, which
has a fused kernel; other dtypes; DTensors under tensor parallelism; inside torch.compile, which fuses the
chain itself) this is `nn.RMSNorm`.

A norm's gain is applied in float32 whatever its parameter's dtype: under bfloat16 compute FSDP gathers
bfloat16 copies of a block's parameters (parallel/data.py), and the norm widens its copy back, so that it
computes as on the float32 master (torch's CPU LayerNorm refuses a weight of another dtype than its input).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` (same parameters and state dict), forward and backward by `_RMSNormFunction` where that is
    faster: float32 input and weight on CPU, outside torch.compile."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _widened(self.weight)
        if (
            x.device.type != "cpu"
            or x.dtype != torch.float32
            or weight is None
            or weight.dtype != torch.float32
            or isinstance(x, DTensor)
            or isinstance(weight, DTensor)
            or torch.compiler.is_compiling()
        ):
            return F.rms_norm(x, self.normalized_shape, weight, self.eps)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _RMSNormFunction.apply(x, weight, eps)


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` with its gain and bias applied in float32 (a bfloat16 copy widened)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = _widened(self.weight), _widened(self.bias)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def _widened(param: torch.Tensor | None) -> torch.Tensor | None:
    """`param` in float32: a lower-precision copy of a float32 master (FSDP's gather) is cast back."""
    if param is None or param.dtype.itemsize >= 4:
        return param
    return param.float()


class _RMSNormFunction(torch.autograd.Function):
    """y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) over the last dimension, as `F.rms_norm` has it.

    Backward, with x_hat = x * rstd and means over the last dimension:
    dw = sum over rows of dy * x_hat; dx = rstd * (dy * w - x_hat * mean(dy * w * x_hat)).
    Saves x and rstd (one value per row).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, rstd)
        return (x * rstd).mul_(weight)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        x_hat = x * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_out * x_hat).flatten(0, -2).sum(0)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x_hat = grad_out * weight
            projection = (grad_x_hat * x_hat).mean(-1, keepdim=True)
            grad_x = torch.addcmul(grad_x_hat, x_hat, projection, value=-1.0).mul_(rstd)
        return grad_x, grad_weight, None
