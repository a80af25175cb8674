"""Float8 linear layers: the model's matmuls in float8 with dynamic scaling, from torchao's float8 training.

torchao swaps each chosen `nn.Linear` for its `Float8Linear`, whose forward casts the input and the weight
to float8_e4m3fn (and the output gradient to float8_e5m2 in the backward) with scales computed from their
current absolute maxima, and multiplies them with `torch._scaled_mm`, which runs on the CPU build of torch
as on Hopper GPUs. Two scalings: 'tensorwise' (one scale a tensor; its weights can be all-gathered by FSDP
in float8, half the bytes of bfloat16) and 'rowwise' (one scale a row, closer to the high-precision
result). Both compose with DTensor (a sharded weight's maximum is taken over every shard, so every layout
scales a weight as one process does) and with FSDP2, which is why torchao is used rather than a recipe of
our own. Delayed scaling (an amax history) is not offered: torchao 0.18 scales dynamically only. The
layers named in `training.fp8_exclude` (by default the output layer and the MoE router, whose logits feed
a softmax) stay in the compute precision; so do embeddings and the MoE experts' grouped weights, which
are not linear layers.

Conversion comes before tensor parallelism and FSDP (torchao's order). Gloo has no float8 type, so on
CPU the float8 all-gather moves its bytes as uint8 (`ByteAllGather`); NCCL takes float8 as it is. On one
GPU (float8 tensor cores) it has run (docs/gpu.md); NCCL's float8 all-gather has not: untested.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

# torchao's import reports every CUDA kernel library it cannot load on a CPU-only machine, at ERROR.
logging.getLogger("torchao").setLevel(logging.CRITICAL)


def convert_to_float8(model: nn.Module, scaling: str, *, all_gather: bool, exclude: Sequence[str]) -> int:
    """Swap `model`'s linear layers for torchao's float8 ones, in place, but those whose name ends with an
    entry of `exclude`; returns how many were swapped."""
    with _quiet_import():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if scaling == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather)
    else:
        config = Float8LinearConfig.from_recipe_name(scaling)
    chosen: set[str] = set()

    def keep_float8(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or any(_ends_with(name, suffix) for suffix in exclude):
            return False
        chosen.add(name)
        return True

    convert_to_float8_training(model, config=config, module_filter_fn=keep_float8)
    return len(chosen)


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """torchao's import registers an enum with torch's pytree, which warns that it no longer needs to."""
    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        yield
    finally:
        pytree.setLevel(level)


def _ends_with(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def float8_layers(model: nn.Module) -> list[str]:
    """The names of `model`'s float8 linear layers."""
    with _quiet_import():
        from torchao.float8.float8_linear import Float8Linear

    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]


class ByteAllGather(AllGather):
    """FSDP2's all-gather with float8 buffers moved as bytes, for backends without float8 (gloo)."""

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if output_tensor.dtype.itemsize == 1 and output_tensor.dtype != torch.uint8:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def gather_float8_as_bytes(units: Sequence[nn.Module]) -> None:
    """Every FSDP unit among `units` all-gathers its float8 parameters as bytes (gloo)."""
    for unit in units:
        if isinstance(unit, FSDPModule):
            unit.set_custom_all_gather(ByteAllGather())
