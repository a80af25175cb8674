"""The job driver (`megascale launch`): start executors, watch heartbeats, and recover from faults.

One driver per job (paper §4.1-4.3). It hosts the store (or uses Redis) and finds its executors there:
it starts one per node on this machine (`resilience.executors = "local"`), or they are started on every
host and register themselves ("external"; deploy/ has Slurm and Kubernetes examples). Then it loops:
start an attempt on the healthy nodes, watch their heartbeats, and on a fault stop every node, run the
self-check diagnostics, evict the nodes that fail (the blocklist lives in the run directory, so an
evicted node is never reused, even by a new driver), and start the next attempt, which resumes from the
newest snapshot or verified checkpoint. With `resilience.standby` the next attempt waits, built, on the
same nodes while one trains, and after a fault that leaves every node fit it takes over in about a second
(`standby_takes_over`). Every decision goes to `<run_dir>/events.jsonl` with its time. Keeping the
executors is nodes.py's; watching an attempt for faults, watch.py's; taking over the job of a killed
driver, takeover.py's. The Driver is what those two are given: each names what it needs of it (watch.py's
`Watched`, takeover.py's `Takeover`, both built on lifecycle.py's heartbeats and executor lifecycle).

torchrun (inside each executor) already restarts workers; what it lacks, and this adds, is detection
beyond process exit (missing heartbeats, hangs), diagnosis and eviction before a restart, and a record.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from megascale.checkpoint.manifest import list_checkpoints
from megascale.config import JobConfig
from megascale.errors import ConfigError
from megascale.resilience.diagnostics import slower_than_peers
from megascale.resilience.inject import INJECT
from megascale.resilience.links import blame, link_rounds
from megascale.resilience.nodes import NodeControl
from megascale.resilience.records import evict, read_blocklist
from megascale.resilience.takeover import adopt, read_record, remove_record, resume_point
from megascale.resilience.watch import AttemptWatch, Fault
from megascale.stores.control import OutageTolerantStore, StoreLost, open_store

log = logging.getLogger("megascale.driver")
HANGS_TO_EVICT = 2  # hangs a node's ranks are blamed for before the node is evicted
STANDBY_RETRY_S = 30.0  # a standby whose processes died is started again no sooner than this
# Faults after which every node is fit to train on: the warm standby takes over (docs/resilience.md).
TAKEN_OVER = {
    "process_exit",
    "rank_exit",
    "rank_stopped",
    "hang",
    "comm_flat",
    "loss_spike",
    "slow_steps",
}


class Driver(NodeControl):
    """The job's loop over attempts (`run`); its nodes' executors are NodeControl's (nodes.py)."""

    def __init__(self, cfg: JobConfig, train_args: list[str], run_dir: Path):
        super().__init__(cfg, run_dir)
        self.cfg = cfg
        self.inject = cfg.resilience.inject or os.environ.get(INJECT)
        self.train_args = train_args
        self.previous = read_record(run_dir)  # a killed driver's record: this one takes its job over
        if self.previous is not None:
            self.job = self.previous["job"]
        self.stop_requested = False
        self.attempt_started = 0.0  # time.time() of the watched attempt's start
        self.watching: AttemptWatch | None = None
        self.hang_blames: dict[str, int] = {}  # node: hangs its ranks were blamed for
        self.persist_failures: dict[str, int] = {}  # node: stage 2 failures of its executor already said
        self.standby_requested: tuple[int, float] | None = None  # (attempt, when) of the newest standby

    # -- one attempt ----------------------------------------------------------------------------------
    def start_attempt(self, nodes: list[str], attempt: int, action: str = "start") -> None:
        """Start `attempt` on `nodes` (action "standby": start it as their warm standby, which waits)."""
        nproc = self.res.nproc_per_node
        # Local executors share this machine's cores; an external one splits its own host's.
        threads = max(1, (os.cpu_count() or 1) // (nproc * len(nodes))) if self.executors else None
        # The first node serves the rendezvous, on a port its last heartbeat found free.
        first = self.heartbeat(nodes[0])
        assert first is not None  # a healthy node has a heartbeat
        endpoint = f"{first['address'] or first['host']}:{first['free_port']}"
        for node in nodes:
            self._command(
                node,
                action,
                attempt=attempt,
                nnodes=len(nodes),
                nproc_per_node=nproc,
                rdzv_endpoint=endpoint,
                rdzv_host=node == nodes[0],
                rdzv_id=f"{self.job}-{attempt}",
                train_args=self.train_args,
                threads=threads,
                # A standby outlives its executor this long, for a successor to adopt it.
                executor_grace_s=self.res.heartbeat_timeout_s + self.res.startup_timeout_s,
            )
        if action == "standby":
            self.standby_requested = (attempt, time.time())
            self.events.write("standby", attempt=attempt, nodes=nodes)
            return
        self.attempt_started = time.time()
        self.events.write("start", attempt=attempt, nodes=nodes, processes=len(nodes) * nproc)

    # -- the warm standby -----------------------------------------------------------------------------
    def keep_standby(self, nodes: list[str], attempt: int) -> None:
        """While `attempt` trains (with resilience.standby): make sure attempt + 1 waits on the same nodes
        as its warm standby; start it again if one of its processes died (at most every
        STANDBY_RETRY_S)."""
        if not self.res.standby:
            return
        standbys = [(self.heartbeat(node) or {}).get("standby") or {} for node in nodes]
        alive = [standby.get("attempt") == attempt + 1 and standby.get("alive") for standby in standbys]
        requested, when = self.standby_requested or (None, 0.0)
        if requested == attempt + 1 and (all(alive) or time.time() - when < STANDBY_RETRY_S):
            return
        self.start_attempt(nodes, attempt + 1, action="standby")

    def standby_ready(self, nodes: list[str], attempt: int) -> bool:
        """Whether every process of `attempt` waits, ready, as the nodes' warm standby."""
        nproc = self.res.nproc_per_node
        for node in nodes:
            standby = (self.heartbeat(node) or {}).get("standby")
            if not standby or standby["attempt"] != attempt or not standby["alive"]:
                return False
            if len(standby["ready"]) < nproc:
                return False
        return True

    def standby_takes_over(self, fault: Fault, nodes: list[str], attempt: int) -> str:
        """After a fault the standby can cure (every node's executor alive, the standby of attempt + 1
        ready): stop the attempt and self-check every node (one `recover` command each), then, if every
        node passed, let the standby take over. Returns "taken over"; "evicted" when a node failed its
        self-check (stopped, checked and evicted: the restart that follows is a full one, on the healthy
        nodes); "unavailable", having done nothing, when the fault or the standby rules it out."""
        if fault.kind not in TAKEN_OVER or not self.standby_ready(nodes, attempt + 1):
            return "unavailable"
        if any(self.executor_gone(node) for node in nodes):
            return "unavailable"
        if self.res.diagnose:
            failed = self.diagnose(nodes, attempt, action="recover")
        else:
            self.stop_nodes(nodes)
            failed = []
        self.events.write("stopped", attempt=attempt, nodes=nodes)
        self.wait_for_snapshots(nodes)  # a save the fault cut off is abandoned, not waited for
        for node in failed:
            evict(self.run_dir, node)
            self.events.write("evict", node=node)
        if failed:
            self.replenish()
            return "evicted"
        checkpoint_step = self._newest_committed_step()
        self.events.write("restart", attempt=attempt + 1, checkpoint_step=checkpoint_step, standby=True)
        for node in nodes:
            self._command(node, "activate", attempt=attempt + 1)
        self.attempt_started = time.time()
        processes = len(nodes) * self.res.nproc_per_node
        self.events.write("start", attempt=attempt + 1, nodes=nodes, processes=processes, standby=True)
        return "taken over"

    def watch(self, nodes: list[str], attempt: int, recovered: bool = True) -> Fault | None:
        """Until the attempt ends: None when every node finished cleanly, else the first fault seen."""
        self.watching = AttemptWatch(self, nodes, attempt, recovered)
        return self.watching.run()

    def diagnose(self, nodes: list[str], attempt: int, action: str = "diagnose") -> list[str]:
        """Run the self-check on `nodes`; returns those that failed it, never answered, or were markedly
        slower than the others. `recover`: the nodes stop their attempt first and keep their standby,
        and only the node's own checks run (no communication check: it starts processes)."""
        res = self.res
        seq_before = self.seq
        bandwidth = res.diagnose_bandwidth and action == "diagnose"
        # Rates say which node is slow only against a figure or among nodes with a machine each.
        compared = res.expected_gflops is not None or self._own_hosts(nodes)
        for node in nodes:
            self._command(
                node,
                action,
                attempt=attempt,
                inject=self.inject,
                nproc_per_node=res.nproc_per_node,
                bandwidth=bandwidth,
                expected_gflops=res.expected_gflops,
                expected_alltoall_gbps=res.expected_alltoall_gbps,
                min_speed_ratio=res.min_speed_ratio,
                timing_s=0.3 if compared else 0.0,
            )
        results = self._answers(nodes, "diag", seq_before)
        passed = {node: result for node, result in results.items() if result["passed"]}
        if self._own_hosts(list(passed)):
            for node, slow in slower_than_peers(passed, res.min_speed_ratio).items():
                results[node] = {**results[node], "passed": False, "reason": slow}
        healthy = [node for node in nodes if node in results and results[node]["passed"]]
        if bandwidth and len(healthy) >= 2:
            for node, (reason, links) in self.check_links(healthy, attempt).items():
                checks = {**results[node]["checks"], "links": links}
                results[node] = {**results[node], "checks": checks}
                if reason:
                    results[node].update(passed=False, reason=reason)
        failed = []
        for node in nodes:
            if node not in results:
                self.events.write("diagnosis", node=node, passed=False, reason="no answer")
                failed.append(node)
                continue
            result = results[node]
            self.events.write(
                "diagnosis",
                node=node,
                passed=result["passed"],
                reason=result["reason"],
                checks=result["checks"],
            )
            if not result["passed"]:
                failed.append(node)
        return failed

    def check_links(self, nodes: list[str], attempt: int) -> dict[str, tuple[str | None, dict]]:
        """The all-reduce between neighbouring nodes: {node: (why it is to blame or None, its links)}."""
        res = self.res
        seq_before, rounds = self.seq, link_rounds(nodes)
        addresses = {
            node: self.registered[node].get("address") or self.registered[node]["host"] for node in nodes
        }
        for node in nodes:
            self._command(
                node,
                "link_check",
                attempt=attempt,
                inject=self.inject,
                rounds=rounds,
                addresses=addresses,
                check=seq_before,  # the same for every node: names this check's keys in the store
            )
        results = self._answers(nodes, "links", seq_before)
        reports = {node: results[node]["links"] if node in results else {} for node in nodes}
        blamed, bad_links = blame(reports, res.expected_allreduce_gbps, res.min_speed_ratio)
        for first, second, why in bad_links:
            self.events.write(
                "bad_link", nodes=[first, second], reason=why, blamed=sorted(set(blamed) & {first, second})
            )
        silent = {
            node: "no answer to the all-reduce with its neighbours" for node in nodes if node not in results
        }
        return {node: (silent.get(node) or blamed.get(node), reports[node]) for node in nodes}

    # -- the job --------------------------------------------------------------------------------------
    def run(self) -> int:
        url = self.previous["store"] if self.previous else self.res.store  # where the executors look
        self.store = OutageTolerantStore(
            open_store(url, job=self.job, host=True), self.res.store_grace_s, self._reseed
        )
        if self.previous is None and self.store.fetch("driver") is not None:  # Redis keeps a job's keys
            raise ConfigError(
                f"resilience.job_id = {self.job!r} was used by an earlier driver on {self.res.store}; "
                "give this run a new id"
            )
        self.store.put("driver", {"job": self.job, "time": time.time()})  # executors check they joined us
        self.events.write(
            "driver",
            job=self.job,
            store=self.store.url,
            nodes=self.res.nodes,
            nproc_per_node=self.res.nproc_per_node,
            spares=self.res.spares,
        )
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.write_record()
        if self.previous is not None:
            adopt(self, self.previous)
        elif self.res.executors == "local":
            self.start_executors()
        store_lost = None
        try:
            return self._loop()
        except StoreLost as err:
            store_lost = err
            step = self.verified_checkpoint_step()
            self.events.write(
                "give_up",
                reason=f"{err}; resumable from the checkpoint of step {step}: run `megascale launch` again "
                f"with training.run_dir = {self.run_dir}",
            )
            return 1
        finally:
            if store_lost is None:
                self.discover(record=False)
                for node in self.registered:
                    self._command(node, "exit")
                self._wait_until_left(list(self.registered))
            else:  # no command reaches them: ours stop their nodes on SIGTERM; the others on their own
                for proc in self.executors.values():
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGTERM)
            for proc in self.executors.values():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            remove_record(self.run_dir)

    def _loop(self) -> int:
        if self.previous is not None:
            point = resume_point(self)
            attempt, nodes, running = point.attempt, point.nodes, point.started is not None
            self.attempt_started = point.started or 0.0
        else:
            attempt, nodes, running = 0, self.wait_for_nodes()[: self.res.nodes], False
        recovered = running or attempt == 0  # False: a restart whose first step is still to come
        while True:
            if not running:
                if not self._layout_fits(len(nodes)):
                    self.events.write(
                        "give_up", reason=f"{len(nodes)} healthy nodes cannot run the job's layout"
                    )
                    return 1
                self.start_attempt(nodes, attempt)
            fault = self.watch(nodes, attempt, recovered=recovered)
            running = False
            if self.stop_requested:
                self.stop_nodes(nodes, "terminate")
                self.wait_for_snapshots(nodes)
                self.events.write("stopped", attempt=attempt, reason="signal")
                return 0
            if fault is None:
                self.wait_for_snapshots(nodes)
                self.events.write("done", attempt=attempt)
                return 0
            self.events.write(
                "fault",
                attempt=attempt,
                kind=fault.kind,
                node=fault.node,
                detail=fault.detail,
                last_step=fault.last_progress_step,
                **fault.extra,
            )
            named = self._blame(fault)
            if named is not None:
                self.events.write("blame", attempt=attempt, **named)
            if fault.kind == "input_error":
                self.stop_nodes(nodes)
                self.wait_for_snapshots(nodes)
                self.events.write("give_up", reason=f"an error in the job's input: {fault.detail}")
                return 2
            blamed_out = self._count_blame(named)
            outcome = "unavailable"
            if attempt < self.res.max_restarts and blamed_out is None:
                outcome = self.standby_takes_over(fault, nodes, attempt)
            if outcome == "taken over":
                attempt, running, recovered = attempt + 1, True, False
                continue
            if outcome == "unavailable":
                self._stop_and_evict(fault, nodes, attempt, blamed_out)
            if attempt >= self.res.max_restarts:
                self.events.write(
                    "give_up", reason=f"resilience.max_restarts = {self.res.max_restarts} reached"
                )
                return 1
            attempt, recovered = attempt + 1, False
            nodes = self.healthy_nodes()[: self.res.nodes]
            # The newest checkpoint in storage; the ranks may resume from a newer snapshot still in their
            # nodes' memory (`recovered` says where they did).
            self.events.write("restart", attempt=attempt, checkpoint_step=self.verified_checkpoint_step())

    def _blame(self, fault: Fault) -> dict[str, Any] | None:
        """Who a fault that passes every self-check is put on: after a hang, the ranks it waits for (the
        hang view); a stopped rank, itself."""
        if fault.kind in ("hang", "comm_flat") and self.watching is not None:
            return self.watching.blame()
        if fault.kind == "rank_stopped" and fault.node is not None:
            ranks = fault.extra["ranks"]
            reasons = {str(rank): "its process is stopped" for rank in ranks}
            return {"suspect_ranks": ranks, "reasons": reasons, "nodes": [fault.node]}
        return None

    def _count_blame(self, named: dict[str, Any] | None) -> str | None:
        """The node to evict for this blame: one whose ranks were blamed alone HANGS_TO_EVICT times (a rank
        that stops, or hangs, again and again passes every self-check, yet is as bad as a failing one)."""
        if named is None or len(named["nodes"]) != 1:
            return None
        (node,) = named["nodes"]
        self.hang_blames[node] = self.hang_blames.get(node, 0) + 1
        if self.hang_blames[node] >= HANGS_TO_EVICT and node not in read_blocklist(self.run_dir):
            return node
        return None

    def _stop_and_evict(self, fault: Fault, nodes: list[str], attempt: int, blamed_out: str | None) -> None:
        """After a fault: fence dead executors' processes (restarting our executors), stop the other nodes
        keeping their snapshots, and evict what is to blame: a straggler, a node whose executor is gone, a
        node failing its self-check, a node blamed for HANGS_TO_EVICT hangs (`blamed_out`)."""
        gone = [node for node in nodes if self.executor_gone(node)]
        for node in gone:  # nothing of theirs may keep running; ours are started again
            self.fence(node)
            if node in self.executors:
                self.replace_executor(node)
        live = [node for node in nodes if not self.executor_gone(node)]
        self.stop_nodes(live)
        self.wait_for_snapshots(live)  # the snapshot taken before the fault, if any, is kept
        self.events.write("stopped", attempt=attempt, nodes=nodes)
        if fault.kind == "straggler" and fault.node is not None:
            evict(self.run_dir, fault.node)
            self.events.write("evict", node=fault.node, reason="straggler")
        for node in sorted(set(nodes) - set(live)):  # no executor to answer a self-check: failed at once
            self.events.write("diagnosis", node=node, passed=False, reason="executor gone")
            evict(self.run_dir, node)
            self.events.write("evict", node=node)
        if self.res.diagnose:
            for node in self.diagnose(live, attempt):
                evict(self.run_dir, node)
                self.events.write("evict", node=node)
        if blamed_out is not None and blamed_out not in read_blocklist(self.run_dir):
            evict(self.run_dir, blamed_out)
            self.events.write("evict", node=blamed_out, reason=f"blamed for {HANGS_TO_EVICT} hangs")
        self.replenish()

    def _newest_committed_step(self) -> int:
        """The step of the newest committed checkpoint, not read back (the standby's restart does not read
        storage, so neither does its event)."""
        checkpoints = list_checkpoints(self._checkpoint_root())
        return checkpoints[-1][0] if checkpoints else 0

    def _checkpoint_root(self) -> str:
        return self.cfg.checkpoint.location or str(Path(self.cfg.training.run_dir) / "checkpoints")

    def verified_checkpoint_step(self) -> int:
        """The step of the newest checkpoint that verifies: what the trainer will resume from (0: none)."""
        from megascale.checkpoint.checkpointer import Checkpointer, read_manifest

        newest = Checkpointer(self._checkpoint_root(), keep=1).latest_verified()
        return read_manifest(newest)["step"] if newest else 0

    def _layout_fits(self, nodes: int) -> bool:
        from megascale.parallel.dims import ParallelDims

        if nodes == 0:
            return False
        try:
            ParallelDims.from_config(self.cfg, world_size=nodes * self.res.nproc_per_node)
        except ConfigError as err:
            log.error("%s", err)
            return False
        return True

    def _request_stop(self, signum: int, frame: Any) -> None:
        self.stop_requested = True
