"""The Trainer: build every part of a run from the config, run the loop, and make all of it resumable.

Everything that must survive a restart (model and optimizer, LR schedule, data position, RNG, step) is
`Stateful` and goes through the one Checkpointer, so a run killed at any point and started again with the
same command continues with bit-identical losses. The step itself (`train_step`) is one short function:
the step's micro-batches through the parallelised model's step protocol (parallel/step.py, the same calls
in every layout), global-norm clipping, optimizer and scheduler.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from megascale.autocompile import compiles
from megascale.checkpoint.checkpointer import Checkpointer
from megascale.checkpoint.ledger import LEDGER
from megascale.checkpoint.resume import check_before_start
from megascale.checkpoint.snapshot import flatten
from megascale.checkpoint.stateful import ModelState, OptimizerState, SchedulersState
from megascale.config import JobConfig, to_dict
from megascale.data import build_dataloaders
from megascale.data.dataset import IGNORE_INDEX
from megascale.errors import ConfigError, MegascaleError, NonFiniteError
from megascale.gc_control import AlignedGC
from megascale.malloc import keep_freed_memory
from megascale.models.flops import flops_per_token, num_params
from megascale.models.llama import Transformer
from megascale.models.loss import cross_entropy_sum
from megascale.observe.experts import expert_slots_by_rank
from megascale.observe.instruments import Instruments, StepMetrics, format_record
from megascale.observe.metrics import MetricsWriter
from megascale.observe.progress import TrainingProgress, log_to_files, make_console, setup_logging
from megascale.observe.timeline import Timeline
from megascale.observe.wandb_sink import WandbSink
from megascale.optim import apply_settings, build_lr_scheduler, build_optimizer
from megascale.parallel.dims import ParallelDims
from megascale.parallel.distributed import env_world_size, join_job, pick_device
from megascale.parallel.float8 import convert_to_float8
from megascale.parallel.parallelize import parallelize
from megascale.parallel.step import ParallelModel
from megascale.resilience.client import ProgressReporter, is_standby, wait_until_activated
from megascale.resilience.inject import FaultInjector

log = logging.getLogger("megascale.trainer")

# A stop signal arriving this soon after the first is the same request, delivered twice.
SIGNAL_ECHO_S = 2.0


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over tokens and divided by the number of labels, in float32 whatever
    the autocast dtype (on vocabulary shards under tensor parallelism, inside `loss_context`). Labels equal
    to IGNORE_INDEX (validation's padding) add nothing but count in the division, so the result times the
    number of labels is the sum over the real tokens however a batch is padded; without padding it is the
    mean."""
    loss_sum = cross_entropy_sum(logits.flatten(0, 1), labels.flatten(), IGNORE_INDEX)
    return loss_sum / labels.numel()


def prepare_run_dir(path: str) -> Path:
    """Create the run directory and prove it is writable, before anything else is written."""
    run_dir = Path(path).expanduser()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test-"):
            pass
    except OSError as err:
        raise ConfigError(
            f"config: training.run_dir = {path!r} is not writable ({err.strerror or err}); "
            f"choose another with --training.run_dir=DIR"
        ) from None
    return run_dir


class Trainer(Stateful):
    """Builds model, optimizer, schedule, data and checkpointer from a JobConfig; `train()` runs the loop.

    In a multi-process job every rank builds one Trainer; rank 0 alone writes logs, metrics and the
    progress bar, and every decision that ends the loop (a stop signal) is agreed by all ranks.
    """

    def __init__(self, cfg: JobConfig, *, console: Any = None, debug: bool = False):
        self._logging = False  # whether this run's train.log is set up
        try:
            self._build(cfg, console, debug)
        except BaseException as err:
            self._stop_threads()  # a refused resume, say: nothing it started keeps running
            self._log_error(err)
            raise

    def _build(self, cfg: JobConfig, console: Any, debug: bool) -> None:
        """The run's parts, in the order they need each other."""
        self._open_run(cfg, console, debug)
        self._build_runtime()
        self._build_data()
        self._build_model()
        if is_standby():
            self._stand_by()
        self._resume()
        self._build_instruments()

    def _stand_by(self) -> None:
        """A warm standby, built ahead of a fault: do now what the first step after taking over would wait
        for, then wait to be activated (resilience/client.py)."""
        state = self.checkpoint_state()  # the state-dict machinery's first call, off the critical path
        flatten({part: state[part] for part in ("model", "optimizer")})
        gc.collect()
        gc.freeze()  # what exists now is never walked again: the loop's first collection is short
        wait_until_activated(self.rank)
        log.info("standby: activated; resuming")

    def _open_run(self, cfg: JobConfig, console: Any, debug: bool) -> None:
        """The layout and any checkpoint to resume are checked before a process group exists or a file is
        written; then the run directory and its log."""
        self.cfg = cfg
        training = cfg.training
        self.console = console or make_console()
        # The layout is checked against the launcher's world size before any process group exists.
        self.parallel_dims = ParallelDims.from_config(cfg, world_size=env_world_size())
        self.rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        self.run_dir = prepare_run_dir(training.run_dir)
        self.checkpoint_root = checkpoint_root = cfg.checkpoint.location or str(self.run_dir / "checkpoints")
        check_before_start(cfg, checkpoint_root)  # another model's checkpoint costs no process
        setup_logging(self.run_dir, self.console, debug, rank=self.rank)
        self._logging = True

    def _build_runtime(self) -> None:
        """Threads, device, process groups and mesh, the checkpointer, and the step's batch arithmetic."""
        cfg, training, dims = self.cfg, self.cfg.training, self.parallel_dims
        if training.threads is not None:
            torch.set_num_threads(training.threads)
        self.device = pick_device(training.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        join_job(self.device, dims, cfg.parallel)
        self.checkpointer = Checkpointer(
            self.checkpoint_root,
            keep=cfg.checkpoint.keep,
            async_save=cfg.checkpoint.async_save,
            process_group=dims.checkpoint_group() if dims.world_size > 1 else None,
            ledger=self.run_dir / LEDGER,
        )
        self.grad_accum_steps = training.global_batch_size // dims.dp // training.micro_batch_size
        self.tokens_per_step = training.global_batch_size * cfg.data.seq_len
        self.dp_rank = dims.dp_rank()

    def _build_data(self) -> None:
        cfg, training, dims = self.cfg, self.cfg.training, self.parallel_dims
        self.train_loader, self.val_loader = build_dataloaders(
            cfg.data,
            model_vocab_size=cfg.model.vocab_size,
            micro_batch_size=training.micro_batch_size,
            seed=training.seed,
            dp_rank=self.dp_rank,
            dp_size=dims.dp,
            micro_batches_per_step=self.grad_accum_steps,
            timeout_s=cfg.parallel.timeout_s,
            progress=cfg.metrics.progress and self.rank == 0,
        )
        log.info(
            "data: %s (%s, tokenizer vocab %d)",
            self.train_loader.dataset_dir,
            "streamed" if cfg.data.streaming else f"{self.train_loader.num_tokens:,} tokens",
            self.train_loader.tokenizer.vocab_size,
        )

    def _build_model(self) -> None:
        """The model, parallelised by `parallelize`, its optimizers and schedules."""
        cfg, training, dims = self.cfg, self.cfg.training, self.parallel_dims
        self.injector = FaultInjector(cfg.resilience.inject, self.rank, checkpoints=self.checkpoint_root)
        self.reporter = ProgressReporter(self.rank)
        self._last_nonfinite_step: int | None = None
        torch.manual_seed(training.seed)
        model = Transformer(cfg.model).to(self.device)
        precision = training.dtype
        if training.fp8 != "none":
            exclude = [name.strip() for name in training.fp8_exclude.split(",") if name.strip()]
            converted = convert_to_float8(
                model, training.fp8, all_gather=training.fp8_all_gather, exclude=exclude
            )
            precision += f" with {converted} float8 linear layers ({training.fp8})"
        self.compiled = compiles(cfg, dims, self.device.type)  # training.compile, or where it wins
        self.model: ParallelModel = parallelize(
            model,
            dims,
            cfg.parallel,
            device=self.device,
            microbatches=self.grad_accum_steps,
            autocast_dtype=torch.bfloat16 if training.dtype == "bfloat16" else None,
            compile_blocks=self.compiled,
            float8_all_gather=training.fp8_all_gather,
        )
        self.optimizers = [build_optimizer(part, cfg.optim) for part in self.model.parts]
        self.lr_schedulers = [build_lr_scheduler(opt, cfg.optim, training.steps) for opt in self.optimizers]
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        log.info(
            "model: %s parameters, %.1f MFLOPs/token; device %s, %s%s, %d threads%s",
            f"{num_params(cfg.model):,}",
            self.flops_per_token / 1e6,
            self.device,
            precision,
            ", compiled" if self.compiled else "",
            torch.get_num_threads(),
            f"; {dims.describe()}" if dims.world_size > 1 else "",
        )

    def _resume(self) -> None:
        """From the newest verified checkpoint, else from checkpoint.init_from's weights or from scratch."""
        self.step = 0
        self._stop_signal: int | None = None  # asked of this process
        self._stop_agreed = False  # decided by all ranks together
        dims = self.parallel_dims
        state = self.checkpoint_state()
        layout, replicas = dims.describe(), dims.replica_group()
        if self.checkpointer.resume(state, self.cfg, layout=layout, replicas=replicas) is not None:
            for optimizer, scheduler in zip(self.optimizers, self.lr_schedulers):
                apply_settings(optimizer, scheduler, self.cfg.optim)  # the config's, not the checkpoint's
        self.resumed_from = self.step  # reported to the driver, which logs where a restart took up
        if self.cfg.checkpoint.enabled:
            self.checkpointer.prepare(state)

    def _build_instruments(self) -> None:
        cfg, dims = self.cfg, self.parallel_dims
        self.instruments = Instruments(
            cfg,
            self.run_dir,
            rank=self.rank,
            coordinates=dims.coordinates(),
            stage_of_rank=dims.stage_of_ranks(),
            ep_of_rank=dims.ep_of_ranks() if dims.expert_ranks > 1 else [],
            device=self.device,
            start_step=self.step,
            world_size=dims.world_size,
            tokens_per_step=self.tokens_per_step,
            flops_per_token=self.flops_per_token,
            stretch=lambda compute_s, clock: self.injector.stretch(self.step + 1, compute_s, clock),
        )
        self._closed = False
        self.model.time_phases(self.instruments.phase)
        self._rank_compute_s: list[float] = []  # every rank's compute in the last step (from the all-reduce)
        self._rank_expert_slots: list[float] = []  # every rank's expert load in it (expert parallelism)
        # The global ranks of this rank's expert-parallel group, in ep order: where its tokens' slots go.
        self._ep_group = dims.expert_mesh()["ep"].mesh.tolist() if dims.expert_ranks > 1 else []

    @property
    def timeline(self) -> Timeline:
        return self.instruments.timeline

    # -- Stateful ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rng": torch.get_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        torch.set_rng_state(state_dict["rng"])

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "trainer": self,
            "model": ModelState(self.model.parts),
            "optimizer": OptimizerState(self.model.parts, self.optimizers),
            "lr_scheduler": SchedulersState(self.lr_schedulers),
            "data": self.train_loader,
        }

    # -- the loop ------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Train to `training.stop_at_step`, else `training.steps`; checkpoint on schedule, at the end and on
        SIGINT/SIGTERM."""
        training = self.cfg.training
        metrics = self.cfg.metrics
        writer = MetricsWriter(
            self.run_dir,
            jsonl=metrics.jsonl and self.rank == 0,
            tensorboard=metrics.tensorboard and self.rank == 0,
            purge_step=self.step + 1,
            wandb=(
                WandbSink(
                    self.run_dir,
                    metrics.wandb,
                    metrics.wandb_project,
                    metrics.wandb_entity,
                    to_dict(self.cfg),
                )
                if metrics.wandb != "off" and self.rank == 0
                else None
            ),
        )
        end = training.stop_at_step or training.steps
        summary: dict[str, Any] = {"start_step": self.step, "interrupted": False, "end_step": end}
        if self.step >= end:
            log.warning(
                "nothing to train: the run in %s is already at step %d, and training ends at step %d "
                "(training.%s); raise it to go on, or give a new --training.run_dir to start afresh",
                self.run_dir,
                self.step,
                end,
                "stop_at_step" if training.stop_at_step else "steps",
            )
        started_s = time.perf_counter()
        # The handlers stay through the last save: a rank whose own signal comes after the ranks agreed to
        # stop (another rank's signal carried the agreement) must save with them, not die in the save.
        with self._stop_on_signals():
            try:
                steps_run = self._run_steps(end, writer, summary)
                if summary["interrupted"] and self.cfg.checkpoint.enabled:
                    self.save_checkpoint()
                self.reporter.finish()
            except BaseException as err:
                self._stop_threads()  # not the save in flight, which may wait on ranks that are gone
                self._log_error(err)
                raise
            finally:
                writer.close()
            self.close()
        summary.update(step=self.step, wall_s=time.perf_counter() - started_s, steps_run=steps_run)
        return summary

    def _run_steps(self, end: int, writer: MetricsWriter, summary: dict[str, Any]) -> int:
        """Step, log, validate and checkpoint until step `end` or an agreed stop; the steps taken."""
        training = self.cfg.training
        steps_run = 0
        collector = AlignedGC(training.gc_every)
        with (
            collector,
            TrainingProgress(
                self.console, end, self.step, live=self.cfg.metrics.progress and self.rank == 0
            ) as progress,
        ):
            while self.step < end:
                metrics = self.train_step()
                self.step += 1
                steps_run += 1
                record = self.instruments.record(metrics, self.step)
                if not (math.isfinite(metrics.loss) and math.isfinite(metrics.grad_norm)):
                    self._last_nonfinite_step = self.step
                self.reporter.report(
                    self.step,
                    loss=metrics.loss,
                    grad_norm=metrics.grad_norm,
                    step_time_s=metrics.step_time_s,
                    last_nonfinite_step=self._last_nonfinite_step,  # sticky: the driver reads now and then
                    resumed_from=self.resumed_from,
                    stragglers=record.get("stragglers", []),  # the driver makes them eviction candidates
                )
                last = self.step == end
                if (self.step % training.val_every == 0 or last) and self.val_loader.num_sequences:
                    record["val_loss"] = summary["val_loss"] = self.validate()
                if self.step % training.log_every == 0 or last or "val_loss" in record:
                    writer.write(self.step, record)
                    log.info(format_record(record, self.step, training.steps))
                progress.update(self.step, f"loss {metrics.loss:.4f}")
                summary["loss"] = metrics.loss
                if self._stop_agreed:
                    log.info(
                        "received %s: saving a checkpoint, then exiting",
                        signal.Signals(self._stop_signal or signal.SIGTERM).name,
                    )
                    summary["interrupted"] = True
                    break
                if self.cfg.checkpoint.enabled and (self.step % self.cfg.checkpoint.every == 0 or last):
                    self.save_checkpoint()
                elif self.cfg.checkpoint.enabled and self._snapshot_due():
                    self.snapshot()
                if collector.due(self.step):
                    with self.timeline.span("gc", step=self.step):
                        collector.collect()
        return steps_run

    def _log_error(self, err: BaseException) -> None:
        """A user's error (bad data, a refused resume) also in this run's train.log, which says how the run
        ended; the CLI prints it to the console."""
        if self._logging and isinstance(err, MegascaleError):
            log_to_files(f"error: {err}")

    def _stop_threads(self) -> None:
        """End this process's threads and leave the node's shared ring: the loader's and the instruments'
        (whichever exist yet)."""
        for part in ("train_loader", "instruments"):
            if hasattr(self, part):
                getattr(self, part).close()

    def close(self) -> None:
        """Let go of what outlives the Python objects: the save in flight and the snapshot memory, the
        loader's prefetch thread and the node's shared ring, the timeline's files and the hang watch.
        `train` does it before it returns; a Trainer stepped by hand (a test, a notebook) calls it when
        done. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.checkpointer.close()  # raises when the last save failed
        finally:
            self._stop_threads()

    def train_step(self) -> StepMetrics:
        """One optimizer step over `global_batch_size` sequences (gradient accumulation), clipped."""
        started = time.perf_counter()
        started_ns = time.perf_counter_ns()
        self.timeline.begin_step()
        self.injector.before_step(self.step + 1)
        self.model.begin_step()  # with DP overlap, the first all-gathers overlap the data loading
        data_wait_s = 0.0
        batches = []
        for index in range(self.grad_accum_steps):
            fetch_started = time.perf_counter()
            with self.timeline.span("data", micro_batch=index):
                inputs, labels = next(self.train_loader)
            data_wait_s += time.perf_counter() - fetch_started
            batches.append((inputs.to(self.device), labels.to(self.device)))
        local_loss = self.model.forward_backward(batches, self._loss_fn())
        with self.instruments.phase("clip"):
            grad_norm = self.model.clip_gradients(self.cfg.optim.grad_clip)
        lr = self.optimizers[0].param_groups[0]["lr"]
        finite = bool(torch.isfinite(grad_norm))  # the norm is global: every rank decides alike
        if not finite:
            self._on_nonfinite(grad_norm)
        with self.instruments.phase("optimizer"):
            for optimizer, scheduler in zip(self.optimizers, self.lr_schedulers):
                if finite:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            expert_slots = None
            if self._ep_group:  # counted before finish_step sums the loads and clears them
                layers, world = self.model.moe_layers, self.parallel_dims.world_size
                expert_slots = expert_slots_by_rank(layers, self._ep_group, world, self.device)
            router = self.model.finish_step()  # MoE: routing biases from the step's loads, and its health
        # One sync per step; it also carries every rank's compute time and expert load to every rank.
        compute_s = self.timeline.compute_busy_s() if self.timeline.enabled else None
        loss_value = self._job_mean(
            local_loss, agree_on_stop=True, compute_s=compute_s, expert_slots=expert_slots
        ).item()
        step_time_s = time.perf_counter() - started
        self.timeline.add("step", "step", started_ns, time.perf_counter_ns(), {"step": self.step + 1})
        return StepMetrics(
            loss=loss_value,
            grad_norm=grad_norm.item(),
            lr=lr,
            step_time_s=step_time_s,
            data_wait_s=data_wait_s,
            breakdown=self.timeline.step.as_metrics(step_time_s, data_wait_s)
            if self.timeline.enabled
            else {},
            rank_compute_s=self._rank_compute_s,
            router=router,
            rank_expert_slots=self._rank_expert_slots,
        )

    def _on_nonfinite(self, grad_norm: torch.Tensor) -> None:
        """A NaN/inf gradient norm: skip this update, or (nan_policy = rollback) end the process so that
        the driver restarts from the newest checkpoint."""
        step, policy = self.step + 1, self.cfg.resilience.nan_policy
        if policy == "rollback":
            raise NonFiniteError(
                f"step {step}: non-finite gradient norm ({grad_norm.item()}); exiting for a rollback to "
                "the newest checkpoint (resilience.nan_policy = rollback)"
            )
        log.warning(
            "step %d: non-finite gradient norm (%s); update skipped (resilience.nan_policy = skip)",
            step,
            grad_norm.item(),
        )

    def _loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The step's loss: next-token cross-entropy, scaled when an injected fault asks for it."""
        scale = self.injector.loss_scale(self.step + 1)
        if scale == 1.0:
            return next_token_loss
        return lambda logits, labels: next_token_loss(logits, labels) * scale

    def _job_mean(
        self,
        local: torch.Tensor,
        agree_on_stop: bool = False,
        compute_s: float | None = None,
        expert_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The job-wide mean of a value of each data-parallel rank (of each slice of its sequences, under
        context parallelism) held on the last stage (and the same on every tensor-parallel rank): one
        all-reduce over all ranks, every rank getting the result.

        With `agree_on_stop`, whether any rank has been asked to stop travels in the same all-reduce and
        sets `_stop_agreed` alike on every rank: a signal that lands on one rank just after the all-reduce
        is acted on a step later by all of them, never by that rank alone. `compute_s`, this rank's compute
        time, travels in it too, in this rank's own slot: `_rank_compute_s` gets every rank's. So does
        `expert_slots`, this rank's part of every rank's expert load (observe/experts.py), summed into
        `_rank_expert_slots`."""
        asked = self._stop_signal is not None
        if self.parallel_dims.world_size == 1:
            if agree_on_stop:
                self._stop_agreed = asked
            if compute_s is not None:
                self._rank_compute_s = [compute_s]
            return local
        # One value per batch and slice of its sequences (cp), each the mean over its tokens.
        holds = self.model.last_stage and self.parallel_dims.local_rank("tp") == 0
        holders = self.parallel_dims.dp * self.parallel_dims.cp
        share = local.detach().float() / holders if holds else torch.zeros((), device=self.device)
        slots = torch.zeros(self.parallel_dims.world_size if compute_s is not None else 0, device=self.device)
        if compute_s is not None:
            slots[self.rank] = compute_s
        experts = expert_slots if expert_slots is not None else torch.zeros(0, device=self.device)
        flags = torch.stack([share, torch.tensor(float(agree_on_stop and asked), device=self.device)])
        packed = torch.cat([flags, slots, experts])
        dist.all_reduce(packed)
        if agree_on_stop:
            self._stop_agreed = packed[1].item() > 0
        if compute_s is not None:
            self._rank_compute_s = packed[2 : 2 + len(slots)].tolist()
        if expert_slots is not None:
            self._rank_expert_slots = packed[2 + len(slots) :].tolist()
        return packed[0]

    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss over the first `training.val_sequences` validation sequences, the same ones in
        every layout: each data-parallel rank sums the token losses of its share (padded to whole
        micro-batches, or to whole steps of the pipeline schedule), and one all-reduce adds the shares."""
        self.model.train(False)
        unit = self.model.micro_batches_per_evaluation
        sequences, dp = self.cfg.training.val_sequences, self.parallel_dims.dp
        batches = [
            (inputs.to(self.device), labels.to(self.device))
            for inputs, labels in self.val_loader.share(sequences, self.dp_rank, dp, unit)
        ]
        loss_sum = torch.zeros((), device=self.device)
        for start in range(0, len(batches), unit):
            group = batches[start : start + unit]
            slots = sum(labels.numel() for _, labels in group)  # each loss is a sum over slots
            loss_sum += self.model.evaluate(group, next_token_loss) * slots
        self.model.train()
        tokens = sequences * self.cfg.data.seq_len
        return self._job_mean(loss_sum * dp / tokens).item()

    def save_checkpoint(self, blocking: bool = False) -> str:
        """Snapshot the state now; it is written and committed in the background unless `blocking`."""
        descriptor = {"config": to_dict(self.cfg), "layout": self.parallel_dims.describe()}
        with self.timeline.span("checkpoint", step=self.step):  # stage 1: the copy to host memory
            location = self.checkpointer.save(self.step, self.checkpoint_state(), descriptor)
        if blocking:
            self.checkpointer.wait()
        return location

    def snapshot(self) -> None:
        """Copy the state into this node's memory (stage 1 alone): a restart on these nodes resumes here."""
        descriptor = {"config": to_dict(self.cfg), "layout": self.parallel_dims.describe()}
        with self.timeline.span("snapshot", step=self.step):
            self.checkpointer.snapshot(self.step, self.checkpoint_state(), descriptor)

    def _snapshot_due(self) -> bool:
        every = self.cfg.checkpoint.snapshot_every
        return every > 0 and self.step % every == 0

    # -- helpers -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _stop_on_signals(self):
        """SIGINT/SIGTERM finish the current step, save a checkpoint and end the loop (exit status 0).

        A second signal stops at once, unless it comes within SIGNAL_ECHO_S of the first: Ctrl-C reaches
        the workers both from the terminal and forwarded by the launcher, and that is one request."""
        first_signal_at = None

        def request_stop(signum: int, frame: Any) -> None:
            nonlocal first_signal_at
            if first_signal_at is None:
                first_signal_at = time.monotonic()
                self._stop_signal = signum
            elif time.monotonic() - first_signal_at > SIGNAL_ECHO_S:  # a second request: stop now
                raise KeyboardInterrupt

        if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
            yield
            return
        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
