"""Activation checkpointing changes memory, never numbers: loss and gradients equal the plain model's."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.utils._python_dispatch import TorchDispatchMode

from megascale.config import AttentionConfig, ModelConfig
from megascale.models import sharding
from megascale.models.llama import Transformer
from megascale.parallel.activation import apply_activation_checkpointing
from tests.parallel.tiny import tiny_model_config


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("block", ["serial", "parallel"])
def test_checkpointed_model_gives_identical_loss_and_grads(mode, block):
    cfg = tiny_model_config(block, window=8)
    torch.manual_seed(0)
    plain = Transformer(cfg)
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, blocks=sharding.BLOCKS, mode=mode)
    tokens = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (plain, wrapped):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        assert torch.equal(a.grad, b.grad), name
    # Checkpoints keep the model's own parameter names.
    assert get_model_state_dict(wrapped).keys() == get_model_state_dict(plain).keys()


def test_none_leaves_the_model_alone():
    model = Transformer(ModelConfig(dim=32, n_layers=1, vocab_size=64, attention=AttentionConfig(n_heads=4)))
    before = [type(m) for m in model.modules()]
    apply_activation_checkpointing(model, blocks=sharding.BLOCKS, mode="none")
    assert [type(m) for m in model.modules()] == before


class _OpCounter(TorchDispatchMode):
    """Counts aten ops run, and matmuls among them."""

    def __init__(self):
        super().__init__()
        self.ops = self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.matmuls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def test_selective_recomputes_only_cheap_ops_and_full_recomputes_everything():
    cfg = ModelConfig(dim=64, n_layers=2, vocab_size=96, max_seq_len=64, attention=AttentionConfig(n_heads=4))
    tokens = torch.randint(0, 96, (2, 64))
    counts = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = Transformer(cfg)
        apply_activation_checkpointing(model, blocks=sharding.BLOCKS, mode=mode)
        with _OpCounter() as counter:
            model(tokens).sum().backward()
        counts[mode] = (counter.ops, counter.matmuls)
    (ops_none, mm_none), (ops_sel, mm_sel), (ops_full, mm_full) = (
        counts["none"],
        counts["selective"],
        counts["full"],
    )
    assert mm_sel == mm_none < mm_full, counts  # selective keeps matmul outputs; full runs them again
    # ... while both recompute element-wise work in the backward
    assert ops_none < ops_sel and ops_none < ops_full, counts
