"""Optimizer and learning-rate scheduler, built from an OptimConfig.

AdamW is torch's; LAMB (paper §3.1, used by MegaScale to scale the batch 4x) is in lamb.py. Weight decay
applies only to matrices and embeddings: decaying norm gains and biases pulls them towards 0 and gives
nothing back.
"""

import functools

import torch
from torch import nn

from megascale.config import OptimConfig
from megascale.optim.lamb import Lamb
from megascale.optim.schedule import lr_factor

__all__ = ["Lamb", "apply_settings", "build_lr_scheduler", "build_optimizer", "lr_factor", "param_groups"]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters split into a decayed group (ndim >= 2) and an undecayed one (ndim < 2), each
    split again by the device mesh its parameters are DTensors on (plain tensors apart): the fused and
    foreach kernels take tensors of one kind (a tensor-parallel model without data parallelism holds
    DTensor matrices and plain MoE router and expert weights).

    Empty groups are left out; shared (tied) parameters appear once.
    """
    trainable = [p for _, p in model.named_parameters() if p.requires_grad]
    groups = []
    for decay, params in (
        (weight_decay, [p for p in trainable if p.ndim >= 2]),
        (0.0, [p for p in trainable if p.ndim < 2]),
    ):
        by_mesh: dict[object, list[nn.Parameter]] = {}
        for param in params:
            by_mesh.setdefault(getattr(param, "device_mesh", None), []).append(param)
        groups += [{"params": kind, "weight_decay": decay} for kind in by_mesh.values()]
    if not groups:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer cfg.name names, at the peak lr cfg.lr (the scheduler scales it from there)."""
    groups = param_groups(model, cfg.weight_decay)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "adamw":
        # The fused kernel (CPU and CUDA) updates all tensors in one pass: ~4x faster than foreach here.
        return torch.optim.AdamW(
            groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True
        )
    if cfg.name == "lamb":
        return Lamb(
            groups,
            lr=cfg.lr,
            betas=betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            trust_clamp=cfg.trust_clamp,
        )
    raise ValueError(f"optim.name must be 'adamw' or 'lamb', got {cfg.name!r}")


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR setting lr = cfg.lr * lr_factor(s) for optimizer step s; call .step() after each step."""
    factor = functools.partial(
        lr_factor,
        warmup_steps=cfg.warmup_steps,
        total_steps=total_steps,
        decay=cfg.decay,
        min_lr_ratio=cfg.min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def apply_settings(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: OptimConfig
) -> None:
    """Give an optimizer and its schedule the hyper-parameters of `cfg` again after a checkpoint was loaded
    into them: loading restores the saved ones (peak lr, betas, eps, weight decay, LAMB's clamp), and a run
    resumed with other settings must train with the ones it was given. The schedule's position is kept."""
    for group in optimizer.param_groups:
        group["betas"] = (cfg.beta1, cfg.beta2)
        group["eps"] = cfg.eps
        group["weight_decay"] = cfg.weight_decay if group["params"][0].ndim >= 2 else 0.0
        group["initial_lr"] = cfg.lr
        if "trust_clamp" in group:
            group["trust_clamp"] = cfg.trust_clamp
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = cfg.lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
