"""Model, optimizer and LR schedule wrapped as `Stateful`, in DCP's layout-independent form.

`get_model_state_dict` / `get_optimizer_state_dict` key everything by fully-qualified parameter name and keep
DTensor shards as DTensors, so one checkpoint loads into a single process or any sharded layout. A pipelined
rank holds several model parts (one per stage) with an optimizer each; their entries are merged into one
dict, which works because a stage keeps the whole model's parameter names. The optimizer state is
flattened (hyper-parameters keyed per parameter too), so it reloads under a different stage split. The
model and the optimizer are separate entries so that weights alone can be loaded (`checkpoint.init_from`,
`megascale convert`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

FLATTEN = StateDictOptions(flatten_optimizer_state_dict=True)


def _parts(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _share(state_dict: dict[str, Any], part_state: dict[str, Any]) -> dict[str, Any]:
    """The entries of `state_dict` that belong to a part (the keys of that part's own state dict)."""
    return {key: state_dict[key] for key in part_state if key in state_dict}


class ModelState(Stateful):
    def __init__(self, model: nn.Module | list[nn.Module]):
        self.parts = _parts(model)

    def state_dict(self) -> dict[str, Any]:
        return {key: value for part in self.parts for key, value in get_model_state_dict(part).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.parts:
            set_model_state_dict(part, _share(state_dict, get_model_state_dict(part)))


class OptimizerState(Stateful):
    """One optimizer per model part; `optimizers[i]` updates exactly the parameters of `model[i]`."""

    def __init__(self, model: nn.Module | list[nn.Module], optimizers: torch.optim.Optimizer | list):
        self.parts = _parts(model)
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]

    def _part_states(self) -> list[dict[str, Any]]:
        return [
            get_optimizer_state_dict(part, optimizer, options=FLATTEN)
            for part, optimizer in zip(self.parts, self.optimizers)
        ]

    def state_dict(self) -> dict[str, Any]:
        """The flattened state. An optimizer that has not stepped yet has no state; DCP creates it by
        stepping once with zero gradients and lr 0, which still advances Adam's step count. Such an
        optimizer is put back as it was, so describing the state (for a snapshot buffer) changes no run."""
        pristine = [not optimizer.state for optimizer in self.optimizers]
        state = {key: value for part_state in self._part_states() for key, value in part_state.items()}
        for optimizer, was_pristine in zip(self.optimizers, pristine):
            if was_pristine:
                optimizer.state.clear()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, optimizer, own in zip(self.parts, self.optimizers, self._part_states()):
            set_optimizer_state_dict(part, optimizer, _share(state_dict, own), options=FLATTEN)


class SchedulersState(Stateful):
    """LR schedulers that step in lockstep (one per optimizer): one is saved, every one is restored."""

    def __init__(self, schedulers: Sequence[torch.optim.lr_scheduler.LRScheduler]):
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state_dict)
