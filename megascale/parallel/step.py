"""The step protocol of a parallelised model: what one training step and one evaluation do with this rank's
model parts, in each layout, so that the trainer steps every layout alike and knows none of them.

`ParallelModel` holds the whole model (no pipeline parallelism) and accumulates gradients over the step's
micro-batches; `PipelinedModel` holds this rank's stages and runs them through the pipeline schedule. Both
own the per-step hooks of data parallelism: the first FSDP all-gathers issued before the batch is fetched
(`begin_step`, with `parallel.overlap.dp`), ZeRO-1's one gradient sync a step (at the last micro-batch),
and the asynchronous reduce-scatters waited for before the gradients are read (`clip_gradients`). Each
also computes the loss where the layout needs it (on vocabulary shards under tensor parallelism, in the
precision of the run) from the one loss function the caller hands it, and after the optimizer step moves
the MoE layers' routing biases from the expert loads of the whole step (`finish_step`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule

from megascale.config import ModelConfig
from megascale.models import sharding
from megascale.models.moe import MoE, training_step
from megascale.optim.clip import clip_by_global_norm
from megascale.parallel.context import shard_sequence
from megascale.parallel.data import sync_gradients
from megascale.parallel.data_overlap import GradientReductions, issue_first_all_gathers
from megascale.parallel.tensor import full_tensor, loss_context

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> mean loss
Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (inputs, labels) of each micro-batch
Phase = Callable[..., contextlib.AbstractContextManager]  # a timed span: phase("forward", micro_batch=i)


@contextlib.contextmanager
def _untimed(name: str, **args: Any) -> Iterator[None]:
    yield


class ParallelModel:
    """This rank's whole model (tensor- and data-parallel, or one process), stepped by gradient
    accumulation: one forward and one backward per micro-batch."""

    def __init__(
        self,
        parts: list[nn.Module],
        *,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        tensor_parallel: bool,
        gather_early: bool,
        zero1: bool,
        reductions: GradientReductions | None = None,
        pipeline_group: ProcessGroup | None = None,
        routing_groups: Sequence[ProcessGroup] = (),
        routed: bool = False,
        context: tuple[int, int] = (1, 0),
    ):
        self.parts = parts  # one per pipeline stage this rank holds; the whole model without pipelining
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.tensor_parallel = tensor_parallel  # the loss is computed on vocabulary shards
        self.gather_early = gather_early  # the first all-gathers overlap the data loading
        self.zero1 = zero1  # gradients reduce-scattered once a step, at its last micro-batch
        self.reductions = reductions  # asynchronous reduce-scatters in flight (DP overlap, CPU)
        self.pipeline_group = pipeline_group  # the ranks holding the other stages
        self.context = context  # (cp, this rank's index among them): which slice of each sequence it holds
        # The ranks routing other tokens through the same layers: one group per data dimension, and the tp
        # group where each tp rank routes its own part of the sequence (parallel.moe_tp = "ep").
        self.routing_groups = routing_groups
        # Every MoE layer this rank holds, and its block's index in the whole model.
        held = [
            (name, module)
            for part in parts
            for name, module in part.named_modules()
            if isinstance(module, MoE)
        ]
        self.moe_layers = [module for _, module in held]
        self.moe_layer_indices = [_block_index(name) for name, _ in held]
        self.routed = routed  # the model has MoE layers (on some stage): every rank joins `finish_step`
        self.stages: list[PipelineStage] = []  # the schedule's stages (none without pipelining)
        self.first_stage = self.last_stage = True  # feeds the inputs / computes the loss
        self.phase: Phase = _untimed

    @property
    def micro_batches_per_evaluation(self) -> int:
        """How many micro-batches one `evaluate` call takes."""
        return 1

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every part's parameters, each once (two stages of a rank may share one: tied embeddings)."""
        return iter({id(param): param for part in self.parts for param in part.parameters()}.values())

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def time_phases(self, phase: Phase) -> None:
        """Each forward and backward of a micro-batch becomes a `phase` span (the per-rank timeline)."""
        self.phase = phase

    def begin_step(self) -> None:
        """Before the step's batch is fetched: training mode, and the first all-gathers on their way."""
        self.train()
        if self.gather_early:
            issue_first_all_gathers(self.parts)

    def forward_backward(self, batches: Batches, loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward over the step's micro-batches, accumulating the gradient of their mean
        loss; returns that mean loss (where the layout holds it: 0 on ranks that do not)."""
        total = torch.zeros((), device=self.device)
        batches = self.local_slices(batches)
        # The auxiliary losses weigh in each micro-batch's backward as its main loss does.
        with loss_context(self.tensor_parallel), training_step(aux_loss_scale=1 / len(batches)):
            for index, (inputs, labels) in enumerate(batches):
                if self.zero1:
                    sync_gradients(self.parts, index == len(batches) - 1)
                with self.phase("forward", micro_batch=index):
                    loss = self._loss(inputs, labels, loss_fn) / len(batches)
                with self.phase("backward", micro_batch=index):
                    loss.backward()
                total += full_tensor(loss.detach())
        return total

    @torch.no_grad()
    def evaluate(self, batches: Batches, loss_fn: LossFn) -> torch.Tensor:
        """The mean loss over `micro_batches_per_evaluation` micro-batches, without gradients."""
        with loss_context(self.tensor_parallel):
            return full_tensor(self._loss(*self.local_slices(batches)[0], loss_fn))

    def local_slices(self, batches: Batches) -> Batches:
        """The micro-batches as this rank computes them: under context parallelism, its slice of every
        sequence, inputs and labels alike (`shard_sequence`); the loss is then the mean over its tokens,
        and the mean over the cp ranks (equal token counts) is the whole sequences' mean."""
        cp, rank = self.context
        if cp == 1:
            return batches
        return [
            (shard_sequence(inputs, cp, rank), shard_sequence(labels, cp, rank)) for inputs, labels in batches
        ]

    def clip_gradients(self, max_norm: float | None) -> torch.Tensor:
        """The global gradient L2 norm over every shard (TP, FSDP) and stage (PP), clipped to `max_norm`
        when set, as one process would; the reduce-scatters still in flight finish first."""
        if self.reductions is not None:
            self.reductions.wait()
        return clip_by_global_norm(self.parameters(), max_norm, self.pipeline_group)

    def finish_step(self) -> dict[str, float]:
        """After the optimizer step, in a model with MoE layers: their expert loads and dropped slots summed
        over the ranks routing other tokens (one all-reduce for every layer, per group), their routing
        biases moved toward an even load, and the router's health for the metrics, over every layer of
        every stage: the worst layer's max/mean expert load, each layer's, and the share of routed slots
        dropped (capacity)."""
        if not self.routed:
            return {}
        if not self.moe_layers:  # a stage of dense layers only: it adds nothing to the health
            counts = torch.zeros(0, 3, device=self.device)  # no loads; dropped, balancing loss sum, count
        else:
            counts = torch.stack(
                [torch.cat([layer.load, layer.dropped[None], layer.balance]) for layer in self.moe_layers]
            )
            for group in self.routing_groups:
                dist.all_reduce(counts, group=group)
        balance = counts[:, -2:]  # each layer's balancing losses summed, and how many
        counts = counts[:, :-2]
        for layer, count in zip(self.moe_layers, counts):
            layer.load.copy_(count[:-1])
            layer.dropped.zero_()
        # Each layer's busiest expert over the mean, by block index (0 where another stage holds it).
        by_layer = torch.zeros(self.n_layers(), device=self.device)
        for index, load in zip(self.moe_layer_indices, counts[:, :-1]):
            by_layer[index] = load.max() / load.mean()
        dropped, slots = counts[:, -1].sum(), counts[:, :-1].sum()
        # The balancing loss: each layer's mean over the step's forwards, summed over layers, and layers.
        measured = balance[:, 1] > 0
        aux = (balance[measured, 0] / balance[measured, 1]).sum()
        totals = torch.stack([dropped, slots, aux, measured.sum().to(aux.dtype)]).to(by_layer.dtype)
        health = torch.cat([by_layer, totals])
        if self.pipeline_group is not None:  # every stage's layers, and the total drops
            dist.all_reduce(health, group=self.pipeline_group)  # each layer is held by one stage
        for layer in self.moe_layers:
            layer.update_bias()
        *imbalances, dropped_all, slots_all, aux_sum, aux_layers = health.tolist()
        metrics = {
            "moe_load_max_over_mean": max(imbalances, default=0.0),
            "moe_dropped_fraction": dropped_all / max(slots_all, 1.0),
        }
        if aux_layers:
            metrics["moe_aux_loss"] = aux_sum / aux_layers
        metrics |= {
            f"moe_layer{index}_load_max_over_mean": value for index, value in enumerate(imbalances) if value
        }
        return metrics

    def n_layers(self) -> int:
        """Blocks of the whole model (every stage's): a stage is a copy of the model, config included."""
        config: ModelConfig = self.parts[0].cfg  # type: ignore[assignment]  # models.llama.Transformer's
        return config.n_layers

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        with self.autocast():
            logits = self.parts[0](inputs)
        return loss_fn(logits, labels)


class PipelinedModel(ParallelModel):
    """This rank's pipeline stages, stepped by the pipeline schedule over all the step's micro-batches at
    once. Only the first stage is given the inputs, only the last the labels and the loss."""

    def __init__(
        self,
        parts: list[nn.Module],
        *,
        schedule: Callable[..., tuple[_PipelineSchedule, list[PipelineStage]]],  # (loss_fn=) -> built
        microbatches: int,
        first_stage: bool,
        last_stage: bool,
        whole: tuple[list[nn.Parameter], list[ProcessGroup]] = ([], []),
        **options: Any,
    ):
        super().__init__(parts, **options)
        # Parameters two stages share, which FSDP leaves whole, and the groups to average their gradients.
        self.whole, self.data_groups = whole
        self.microbatches = microbatches
        self.first_stage, self.last_stage = first_stage, last_stage
        self._loss_fn: LossFn | None = None  # the loss of the schedule's current step
        self.schedule, self.stages = schedule(loss_fn=self._scheduled_loss)
        # A step's micro-batches (their backward too, which may recompute the forward), not the schedule's
        # shape inference, which runs the stage once more: the schedule divides the gradients by the
        # micro-batches afterwards, so auxiliary losses weigh 1.
        for stage in self.stages:
            for name in _CHUNK_RUNS:
                setattr(stage, name, self._within(getattr(stage, name)))

    @property
    def micro_batches_per_evaluation(self) -> int:
        return self.microbatches

    def time_phases(self, phase: Phase) -> None:
        """Each stage's forward and backward of one chunk becomes a `phase` span."""
        for stage in self.stages:
            # Wrapped on the instance: torch's schedules call these per chunk, with no hook around them.
            for name, span in _CHUNK_RUNS.items():
                setattr(stage, name, self._timed(phase, getattr(stage, name), span, stage.stage_index))

    def forward_backward(self, batches: Batches, loss_fn: LossFn) -> torch.Tensor:
        """All micro-batches through the schedule, forward and backward (it scales the gradients by
        1/micro-batches); the mean loss on the last stage, 0 elsewhere."""
        loss = self._run(self.schedule.step, batches, loss_fn)
        for param in self.whole:  # averaged over the data-parallel ranks, as FSDP averages its own
            for group in self.data_groups:
                assert param.grad is not None  # both stages holding it ran their backward
                dist.all_reduce(param.grad, group=group)
                param.grad.div_(dist.get_world_size(group))
        return loss

    @torch.no_grad()
    def evaluate(self, batches: Batches, loss_fn: LossFn) -> torch.Tensor:
        return self._run(self.schedule.eval, batches, loss_fn)

    def _run(self, run: Callable[..., Any], batches: Batches, loss_fn: LossFn) -> torch.Tensor:
        inputs, labels = (torch.cat(column) for column in zip(*self.local_slices(batches)))
        losses: list[torch.Tensor] = []
        self._loss_fn = loss_fn
        with loss_context(self.tensor_parallel), self.autocast():
            run(
                *((inputs,) if self.first_stage else ()),
                target=labels if self.last_stage else None,
                losses=losses if self.last_stage else None,
                return_outputs=False,
            )
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([full_tensor(loss.detach()) for loss in losses]).mean()

    def _scheduled_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None  # the schedule computes losses only inside `_run`
        return self._loss_fn(logits, labels)

    @staticmethod
    def _within(run_chunk: Callable[..., Any]) -> Callable[..., Any]:
        def in_training_step(*args: Any, **kwargs: Any) -> Any:
            with training_step(aux_loss_scale=1.0):
                return run_chunk(*args, **kwargs)

        return in_training_step

    @staticmethod
    def _timed(phase: Phase, run_chunk: Callable[..., Any], name: str, chunk: int) -> Callable[..., Any]:
        def timed(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            with phase(name, micro_batch=chunk_id, chunk=chunk):
                return run_chunk(chunk_id, *args, **kwargs)

        return timed


# A stage's per-chunk runs, and the timeline span of each: the zero-bubble schedules run a backward as its
# input gradient ("backward", on the critical path) and later its weight gradient ("backward_weight").
_CHUNK_RUNS = {
    "forward_one_chunk": "forward",
    "backward_one_chunk": "backward",
    "backward_weight_one_chunk": "backward_weight",
}


def _block_index(name: str) -> int:
    """The block index in a module name such as 'layers.3.feed_forward' (wrappers' names between)."""
    parts = name.split(".")
    return int(parts[parts.index(sharding.BLOCKS) + 1])
