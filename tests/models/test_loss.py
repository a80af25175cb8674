"""The blocked cross-entropy against torch's `F.cross_entropy` on a float32 copy of the logits."""

import pytest
import torch
import torch.nn.functional as F

from megascale.models import loss
from megascale.models.loss import cross_entropy_sum

IGNORE = -100


def logits_and_labels(tokens: int, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(tokens, vocab, generator=generator)).to(dtype)
    labels = torch.randint(vocab, (tokens,), generator=generator)
    labels[::7] = IGNORE  # padding, as validation has it
    return logits, labels


def loss_and_grad(fn, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.clone().requires_grad_()
    value = fn(leaf, labels)
    (value * 0.37).backward()  # an upstream gradient other than 1, as the mean over micro-batches gives
    assert leaf.grad is not None
    return value.detach(), leaf.grad


def reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_elements", [None, 5 * 264])  # one block; blocks of 5 rows, the last short
def test_matches_torch_cross_entropy(dtype, block_elements, monkeypatch):
    if block_elements is not None:
        monkeypatch.setattr(loss, "_BLOCK_ELEMENTS", block_elements)
    logits, labels = logits_and_labels(tokens=47, vocab=264, dtype=dtype)
    got, got_grad = loss_and_grad(lambda x, y: cross_entropy_sum(x, y, IGNORE), logits, labels)
    want, want_grad = loss_and_grad(reference, logits, labels)
    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    # float32: the same up to rounding; bfloat16: float32 gradients rounded once to bfloat16, as the
    # reference's cast back does.
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-7)
    assert (got_grad[labels == IGNORE] == 0).all()


def test_under_autocast_and_without_gradients():
    logits, labels = logits_and_labels(tokens=16, vocab=50, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = cross_entropy_sum(logits, labels, IGNORE)
    with torch.no_grad():
        detached = cross_entropy_sum(logits, labels, IGNORE)
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside, reference(logits, labels))
    torch.testing.assert_close(detached, inside, rtol=0, atol=0)


def test_every_label_ignored_gives_zero_and_no_gradient():
    logits, _ = logits_and_labels(tokens=6, vocab=10, dtype=torch.float32)
    value, grad = loss_and_grad(
        lambda x, y: cross_entropy_sum(x, y, IGNORE), logits, torch.full((6,), IGNORE)
    )
    assert value == 0 and (grad == 0).all()
