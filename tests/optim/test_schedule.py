"""The warm-up + decay factor against hand-computed values, and the scheduler built from an OptimConfig."""

import pytest
import torch
from torch import nn

from megascale.config import OptimConfig
from megascale.optim import build_lr_scheduler, build_optimizer
from megascale.optim.schedule import lr_factor

# warmup_steps=4, total_steps=13: the decay spans steps 4..12, progress = (s - 4) / 8.
SCHEDULE = {"warmup_steps": 4, "total_steps": 13, "min_lr_ratio": 0.1}
COS_QUARTER = 0.1 + 0.9 * 0.5 * (1 + 0.7071067811865476)  # cos(pi / 4)


@pytest.mark.parametrize(
    "decay, step, expected",
    [
        ("cosine", 0, 0.25),
        ("cosine", 2, 0.75),
        ("cosine", 3, 1.0),
        ("cosine", 4, 1.0),
        ("cosine", 6, COS_QUARTER),
        ("cosine", 8, 0.55),
        ("cosine", 12, 0.1),
        ("cosine", 50, 0.1),
        ("linear", 0, 0.25),
        ("linear", 3, 1.0),
        ("linear", 4, 1.0),
        ("linear", 6, 0.775),
        ("linear", 8, 0.55),
        ("linear", 12, 0.1),
        ("linear", 50, 0.1),
        ("constant", 0, 0.25),
        ("constant", 3, 1.0),
        ("constant", 8, 1.0),
        ("constant", 12, 1.0),
    ],
)
def test_factor_values(decay, step, expected):
    assert lr_factor(step, decay=decay, **SCHEDULE) == pytest.approx(expected, rel=1e-12)


def test_no_warmup_starts_at_peak_and_ends_at_minimum():
    schedule = {"warmup_steps": 0, "total_steps": 5, "decay": "linear", "min_lr_ratio": 0.2}
    assert [lr_factor(s, **schedule) for s in range(5)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])


def test_rejects_unknown_decay():
    with pytest.raises(ValueError, match="decay"):
        lr_factor(0, decay="step", **SCHEDULE)


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_scheduler_sets_lr_to_peak_times_factor(decay):
    cfg = OptimConfig(lr=0.01, warmup_steps=4, decay=decay, min_lr_ratio=0.1)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    optimizer = build_optimizer(model, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg, total_steps=13)
    for step in range(13):
        expected_lr = cfg.lr * lr_factor(step, decay=decay, **SCHEDULE)
        assert all(group["lr"] == pytest.approx(expected_lr, rel=1e-12) for group in optimizer.param_groups)
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
