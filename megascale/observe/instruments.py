"""What a training run measures about itself, in one object the Trainer holds.

The Trainer runs the step; this module watches it: the per-rank timeline and the recording of every
collective into it, the hang watch, the straggler detector, and the step's record for the metrics file and
the log line (tokens/s, MFU against a known or measured peak, the step-time breakdown, and with expert
parallelism the expert load of each expert-parallel rank, experts.py). Kept apart from the Trainer so that
the training loop reads as training, and every observability switch (`metrics.timeline`,
`metrics.hang_dump_s`, `metrics.straggler_*`) is honoured in one place.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megascale.config import JobConfig
from megascale.observe.collectives import record_collectives
from megascale.observe.experts import ep_rank_experts, ep_rank_load_over_mean, routed_expert_share
from megascale.observe.hang import HangWatch
from megascale.observe.peak import Peak, calibrate, forget_calibration, peak_for
from megascale.observe.stragglers import StragglerDetector, describe
from megascale.observe.timeline import Timeline, session_dir

log = logging.getLogger("megascale.trainer")


@dataclass
class StepMetrics:
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    data_wait_s: float
    breakdown: dict[str, float]  # compute / exposed communication / bubble / other, from the timeline
    rank_compute_s: list[float] = field(default_factory=list)  # every rank's, from the step's all-reduce
    router: dict[str, float] = field(default_factory=dict)  # MoE routing health (parallel/step.py)
    # Expert parallelism: the slots every rank's experts computed (observe/experts.py), from the all-reduce.
    rank_expert_slots: list[float] = field(default_factory=list)


class Instruments:
    """The run's timeline, hang watch, straggler detector and MFU, for one rank. Built once the run knows
    the step it starts from (trace sessions are named by it); `close()` when the loop ends.

    `stretch(compute_s, clock)` is called after each phase of compute, with the phase's seconds on the
    timeline's compute clock (fault injection's slow rank). `ep_of_rank`: every rank's expert-parallel
    rank, with expert parallelism (else empty)."""

    def __init__(
        self,
        cfg: JobConfig,
        run_dir: Path,
        *,
        rank: int,
        coordinates: dict[str, int],
        stage_of_rank: list[int],
        ep_of_rank: list[int],
        device: torch.device,
        start_step: int,
        world_size: int,
        tokens_per_step: int,
        flops_per_token: float,
        stretch: Callable[[float, Callable[[], float]], None],
    ):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self._stretch = stretch
        traces = session_dir(run_dir, start_step) if cfg.metrics.timeline else None
        self.timeline = Timeline(traces, rank, coordinates, device=device)
        self.timeline.sync_clock(dist.barrier if dist.is_initialized() else None)
        record_collectives(self.timeline)
        self.hang_watch = None
        if traces is not None and cfg.metrics.hang_dump_s > 0:
            self.hang_watch = HangWatch(self.timeline, traces, cfg.metrics.hang_dump_s, world_size)
            self.hang_watch.start()
        self.ep_of_rank = ep_of_rank
        self.stragglers = StragglerDetector(
            stage_of_rank,
            cfg.metrics.straggler_window,
            cfg.metrics.straggler_ratio,
            expert_share=routed_expert_share(cfg.model, cfg.data.seq_len) if ep_of_rank else 0.0,
        )
        self.peak = find_peak(cfg, device) if rank == 0 else None

    @contextlib.contextmanager
    def phase(self, name: str, **args: Any) -> Iterator[None]:
        """A span of compute on the timeline; an injected slow rank stretches it."""
        with self.timeline.span(name, **args):
            clock = self.timeline.compute_clock
            started = clock()
            yield
            self._stretch(clock() - started, clock)

    def record(self, metrics: StepMetrics, step: int) -> dict[str, Any]:
        """The step's scalars for metrics.jsonl and TensorBoard; rank 0's also name the stragglers."""
        tokens_per_s = self.tokens_per_step / metrics.step_time_s
        record: dict[str, Any] = {
            "loss": metrics.loss,
            "grad_norm": metrics.grad_norm,
            "lr": metrics.lr,
            "tokens_per_s": tokens_per_s,
            "step_time_s": metrics.step_time_s,
            "data_wait_s": metrics.data_wait_s,
            **metrics.breakdown,
            **metrics.router,
        }
        if self.rank == 0 and self.ep_of_rank and metrics.rank_expert_slots:  # rank 0 speaks for the job
            record["ep_rank_load_over_mean"] = [
                round(load, 4) for load in ep_rank_load_over_mean(metrics.rank_expert_slots, self.ep_of_rank)
            ]
            record["ep_rank_experts"] = ep_rank_experts(self.cfg.model.moe.experts, self.cfg.parallel.ep)
            record["ep_rank_of_rank"] = self.ep_of_rank
            record["rank_expert_slots"] = [round(slots) for slots in metrics.rank_expert_slots]
        if metrics.rank_compute_s and self.rank == 0:
            record["rank_compute_s"] = [round(seconds, 6) for seconds in metrics.rank_compute_s]
            window = self.cfg.metrics.straggler_window
            for finding in self.stragglers.observe(metrics.rank_compute_s, metrics.rank_expert_slots):
                log.warning("%s", describe(finding, window, step))
            if self.stragglers.stragglers():
                record["stragglers"] = self.stragglers.stragglers()
        if self.peak is not None:
            # The peak is one device's (one process's cores on CPU); the job runs world_size of them.
            peak_flops = self.peak.tflops * 1e12 * self.world_size
            mfu = tokens_per_s * self.flops_per_token / peak_flops
            if mfu > 1.0:
                self._contradicted(tokens_per_s * self.flops_per_token / self.world_size / 1e12)
            else:
                record["mfu"], record["peak_source"] = mfu, self.peak.source
        return record

    def _contradicted(self, achieved_tflops: float) -> None:
        """This run computes faster than the peak it divides by: the peak is wrong, and MFU is not shown
        from here on. A measured one (cached from a busy machine, say) is dropped from the cache, so the
        next run measures it again."""
        peak, self.peak = self.peak, None
        assert peak is not None
        fix = {
            "config": "correct --training.peak_tflops",
            "table": "the device's entry in megascale/observe/peak.py is wrong",
            "measured": "measured too low, on a busy machine perhaps; the next run measures it again",
        }[peak.source]
        log.warning(
            "MFU not shown: this run computes %.3g TFLOP/s per process, above the %s peak of %.3g TFLOP/s "
            "it would divide by (%s)",
            achieved_tflops,
            peak.source,
            peak.tflops,
            fix,
        )
        if peak.source == "measured":
            forget_calibration(self.cfg.training.dtype, torch.get_num_threads())

    def close(self) -> None:
        record_collectives(None)
        if self.hang_watch is not None:
            self.hang_watch.stop()
        self.timeline.close()


def find_peak(cfg: JobConfig, device: torch.device) -> Peak | None:
    """The device's peak FLOP/s for MFU: from the table, `training.peak_tflops`, or measured once on a CPU;
    None (and a warning) for an accelerator the table does not know."""
    training = cfg.training
    threads = torch.get_num_threads()
    peak = peak_for(device, training.dtype, threads, training.peak_tflops)
    if peak is None and device.type == "cpu":
        log.info("measuring this CPU's %s matmul peak once for MFU (megascale calibrate)...", training.dtype)
        peak = Peak(calibrate(training.dtype, threads), "measured")
    if peak is None:
        log.warning("MFU not shown: %s is not in the peak table; set --training.peak_tflops", device)
    elif peak.source == "measured":
        log.info(
            "MFU is relative to this CPU's measured %s matmul peak of %.3f TFLOP/s",
            training.dtype,
            peak.tflops,
        )
    return peak


def format_record(record: dict[str, Any], step: int, steps: int) -> str:
    """The log line of a step's record."""
    parts = [f"step {step}/{steps}", f"loss {record['loss']:.4f}"]
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
