"""LAMB: Adam with a per-tensor trust ratio (You et al. 2019, "Large Batch Optimization for Deep Learning").

MegaScale (paper §3.1) trains with LAMB because it keeps convergence when the batch is scaled up 4x,
which cuts the number of steps and so the pipeline bubbles per token. Each tensor's Adam update is
rescaled so that its step size is proportional to the tensor's own norm:

    r = m_hat / (sqrt(v_hat) + eps),  u = r + weight_decay * w,
    trust = ||w|| / ||u||  (1.0 if either norm is 0, at most trust_clamp if set),
    w <- w - lr * trust * u.

Both norms are of the whole tensors. Under FSDP2 or tensor parallelism the weights are DTensors, and
torch.linalg.vector_norm of each would reduce it over its shards on its own: two collectives per tensor and
step, most of a small sharded model's step on CPU. `global_norms` sums the shards' squares of every tensor
sharded alike in one all-reduce per mesh dimension instead, and the elementwise Adam arithmetic runs on the
shards themselves (`Lamb._adam_update`).
State keys are those of torch's Adam ("step", "exp_avg", "exp_avg_sq"), so
torch.distributed.checkpoint's get_state_dict/set_state_dict treat LAMB like AdamW.
"""

from collections.abc import Callable, Iterable
from typing import cast, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from megascale.parallel.tensor import local_shard, sharded_like


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

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One LAMB update of every parameter that has a gradient; parameters without one are skipped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = [  # (group, weight, update) of every parameter with a gradient, in every group
            (group, weight, self._adam_update(weight, group))
            for group in self.param_groups
            for weight in group["params"]
            if weight.grad is not None
        ]
        if not stepped:
            return loss
        groups, weights, updates = zip(*stepped)
        sharded_updates = [sharded_like(update, weight) for weight, update in zip(weights, updates)]
        weight_norms, update_norms = global_norms([*weights, *sharded_updates]).split(len(weights))
        both_positive = (weight_norms > 0) & (update_norms > 0)
        trust = torch.where(both_positive, weight_norms / update_norms, torch.ones_like(weight_norms))
        for group, weight, update, ratio in zip(groups, weights, updates, trust):
            if group["trust_clamp"] is not None:
                ratio = ratio.clamp(max=group["trust_clamp"])
            local_shard(weight).sub_(update.mul_(ratio * group["lr"]))
        return loss

    def _adam_update(self, weight: Tensor, group: dict) -> Tensor:
        """Advances the Adam moments of `weight` and returns u = m_hat / (sqrt(v_hat) + eps) + wd * w, of
        this rank's shard where `weight` is a DTensor: the arithmetic is elementwise, so it runs on the local
        shards (a DTensor operator costs a dispatch per call, ten per tensor and step)."""
        grad = weight.grad
        assert grad is not None  # step() updates only the weights with a gradient
        if grad.is_sparse:
            raise RuntimeError("Lamb does not support sparse gradients")
        # A DTensor's gradient is a DTensor.
        if isinstance(weight, DTensor) and cast(DTensor, grad).placements != weight.placements:
            grad = cast(DTensor, grad).redistribute(weight.device_mesh, weight.placements)
        state = self.state[weight]
        if not state:
            # A float32 tensor step, as torch's Adam keeps it, so checkpoints of the two look alike.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = state["step"].item()
        exp_avg, exp_avg_sq = local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"])
        weight, grad = local_shard(weight), local_shard(grad)
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(group["eps"])
        update = (exp_avg / (1 - beta1**step)).div_(denominator)
        if group["weight_decay"] != 0:
            update.add_(weight, alpha=group["weight_decay"])
        return update


def global_norms(tensors: list[Tensor]) -> Tensor:
    """The L2 norm of each whole tensor, one 1-D tensor: a plain tensor's own, a DTensor's over all its
    shards. The squared norms of DTensors sharded over the same mesh dimensions are summed over those
    dimensions together, in one all-reduce per dimension (a replicated dimension holds the whole already)."""
    norms: list[Tensor | None] = [None] * len(tensors)
    alike: dict[tuple, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, DTensor):
            norms[index] = torch.linalg.vector_norm(tensor)
            continue
        if any(placement.is_partial() for placement in tensor.placements):
            raise ValueError(f"global_norms: tensor {index} is a partial DTensor; reduce it first")
        # Not `is_shard()`: FSDP2 over a tensor-parallel dimension shards with _StridedShard, which says no.
        placements = tensor.placements
        sharded = tuple(dim for dim, placement in enumerate(placements) if not placement.is_replicate())
        alike.setdefault((tensor.device_mesh, sharded), []).append(index)
    for (mesh, sharded), indices in alike.items():
        squares = torch.stack(
            [torch.linalg.vector_norm(cast(DTensor, tensors[i]).to_local()) ** 2 for i in indices]
        )
        for dim in sharded:
            dist.all_reduce(squares, group=mesh.get_group(dim))
        for i, norm in zip(indices, squares.sqrt()):
            norms[i] = norm
    return torch.stack(cast(list[Tensor], norms))  # every one set above
