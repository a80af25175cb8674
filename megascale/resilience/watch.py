"""Watching one attempt of a job: every heartbeat interval the nodes' heartbeats are read, the detectors
applied, and the first fault named (paper §4.2); after a hang, the ranks it waits for are named too.

The driver (driver.py) decides what to do about a fault; this module only finds it. `AttemptWatch` holds
what one attempt's watch accumulates: the detectors' histories, the newest step and when it came, the
first failure seen while failures are gathered, the stragglers and the progress line already said. What
it needs of the driver is `Watched`: the nodes' heartbeats, their executors' lifecycle (a dead executor
is replaced, the warm standby kept), and a few things of the job.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from megascale.config import JobConfig
from megascale.observe.events import EventLog
from megascale.observe.hang import HANG, analyze, read_dumps
from megascale.observe.trace import sessions
from megascale.resilience.detectors import FlatCounter, LossSpike, StepTimeCollapse, nonfinite_steps
from megascale.resilience.lifecycle import ExecutorLifecycle, Heartbeats

log = logging.getLogger("megascale.driver")
BLAME_WAIT_S = 10.0  # the longest a hang's restart waits for the ranks' stall states
# What a run sends its own processes: torchrun's stop, the NCCL watchdog's abort, a user's Ctrl-C. Any
# other signal (SIGKILL from the OOM killer or an operator, SIGSEGV, SIGBUS) is where a fault began.
SECONDARY_SIGNALS = {"SIGTERM", "SIGABRT", "SIGINT"}


class Watched(Heartbeats, ExecutorLifecycle, Protocol):
    """What watching an attempt needs of the driver (driver.py's Driver), besides the heartbeats and the
    executors: the job's config and events log, whether it was asked to stop, when the watched attempt
    started, the stage 2 failures already said (per node, across attempts), and the healthy nodes (is a
    spare free for a straggler's node?)."""

    cfg: JobConfig
    events: EventLog
    stop_requested: bool
    attempt_started: float
    persist_failures: dict[str, int]

    def healthy_nodes(self) -> list[str]: ...


@dataclass
class Fault:
    # process_exit | rank_exit | rank_stopped | input_error | heartbeat_lost | hang |
    # comm_flat | loss_spike | slow_steps | straggler
    kind: str
    node: str | None
    detail: str
    last_progress_step: int
    extra: dict[str, Any] = field(default_factory=dict)


def behind(reports: dict[str, dict[str, Any]]) -> list[int]:
    """The ranks at the lowest step, when not all of them are: the suspects of a hang."""
    if not reports:
        return []
    low = min(report["step"] for report in reports.values())
    suspects = sorted(int(rank) for rank, report in reports.items() if report["step"] == low)
    return suspects if len(suspects) < len(reports) else []


def killed_by_signal(beat: dict[str, Any]) -> bool:
    """Whether a primary signal ended a rank on this node (the heartbeat's `signalled`: agent.py's record)."""
    return any(name not in SECONDARY_SIGNALS for name in beat.get("signalled", {}).values())


def first_failed(failed: dict[str, dict[str, Any]]) -> str:
    """The node a fault most likely began on, of those whose torchrun failed: one with a rank killed by
    a signal (its peers elsewhere only lost a connection), else the first whose executor saw it exit."""
    return min(
        failed,
        key=lambda node: (
            not killed_by_signal(failed[node]),
            failed[node].get("exited_at") or failed[node]["time"],
        ),
    )


def process_exit(failed: dict[str, dict[str, Any]], last_step: int) -> Fault:
    """The fault of the nodes whose torchrun failed, put on the node it most likely began on."""
    node = first_failed(failed)
    beat = failed[node]
    return Fault(
        "process_exit",
        node,
        f"torchrun exited with status {beat['exit_code']}",
        last_step,
        {
            "errors": beat.get("errors", [])[-5:],
            "signalled_ranks": {
                rank: name for each in failed.values() for rank, name in each.get("signalled", {}).items()
            },
            "also_failed": sorted(set(failed) - {node}),
            # nodes a signal struck too: faults of their own, not their peers' losses
            "also_struck": sorted(
                other for other in failed if other != node and killed_by_signal(failed[other])
            ),
        },
    )


class AttemptWatch:
    """The watch over attempt `attempt` on `nodes`; `run()` returns its first fault, or None once every
    node finished cleanly (or the driver was asked to stop). `recovered=False`: a restart whose first
    step is still to come (the `recovered` event)."""

    def __init__(self, driver: Watched, nodes: list[str], attempt: int, recovered: bool = True):
        self.driver, self.res, self.events = driver, driver.cfg.resilience, driver.events
        self.nodes, self.attempt, self.recovered = nodes, attempt, recovered
        self.started = time.time()
        self.last_step, self.last_change = -1, self.started  # the newest step, and when it came
        self.loss_spike = LossSpike(self.res.loss_spike_z, self.res.anomaly_window)
        self.slow_steps = StepTimeCollapse(self.res.step_time_factor, self.res.anomaly_window)
        self.traffic = FlatCounter()
        self.reported_nonfinite: set[int] = set()
        self.stragglers: set[int] = set()  # ranks already reported
        self.said_step = -1  # of the last progress line
        self.first_failure_seen: float | None = None
        self.lost: dict[int, str] = {}  # rank: node, of ranks whose process ended, in the order seen
        self.first_lost_seen: float | None = None

    def run(self) -> Fault | None:
        while True:
            time.sleep(self.res.heartbeat_interval_s)
            if self.driver.stop_requested:
                return None
            outcome = self.poll(time.time())
            if outcome is not None:
                return outcome if isinstance(outcome, Fault) else None

    def poll(self, now: float) -> Fault | bool | None:
        """One reading of the heartbeats: a Fault, True once every node finished cleanly, else None."""
        driver = self.driver
        for node in list(filter(driver.executor_exited, self.nodes)):
            # Started again, the node's executor adopts its processes (executor.py): the attempt trains on,
            # and a node whose processes died with the executor reports the attempt failed.
            driver.replace_executor(node)
        beats = {node: driver.heartbeat(node) for node in self.nodes}
        current = {node: beat for node, beat in beats.items() if beat and beat.get("attempt") == self.attempt}
        self._say_persist_failures(beats)
        for node, beat in beats.items():
            age = driver.heartbeat_age(beat, now) if beat else now - max(self.started, driver.outage_ended_at)
            if age > self.res.heartbeat_timeout_s:
                return Fault("heartbeat_lost", node, f"no heartbeat for {age:.1f} s", self.last_step)
        failed = {
            node: beat
            for node, beat in current.items()
            if beat["state"] == "exited" and beat["exit_code"] != 0
        }
        fault = self._input_error(current) or self._lost_or_stopped(now, current)
        if fault is not None:
            return fault
        if self.lost:  # gathering
            return None
        if failed:
            return self._failure(now, failed)
        if len(current) == len(self.nodes) and all(beat["state"] == "exited" for beat in current.values()):
            return True
        return self._progress(now, current)

    def _input_error(self, beats: dict[str, dict[str, Any]]) -> Fault | None:
        """An error in the job's input that a rank reported before it exits: a restart would meet it again,
        so no gathering, no diagnosis, no retry."""
        for node, beat in beats.items():
            if errors := beat.get("input_errors"):
                detail = f"rank {errors[0]['rank']}: {errors[0]['message']}"
                return Fault("input_error", node, detail, self.last_step)
        return None

    def _lost_or_stopped(self, now: float, beats: dict[str, dict[str, Any]]) -> Fault | None:
        """A rank whose process ended, or stopped for resilience.stopped_timeout_s without a step, while
        its node's torchrun still runs (the executor reads it from /proc). Ended ranks are gathered for
        one heartbeat interval, so that ranks struck at once on several nodes are all on record; the
        fault is put on the node where one was seen first."""
        for node, beat in beats.items():
            for rank in beat.get("lost_ranks", []):
                self.lost.setdefault(rank, node)
        if self.lost:
            self.first_lost_seen = self.first_lost_seen or now
            if now - self.first_lost_seen >= self.res.heartbeat_interval_s:
                ranks = sorted(self.lost)
                detail = f"rank {', '.join(map(str, ranks))} ended while its torchrun ran"
                extra = {"ranks": ranks, "nodes": {str(rank): node for rank, node in self.lost.items()}}
                return Fault("rank_exit", next(iter(self.lost.values())), detail, self.last_step, extra)
        timeout_s = self.res.stopped_timeout_s
        for node, beat in beats.items() if timeout_s > 0 else ():
            stopped = beat.get("stopped_ranks", {})
            if ranks := sorted(int(rank) for rank, seconds in stopped.items() if timeout_s <= seconds):
                seconds = max(stopped[str(rank)] for rank in ranks)
                detail = f"rank {', '.join(map(str, ranks))} stopped for {seconds:.1f} s without a step"
                return Fault("rank_stopped", node, detail, self.last_step, {"ranks": ranks})
        return None

    def _failure(self, now: float, failed: dict[str, dict[str, Any]]) -> Fault | None:
        # One dead rank brings down its peers on every node within a second or so, and a peer's node may
        # report first; a second fault may strike another node meanwhile. So the failures are gathered for
        # two heartbeats (three while no node shows a rank a signal struck) before the fault is named: the
        # node a signal struck, else the first to exit.
        self.first_failure_seen = self.first_failure_seen or now
        struck = killed_by_signal(failed[first_failed(failed)])
        if now - self.first_failure_seen >= (2 if struck else 3) * self.res.heartbeat_interval_s:
            return process_exit(failed, self.last_step)
        return None

    def _progress(self, now: float, current: dict[str, dict[str, Any]]) -> Fault | None:
        """The steps the ranks reported: progress lines, non-finite steps, anomalies, and no progress."""
        reports = {rank: report for beat in current.values() for rank, report in beat["progress"].items()}
        steps = [report["step"] for report in reports.values()]
        for bad_step, ranks in nonfinite_steps(reports, len(self.nodes) * self.res.nproc_per_node).items():
            if bad_step not in self.reported_nonfinite:
                self.reported_nonfinite.add(bad_step)
                self.events.write(
                    "nonfinite", attempt=self.attempt, step=bad_step, ranks=ranks, policy=self.res.nan_policy
                )
        silent_s = self.traffic.observe(now, sum(beat.get("io_bytes", 0) for beat in current.values()))
        if steps:
            self._say_progress(reports)
        if self.last_step >= 0:
            self.driver.keep_standby(self.nodes, self.attempt)
        if steps and max(steps) != self.last_step:
            self.last_step, self.last_change = max(steps), now
            if not self.recovered:  # the first step of a restarted attempt (reports are per attempt)
                self.recovered = True
                resumed_from = min(report.get("resumed_from", 0) for report in reports.values())
                self.events.write(
                    "recovered", attempt=self.attempt, first_step=self.last_step, resumed_from=resumed_from
                )
            fault = self._anomalies(self.last_step, current)
            if fault is not None:
                return fault
        self.last_change = max(self.last_change, self.driver.outage_ended_at)  # nothing read in an outage
        return self._stalled(now, silent_s, reports)

    def _stalled(self, now: float, silent_s: float, reports: dict[str, dict[str, Any]]) -> Fault | None:
        res, idle_s = self.res, now - self.last_change
        suspects = {"suspect_ranks": behind(reports)}
        if self.last_step >= 0 and 0 < res.comm_flat_timeout_s < min(idle_s, silent_s):
            detail = f"no step completed and no byte moved for {silent_s:.1f} s"
            return Fault("comm_flat", None, detail, self.last_step, suspects)
        if idle_s > (res.hang_timeout_s if self.last_step >= 0 else res.startup_timeout_s):
            return Fault("hang", None, f"no step completed for {idle_s:.1f} s", self.last_step, suspects)
        return None

    def _anomalies(self, step: int, beats: dict[str, dict[str, Any]]) -> Fault | None:
        """Feed the newest step's loss (mean over ranks) and time (slowest rank) to the detectors; log
        what they find, and make it a fault when `resilience.anomaly_action = "restart"`. Stragglers named
        by the training processes (observe/stragglers.py) are logged with their node, and are a fault
        (their node to be evicted) with `resilience.evict_stragglers` when a spare node is free."""
        reports = {rank: report for beat in beats.values() for rank, report in beat["progress"].items()}
        at_step = [report for report in reports.values() if report["step"] == step]
        losses = [report["loss"] for report in at_step if isinstance(report.get("loss"), float)]
        times = [report["step_time_s"] for report in at_step if "step_time_s" in report]
        for rank in sorted({rank for report in at_step for rank in report.get("stragglers", [])}):
            if rank not in self.stragglers:
                self.stragglers.add(rank)
                node = next((name for name, beat in beats.items() if str(rank) in beat["progress"]), None)
                self.events.write("straggler", attempt=self.attempt, step=step, rank=rank, node=node)
                spare = len(self.driver.healthy_nodes()) > len(beats)
                if self.res.evict_stragglers and node is not None and spare:
                    return Fault("straggler", node, f"rank {rank} is a straggler", step, {"rank": rank})
        findings = []
        if losses and all(map(math.isfinite, losses)):
            findings.append(("loss_spike", self.loss_spike.observe(step, sum(losses) / len(losses))))
        if times:
            findings.append(("slow_steps", self.slow_steps.observe(step, max(times))))
        for kind, finding in findings:
            if finding is None:
                continue
            self.events.write(kind, attempt=self.attempt, action=self.res.anomaly_action, **finding)
            if self.res.anomaly_action == "restart":
                return Fault(kind, None, f"{kind.replace('_', ' ')} at step {step}", step, finding)
        return None

    def _say_persist_failures(self, beats: dict[str, dict[str, Any] | None]) -> None:
        """A checkpoint that stage 2 could not write (a full disk, a lost bucket) is abandoned and training
        goes on; the operator hears of it here, once per failure, not only in the executor's log."""
        said = self.driver.persist_failures
        for node, beat in beats.items():
            failures = beat.get("persist_failures", 0) if beat else 0
            if beat and failures > said.get(node, 0):
                said[node] = failures
                self.events.write("persist_failed", node=node, error=beat["persist_error"])

    def _say_progress(self, reports: dict[str, dict[str, Any]]) -> None:
        """A console and driver.log line for the newest step every rank reported, each training.log_every
        steps and at the last: the job's pace, seen from the driver."""
        every, steps = self.driver.cfg.training.log_every, self.driver.cfg.training.steps
        step = min(report["step"] for report in reports.values())
        if step // every <= self.said_step // every and not (step == steps != self.said_step):
            return
        self.said_step = step
        at_step = [report for report in reports.values() if report["step"] == step]
        losses = [report["loss"] for report in at_step if isinstance(report.get("loss"), float)]
        seconds = max((report.get("step_time_s", 0.0) for report in at_step), default=0.0)
        loss = f" | loss {sum(losses) / len(losses):.4f}" if losses else ""
        log.info("attempt %d | step %d/%d%s | %.3f s/step", self.attempt, step, steps, loss, seconds)

    def blame(self) -> dict[str, Any] | None:
        """After a hang: the ranks it waits for and their nodes, from the state every rank writes when it
        stalls (the hang view, observe/hang.py): read once every rank wrote it, or metrics.hang_dump_s
        after the last step (a stopped rank writes nothing, and that names it), waiting BLAME_WAIT_S at
        most."""
        cfg, driver = self.driver.cfg, self.driver
        stall_s = cfg.metrics.hang_dump_s
        if stall_s <= 0 or not cfg.metrics.timeline:
            return None
        world = len(self.nodes) * self.res.nproc_per_node
        deadline = min(
            self.last_change + stall_s + 3 * self.res.heartbeat_interval_s + 1.0, time.time() + BLAME_WAIT_S
        )
        while True:
            found = [
                session / HANG
                for session in sessions(Path(cfg.training.run_dir))
                if (session / HANG).is_dir()
            ]
            dumps = {
                rank: dump
                for rank, dump in (read_dumps(found[-1]) if found else {}).items()
                if dump["time"] >= driver.attempt_started  # not a previous attempt's, from the same step
            }
            if len(dumps) >= world or time.time() > deadline:
                break
            time.sleep(self.res.heartbeat_interval_s)
        if not dumps:
            return None
        analysis = analyze(dumps)
        node_of = {
            int(rank): node
            for node in self.nodes
            if (beat := driver.heartbeat(node))
            for rank in beat.get("progress", {})
        }
        return {
            "suspect_ranks": analysis["suspects"],
            "reasons": {str(rank): why for rank, why in analysis["reasons"].items()},
            "nodes": sorted({node_of[rank] for rank in analysis["suspects"] if rank in node_of}),
        }
