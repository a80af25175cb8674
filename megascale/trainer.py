"""The Trainer: build every part of a run from the config, run the loop, and make all of it resumable.

Everything that must survive a restart (model and optimizer, LR schedule, data position, RNG, step) is
`Stateful` and goes through the one Checkpointer, so a run killed at any point and started again with the
same command continues with bit-identical losses. The step itself (`train_step`) is one short function:
gradient accumulation over micro-batches, global-norm clipping, optimizer and scheduler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful

from megascale.checkpoint.checkpointer import Checkpointer, read_descriptor
from megascale.checkpoint.stateful import ModelState, OptimizerState
from megascale.config import JobConfig, ModelConfig, flatten_keys, to_dict
from megascale.data import build_dataloaders
from megascale.errors import CheckpointError, ConfigError
from megascale.models.flops import flops_per_token, num_params
from megascale.models.llama import Transformer
from megascale.observe.metrics import MetricsWriter
from megascale.observe.peak import Peak, calibrate, peak_for
from megascale.observe.progress import TrainingProgress, make_console, setup_logging
from megascale.optim import build_lr_scheduler, build_optimizer
from megascale.parallel.dims import ParallelDims

log = logging.getLogger("megascale.trainer")

# Model fields that may change between a checkpoint and the run resuming from it: they change no tensor.
RESUMABLE_MODEL_CHANGES = {"init_std", "norm_eps", "max_seq_len", "attention.window", "attention.rope_theta"}


@dataclass
class StepMetrics:
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    data_wait_s: float


def pick_device(name: str) -> torch.device:
    """'auto' means the current accelerator (CUDA, XPU, ...) if there is one, else the CPU."""
    if name == "auto":
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return accelerator if accelerator is not None else torch.device("cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"config: training.device = {name!r} is not a device; use 'auto', 'cpu' or 'cuda'"
        ) from None


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


def check_model_matches(checkpoint: Path, descriptor: dict[str, Any], model_cfg: ModelConfig) -> None:
    """Refuse a checkpoint written for a model of another shape, naming the first differing field."""
    saved = flatten_keys(descriptor.get("config", {}).get("model", {}))
    current = flatten_keys(dataclasses.asdict(model_cfg))
    for key, value in current.items():
        if key in RESUMABLE_MODEL_CHANGES or saved.get(key, value) == value:
            continue
        raise CheckpointError(
            f"checkpoint: {checkpoint} was written for model.{key} = {saved[key]!r}, but "
            f"the config has model.{key} = {value!r}; use the same model settings, or a "
            f"new --training.run_dir to start afresh"
        )


def load_model_weights(checkpoint: Path, model: torch.nn.Module) -> None:
    """Load only the model entry of a checkpoint (no optimizer, schedule or data position); the caller has
    checked it was written for this model's shape (`check_model_matches`)."""
    Checkpointer(checkpoint.parent, keep=1).load(checkpoint, {"model": ModelState(model)})


class Trainer(Stateful):
    """Builds model, optimizer, schedule, data and checkpointer from a JobConfig; `train()` runs the loop."""

    def __init__(self, cfg: JobConfig, *, console: Any = None, debug: bool = False):
        self.cfg = cfg
        training = cfg.training
        self.console = console or make_console()
        # Multi-process training is not wired in yet: the layout must fit this one process.
        self.parallel_dims = ParallelDims.from_config(cfg, world_size=1)
        self.run_dir = prepare_run_dir(training.run_dir)
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep=cfg.checkpoint.keep)
        resume_from = self.checkpointer.latest() if cfg.checkpoint.resume else None
        if resume_from is not None:
            check_model_matches(resume_from, read_descriptor(resume_from), cfg.model)
        elif cfg.checkpoint.init_from is not None:
            init_from = Path(cfg.checkpoint.init_from).expanduser()
            check_model_matches(init_from, read_descriptor(init_from), cfg.model)
        setup_logging(self.run_dir, self.console, debug)

        if training.threads is not None:
            torch.set_num_threads(training.threads)
        self.device = pick_device(training.device)
        self.autocast_dtype = torch.bfloat16 if training.dtype == "bfloat16" else None
        self.grad_accum_steps = training.global_batch_size // training.micro_batch_size
        self.tokens_per_step = training.global_batch_size * cfg.data.seq_len

        self.train_loader, self.val_loader = build_dataloaders(
            cfg.data,
            model_vocab_size=cfg.model.vocab_size,
            micro_batch_size=training.micro_batch_size,
            seed=training.seed,
            progress=cfg.metrics.progress,
        )
        log.info(
            "data: %s (%s tokens, tokenizer vocab %d)",
            self.train_loader.dataset_dir,
            f"{self.train_loader.num_tokens:,}",
            self.train_loader.tokenizer.vocab_size,
        )

        torch.manual_seed(training.seed)
        self.model = Transformer(cfg.model).to(self.device)
        if training.compile:
            for block in self.model.layers.values():
                block.compile()
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.optim, training.steps)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak = self._find_peak()
        log.info(
            "model: %s parameters, %.1f MFLOPs/token; device %s, %s, %d threads",
            f"{num_params(cfg.model):,}",
            self.flops_per_token / 1e6,
            self.device,
            training.dtype,
            torch.get_num_threads(),
        )

        self.step = 0
        self._stop_signal: int | None = None
        if resume_from is not None:
            self.checkpointer.load(resume_from, self.checkpoint_state())
            log.info("resumed from %s at step %d", resume_from, self.step)
        elif cfg.checkpoint.init_from is not None:
            load_model_weights(Path(cfg.checkpoint.init_from).expanduser(), self.model)
            log.info("initialised the model from %s", cfg.checkpoint.init_from)

    # -- Stateful ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rng": torch.get_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        torch.set_rng_state(state_dict["rng"])

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "trainer": self,
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler,
            "data": self.train_loader,
        }

    # -- the loop ------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Train to `training.steps`; checkpoint on schedule, at the end and on SIGINT/SIGTERM."""
        training = self.cfg.training
        writer = MetricsWriter(
            self.run_dir,
            jsonl=self.cfg.metrics.jsonl,
            tensorboard=self.cfg.metrics.tensorboard,
            purge_step=self.step + 1,
        )
        summary: dict[str, Any] = {"start_step": self.step, "interrupted": False}
        started_s, steps_run = time.perf_counter(), 0
        with (
            self._stop_on_signals(),
            TrainingProgress(
                self.console, training.steps, self.step, live=self.cfg.metrics.progress
            ) as progress,
        ):
            while self.step < training.steps:
                metrics = self.train_step()
                self.step += 1
                steps_run += 1
                record = self._record(metrics)
                last = self.step == training.steps
                if (self.step % training.val_every == 0 or last) and self.val_loader.num_sequences:
                    record["val_loss"] = summary["val_loss"] = self.validate()
                if self.step % training.log_every == 0 or last or "val_loss" in record:
                    writer.write(self.step, record)
                    log.info(self._format(record))
                progress.update(self.step, f"loss {metrics.loss:.4f}")
                summary["loss"] = metrics.loss
                if self._stop_signal is not None:
                    log.info(
                        "received %s: saving a checkpoint, then exiting",
                        signal.Signals(self._stop_signal).name,
                    )
                    summary["interrupted"] = True
                    break
                if self.cfg.checkpoint.enabled and (self.step % self.cfg.checkpoint.every == 0 or last):
                    self.save_checkpoint()
        if summary["interrupted"] and self.cfg.checkpoint.enabled:
            self.save_checkpoint()
        writer.close()
        summary.update(step=self.step, wall_s=time.perf_counter() - started_s, steps_run=steps_run)
        return summary

    def train_step(self) -> StepMetrics:
        """One optimizer step over `global_batch_size` sequences (gradient accumulation), clipped."""
        started = time.perf_counter()
        data_wait_s = 0.0
        self.model.train()
        total_loss = torch.zeros((), device=self.device)
        for _ in range(self.grad_accum_steps):
            fetch_started = time.perf_counter()
            inputs, labels = next(self.train_loader)
            data_wait_s += time.perf_counter() - fetch_started
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            loss = self.loss(inputs, labels) / self.grad_accum_steps
            loss.backward()
            total_loss += loss.detach()
        grad_norm = self.clip_gradients()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        loss_value = total_loss.item()  # synchronises the device once per step
        return StepMetrics(
            loss=loss_value,
            grad_norm=grad_norm.item(),
            lr=lr,
            step_time_s=time.perf_counter() - started,
            data_wait_s=data_wait_s,
        )

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, computed in float32 whatever the autocast dtype."""
        with self._autocast():
            logits = self.model(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    def clip_gradients(self) -> torch.Tensor:
        """Global gradient L2 norm, clipping to optim.grad_clip when set."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if self.cfg.optim.grad_clip is not None:
            torch.nn.utils.clip_grads_with_norm_(
                self.model.parameters(), self.cfg.optim.grad_clip, norm, foreach=True
            )
        return norm

    @torch.no_grad()
    def validate(self) -> float:
        """Mean loss over the first `val_batches` validation micro-batches (the same ones every time)."""
        self.model.eval()
        losses = [
            self.loss(inputs.to(self.device), labels.to(self.device))
            for inputs, labels in self.val_loader.batches(self.cfg.training.val_batches)
        ]
        self.model.train()
        return torch.stack(losses).mean().item()

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.step, self.checkpoint_state(), {"config": to_dict(self.cfg)})

    # -- helpers -------------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _find_peak(self) -> Peak | None:
        training = self.cfg.training
        threads = torch.get_num_threads()
        peak = peak_for(self.device, training.dtype, threads, training.peak_tflops)
        if peak is None and self.device.type == "cpu":
            log.info(
                "measuring this CPU's %s matmul peak once for MFU (megascale calibrate)...", training.dtype
            )
            peak = Peak(calibrate(training.dtype, threads), "measured")
        if peak is None:
            log.warning("MFU not shown: %s is not in the peak table; set --training.peak_tflops", self.device)
        elif peak.source == "measured":
            log.info(
                "MFU is relative to this CPU's measured %s matmul peak of %.3f TFLOP/s",
                training.dtype,
                peak.tflops,
            )
        return peak

    def _record(self, metrics: StepMetrics) -> dict[str, Any]:
        tokens_per_s = self.tokens_per_step / metrics.step_time_s
        record: dict[str, Any] = {
            "loss": metrics.loss,
            "grad_norm": metrics.grad_norm,
            "lr": metrics.lr,
            "tokens_per_s": tokens_per_s,
            "step_time_s": metrics.step_time_s,
            "data_wait_s": metrics.data_wait_s,
        }
        if self.peak is not None:
            record["mfu"] = tokens_per_s * self.flops_per_token / (self.peak.tflops * 1e12)
            record["peak_source"] = self.peak.source
        return record

    def _format(self, record: dict[str, Any]) -> str:
        parts = [f"step {self.step}/{self.cfg.training.steps}", f"loss {record['loss']:.4f}"]
        if "val_loss" in record:
            parts.append(f"val {record['val_loss']:.4f}")
        parts += [
            f"grad {record['grad_norm']:.3f}",
            f"lr {record['lr']:.2e}",
            f"{record['tokens_per_s']:,.0f} tok/s",
            f"{record['step_time_s']:.3f} s/step",
        ]
        if "mfu" in record:
            label = " (measured peak)" if record["peak_source"] == "measured" else ""
            parts.append(f"MFU {100 * record['mfu']:.1f}%{label}")
        if not math.isfinite(record["loss"]):
            parts.append("NON-FINITE LOSS")
        return " | ".join(parts)

    @contextlib.contextmanager
    def _stop_on_signals(self):
        """SIGINT/SIGTERM finish the current step, save a checkpoint and end the loop (exit status 0)."""

        def request_stop(signum: int, frame: Any) -> None:
            if self._stop_signal is not None:  # a second signal: stop now
                raise KeyboardInterrupt
            self._stop_signal = signum

        if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
            yield
            return
        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
