"""build_optimizer: decay only on matrices, and both optimizers build and step on a tiny model."""

import pytest
import torch
from torch import nn

from megascale.config import OptimConfig
from megascale.optim import Lamb, build_optimizer


def tiny_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    model[2].bias.requires_grad_(False)
    return model


def test_decay_only_on_matrices():
    model = tiny_model()
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1))
    decayed, undecayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and undecayed["weight_decay"] == 0.0
    assert [id(p) for p in decayed["params"]] == [id(model[0].weight), id(model[2].weight)]
    assert [id(p) for p in undecayed["params"]] == [id(model[0].bias), id(model[1].weight), id(model[1].bias)]


@pytest.mark.parametrize("name, optimizer_type", [("adamw", torch.optim.AdamW), ("lamb", Lamb)])
def test_builds_and_steps(name, optimizer_type):
    model = tiny_model()
    cfg = OptimConfig(name=name, lr=0.01, trust_clamp=10.0)
    optimizer = build_optimizer(model, cfg)
    assert type(optimizer) is optimizer_type
    assert all(
        group["lr"] == cfg.lr and group["betas"] == (cfg.beta1, cfg.beta2) for group in optimizer.param_groups
    )
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(5, 4)).square().mean().backward()
    optimizer.step()
    changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
    assert changed == [p.requires_grad for p in model.parameters()]


def test_rejects_unknown_name():
    cfg = OptimConfig()
    cfg.name = "sgd"
    with pytest.raises(ValueError, match="sgd"):
        build_optimizer(tiny_model(), cfg)
