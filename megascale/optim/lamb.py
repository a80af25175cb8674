"""LAMB: Adam with a per-tensor trust ratio (You et al. 2019, "Large Batch Optimization for Deep Learning").

MegaScale (paper §3.1) trains with LAMB because it keeps convergence when the batch is scaled up 4x,
which cuts the number of steps and so the pipeline bubbles per token. Each tensor's Adam update is
rescaled so that its step size is proportional to the tensor's own norm:

    r = m_hat / (sqrt(v_hat) + eps),  u = r + weight_decay * w,
    trust = ||w|| / ||u||  (1.0 if either norm is 0, at most trust_clamp if set),
    w <- w - lr * trust * u.

Both norms come from one hook, `Lamb.tensor_norms`, so a sharded run can supply global norms there.
State keys are those of torch's Adam ("step", "exp_avg", "exp_avg_sq"), so
torch.distributed.checkpoint's get_state_dict/set_state_dict treat LAMB like AdamW.
"""

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from megascale.parallel.tensor import full_tensor


class Lamb(torch.optim.Optimizer):
    """LAMB over fp32 (or fp64) parameters; one trust ratio per parameter tensor."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        trust_clamp: float | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Lamb: lr must be >= 0, got {lr}")
        for index, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Lamb: betas[{index}] must be in [0, 1), got {beta}")
        if not eps > 0.0:
            raise ValueError(f"Lamb: eps must be > 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Lamb: weight_decay must be >= 0, got {weight_decay}")
        if trust_clamp is not None and not trust_clamp > 0.0:
            raise ValueError(f"Lamb: trust_clamp must be > 0 or None, got {trust_clamp}")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, trust_clamp=trust_clamp
        )
        super().__init__(params, defaults)

    def tensor_norms(self, weights: list[Tensor], updates: list[Tensor]) -> tuple[Tensor, Tensor]:
        """The hook for sharded runs: per-tensor L2 norms of `weights` and `updates`.

        Returns two 1-D tensors of len(weights), entry i the norm of the whole (unsharded) tensor i.
        torch.linalg.vector_norm of a DTensor (FSDP2 / TP parameters) already reduces over all shards,
        so this default is global for DTensors too; it issues one collective per tensor, and a subclass
        may override it to batch those reductions into one all-reduce.
        """
        weight_norms = torch.stack([full_tensor(torch.linalg.vector_norm(w)) for w in weights])
        update_norms = torch.stack([full_tensor(torch.linalg.vector_norm(u)) for u in updates])
        return weight_norms, update_norms

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One LAMB update of every parameter that has a gradient; parameters without one are skipped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            weights = [p for p in group["params"] if p.grad is not None]
            if not weights:
                continue
            updates = [self._adam_update(p, group) for p in weights]
            weight_norms, update_norms = self.tensor_norms(weights, updates)
            both_positive = (weight_norms > 0) & (update_norms > 0)
            trust = torch.where(both_positive, weight_norms / update_norms, torch.ones_like(weight_norms))
            if group["trust_clamp"] is not None:
                trust = trust.clamp(max=group["trust_clamp"])
            step_sizes = trust * group["lr"]
            for weight, update, step_size in zip(weights, updates, step_sizes):
                weight.sub_(update.mul_(step_size))
        return loss

    def _adam_update(self, weight: Tensor, group: dict) -> Tensor:
        """Advances the Adam moments of `weight` and returns u = m_hat / (sqrt(v_hat) + eps) + wd * w."""
        grad = weight.grad
        if grad.is_sparse:
            raise RuntimeError("Lamb does not support sparse gradients")
        state = self.state[weight]
        if not state:
            # A float32 tensor step, as torch's Adam keeps it, so checkpoints of the two look alike.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = state["step"].item()
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(group["eps"])
        update = (exp_avg / (1 - beta1**step)).div_(denominator)
        if group["weight_decay"] != 0:
            update.add_(weight, alpha=group["weight_decay"])
        return update
