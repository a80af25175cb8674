"""Cross-entropy over a vocabulary, computed in float32 whatever the logits' dtype, without a float32 copy.

On CPU the logits are processed in blocks of rows small enough to stay in cache: the forward computes each
block's log-softmax in float32 and keeps only the target's entry; the backward recomputes the block's
softmax and writes the gradient (softmax - one-hot) straight into the logits' dtype. The plain
`F.cross_entropy(logits.float())` holds whole float32 copies of the logits instead (the cast, the saved
log-softmax, the gradient): training the 56M model in bfloat16 (32000-entry vocabulary, 2048 tokens a
micro-batch) peaks at 3.3 GiB of memory that way and at 2.2 GiB by blocks, at the same speed (the step
1% faster). The result is the same up to float32 rounding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

# Elements of one block's float32 softmax (4 MiB): in cache on a CPU core, and few enough Python-level
# iterations (~64 for 2048 tokens over 32000 entries) that their overhead stays small.
_BLOCK_ELEMENTS = 1 << 20


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Sum over rows of -log softmax(logits)[label], in float32; rows labelled `ignore_index` add 0.

    `logits` [tokens, vocab] in any float dtype, `labels` [tokens]. On CPU by blocks of rows (module
    docstring); elsewhere, and for DTensor logits (vocabulary shards under tensor parallelism, whose loss
    DTensor's `loss_parallel` computes), torch's `F.cross_entropy` on a float32 copy.
    """
    if logits.device.type != "cpu" or isinstance(logits, DTensor):
        return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=ignore_index)
    return _BlockedCrossEntropy.apply(logits, labels, ignore_index)


class _BlockedCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy by blocks of rows; saves the logits (not a float32 copy of them)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        rows = max(1, _BLOCK_ELEMENTS // logits.shape[1])
        valid = labels != ignore_index
        targets = torch.where(valid, labels, 0)[:, None]
        picked = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], rows):
                block = slice(start, start + rows)
                log_probs = torch.log_softmax(logits[block], dim=-1, dtype=torch.float32)
                picked[block] = log_probs.gather(1, targets[block]).squeeze(1)
        ctx.save_for_backward(logits, targets, valid)
        ctx.rows = rows
        return -torch.where(valid, picked, 0.0).sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, valid = ctx.saved_tensors
        rows = ctx.rows
        grad_logits = torch.empty_like(logits)
        scale = torch.where(valid, grad_loss.float(), 0.0)[:, None]  # ignored rows get no gradient
        row_index = torch.arange(rows, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], rows):
                block = slice(start, start + rows)
                probs = torch.softmax(logits[block], dim=-1, dtype=torch.float32)
                probs[row_index[: probs.shape[0]], targets[block, 0]] -= 1.0
                torch.mul(probs, scale[block], out=grad_logits[block])  # rounded once, to the logits' dtype
        return grad_logits, None, None
