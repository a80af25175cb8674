"""Activation checkpointing applied from outside the model: recompute in the backward instead of storing.

'full' wraps every block so that only its input is kept and its whole forward is recomputed. 'selective'
keeps the results of the expensive ops (matmuls and attention) and recomputes only the cheap element-wise
work around them (norms, activations, RoPE, residual adds), which saves most of the memory of those
tensors for a few percent of compute. Both use PyTorch's non-reentrant checkpointing; this module only
picks the units and the policy. Apply it after tensor parallelism and before FSDP (torchtitan's order).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Ops whose outputs 'selective' keeps: the FLOP-heavy ones.
SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, *, blocks: str, mode: str) -> None:
    """Wrap every block of `model.<blocks>` in place; mode is 'full', 'selective' or 'none'."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode must be none, full or selective, got {mode!r}")
    container = model.get_submodule(blocks)
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    for name, block in list(container.named_children()):
        options: dict[str, Any] = {"context_fn": context_fn} if mode == "selective" else {}
        wrapped = checkpoint_wrapper(block, preserve_rng_state=False, **options)
        container.register_module(name, wrapped)
