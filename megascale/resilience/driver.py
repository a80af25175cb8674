"""The job driver (`megascale launch`): start executors, watch heartbeats, and recover from faults.

One driver per job (paper §4.1-4.3). It hosts the store (or uses Redis) and finds its executors there:
it starts one per node on this machine (`resilience.executors = "local"`), or they are started on every
host and register themselves ("external"; deploy/ has Slurm and Kubernetes examples). Then it loops:
start an attempt on the healthy nodes, watch their heartbeats, and on a fault stop every node, run the
self-check diagnostics, evict the nodes that fail (the blocklist lives in the run directory, so an
evicted node is never reused, even by a new driver), and start the next attempt, which resumes from the
newest verified checkpoint. Every decision goes to `<run_dir>/events.jsonl` with its time. Watching an
attempt for faults is watch.py's; taking over the job of a killed driver, takeover.py's.

torchrun (inside each executor) already restarts workers; what it lacks, and this adds, is detection
beyond process exit (missing heartbeats, hangs), diagnosis and eviction before a restart, and a record.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from megascale.checkpoint.persist import abandon
from megascale.checkpoint.staging import is_alive, process_identity
from megascale.config import JobConfig
from megascale.errors import ConfigError
from megascale.host import local_address
from megascale.observe.events import EventLog
from megascale.resilience.diagnostics import slower_than_peers
from megascale.resilience.executor import executor_command
from megascale.resilience.inject import INJECT, active_faults, corrupt_checkpoint
from megascale.resilience.links import blame, link_rounds
from megascale.resilience.records import evict, read_blocklist
from megascale.resilience.takeover import (
    AdoptedProcess,
    adopt,
    read_record,
    remove_record,
    resume_point,
    write_record,
)
from megascale.resilience.watch import AttemptWatch, Fault
from megascale.stores.control import ControlStore, OutageTolerantStore, StoreLost, open_store

log = logging.getLogger("megascale.driver")
HANGS_TO_EVICT = 2  # hangs a node's ranks are blamed for before the node is evicted


def _address_key(info: dict[str, Any]) -> str:
    """What torchrun's c10d rendezvous numbers the nodes by: their address as a string."""
    return info.get("address") or info.get("host") or ""


class Driver:
    def __init__(self, cfg: JobConfig, train_args: list[str], run_dir: Path):
        self.cfg = cfg
        self.res = cfg.resilience
        self.inject = cfg.resilience.inject or os.environ.get(INJECT)
        self.train_args = train_args
        self.run_dir = run_dir
        self.job = cfg.resilience.job_id or uuid.uuid4().hex[:8]
        self.events = EventLog(run_dir)
        self.store: OutageTolerantStore  # opened by run() (tests put a fake in)
        # The executors this driver started (local), or adopted from a killed driver that started them.
        self.executors: dict[str, subprocess.Popen | AdoptedProcess] = {}
        self.registered: dict[str, dict[str, Any]] = {}  # every executor that joined, by node name
        self.tickets_read = 0
        self.tickets: list[dict[str, Any]] = []  # every registration read, by ticket (to re-seed a store)
        self.commands: dict[str, dict[str, Any]] = {}  # the last command sent to each node (likewise)
        # Commands are numbered from the clock, so a driver taking the job over numbers its commands after
        # those its executors have already seen.
        self.seq = time.time_ns() // 1000
        self.previous = read_record(run_dir)  # a killed driver's record: this one takes its job over
        if self.previous is not None:
            self.job = self.previous["job"]
        self.stop_requested = False
        self.attempt_started = 0.0  # time.time() of the watched attempt's start
        self.watching: AttemptWatch | None = None
        self.hang_blames: dict[str, int] = {}  # node: hangs its ranks were blamed for
        self.persist_failures: dict[str, int] = {}  # node: stage 2 failures of its executor already said

    # -- executors ------------------------------------------------------------------------------------
    def _command(self, node: str, action: str, **fields: Any) -> None:
        self.seq += 1
        self.commands[node] = {"seq": self.seq, "action": action, **fields}
        self.store.put(f"cmd/{node}", self.commands[node])

    def _beat(self, node: str) -> dict[str, Any] | None:
        return self.store.fetch(f"hb/{node}")

    def start_executors(self) -> None:
        for index in range(self.res.nodes + self.res.spares):
            if f"node-{index}" not in read_blocklist(self.run_dir):
                self._start_executor(index)

    def _start_executor(self, index: int) -> None:
        node = f"node-{index}"
        command = executor_command(
            self.store.url, self.job, node, self.run_dir, self.res.heartbeat_interval_s, local_address(index)
        )
        command += ["--store-grace", str(self.res.store_grace_s)]
        self.executors[node] = subprocess.Popen(command, start_new_session=True)  # type: ignore[assignment]
        self._write_record()

    def _write_record(self) -> None:
        executors = {node: process_identity(proc.pid) for node, proc in self.executors.items()}
        write_record(self.run_dir, self.job, self.store.url, executors)

    def executor_exited(self, node: str) -> bool:
        """Whether `node`'s executor is one this driver started, and it has exited."""
        proc = self.executors.get(node)
        return proc is not None and proc.poll() is not None

    def executor_gone(self, node: str) -> bool:
        """Whether `node`'s executor is dead: it exited, or its heartbeat is older than
        resilience.heartbeat_timeout_s (an executor on another host; one busy with a self-check beats not)."""
        if self.executor_exited(node):
            return True
        beat = self._beat(node)
        return beat is None or self._beat_age(beat) > self.res.heartbeat_timeout_s

    def fence(self, node: str) -> None:
        """Kill what a dead executor left running on this host: its torchrun's session and each worker's,
        which would otherwise live on as orphans in a collective, holding the node's memory. Processes on
        another host are out of reach from here; the survivors' collectives time out without them."""
        beat = self._beat(node)
        if not beat or beat.get("host") != socket.gethostname():
            return
        killed = []
        for identity in beat.get("sessions", []):
            if not is_alive(identity):
                continue
            try:
                os.killpg(identity["pid"], signal.SIGKILL)  # torchrun and its workers lead sessions
            except ProcessLookupError:
                os.kill(identity["pid"], signal.SIGKILL)
            killed.append(identity["pid"])
        self.events.write("fenced", node=node, killed=killed)

    def replace_executor(self, node: str) -> None:
        """Start `node`'s executor again (one this driver started) and wait for its first heartbeat: it
        adopts the node's staging directory and persists the snapshots the dead one had not."""
        old = self.executors.pop(node)
        if old.poll() is None:  # its heartbeat stopped, but it lives: hung
            with contextlib.suppress(ProcessLookupError):
                os.killpg(old.pid, signal.SIGKILL)
        old.wait()
        started = time.time()
        self._start_executor(int(node.rsplit("-", 1)[1]))
        deadline = started + self.res.startup_timeout_s
        while time.time() < deadline:
            self.discover()
            beat = self._beat(node)
            if beat is not None and beat["time"] > started:
                break
            time.sleep(min(0.2, self.res.heartbeat_interval_s))
        self.events.write("executor_replaced", node=node, exit_code=old.returncode)

    def discover(self) -> None:
        """Read the registrations of executors that joined since the last call."""
        joined = self.store.add("registered", 0)
        while self.tickets_read < joined:
            info = self.store.fetch(f"node/{self.tickets_read}")
            if info is None:  # the ticket is taken, the name not yet written
                return
            if info["node"] not in self.registered:
                self.events.write("joined", **info)
            self.registered[info["node"]] = info
            self.tickets.append(info)
            self.tickets_read += 1

    def healthy_nodes(self) -> list[str]:
        """Nodes not blocked whose executor is alive, in the order torchrun numbers them (by address)."""
        self.discover()
        blocked, now = set(read_blocklist(self.run_dir)), time.time()
        healthy = []
        for node, info in self.registered.items():
            beat = self._beat(node)
            alive = beat is not None and self._beat_age(beat, now) < self.res.heartbeat_timeout_s
            if node in self.executors:
                alive = alive and self.executors[node].poll() is None
            if alive and node not in blocked:
                healthy.append((_address_key(info), node))
        return [node for _, node in sorted(healthy)]

    def wait_for_nodes(self) -> list[str]:
        """The healthy nodes, once every local executor (or, external, resilience.nodes of them) is up."""
        wanted = len(self.executors) if self.executors else self.res.nodes
        deadline = time.time() + self.res.startup_timeout_s
        while len(nodes := self.healthy_nodes()) < wanted and time.time() < deadline:
            time.sleep(min(0.2, self.res.heartbeat_interval_s))
        return nodes

    # -- one attempt ----------------------------------------------------------------------------------
    def start_attempt(self, nodes: list[str], attempt: int) -> None:
        nproc = self.res.nproc_per_node
        # Local executors share this machine's cores; an external one splits its own host's.
        threads = max(1, (os.cpu_count() or 1) // (nproc * len(nodes))) if self.executors else None
        # The first node serves the rendezvous, on a port its last heartbeat found free.
        first = self._beat(nodes[0])
        assert first is not None  # a healthy node has a heartbeat
        endpoint = f"{first['address'] or first['host']}:{first['free_port']}"
        for node in nodes:
            self._command(
                node,
                "start",
                attempt=attempt,
                nnodes=len(nodes),
                nproc_per_node=nproc,
                rdzv_endpoint=endpoint,
                rdzv_host=node == nodes[0],
                rdzv_id=f"{self.job}-{attempt}",
                train_args=self.train_args,
                threads=threads,
            )
        self.attempt_started = time.time()
        self.events.write("start", attempt=attempt, nodes=nodes, processes=len(nodes) * nproc)

    def watch(self, nodes: list[str], attempt: int, recovered: bool = True) -> Fault | None:
        """Until the attempt ends: None when every node finished cleanly, else the first fault seen."""
        self.watching = AttemptWatch(self, nodes, attempt, recovered)
        return self.watching.run()

    def wait_for_snapshots(self, nodes: list[str], timeout_s: float = 600.0) -> None:
        """Until every node's executor has persisted the snapshots its training processes left.

        Call it with the training processes stopped. A coordinator still waiting for other nodes' share of
        a save while no other node persists anything waits for shares that can never come (those nodes
        died before theirs was ready): once that has held for a while, the save is abandoned."""
        deadline, stuck_since = time.time() + timeout_s, None
        grace_s = 2 * self.res.heartbeat_interval_s + 1.0  # a share written just now is seen by then
        while time.time() < deadline:
            time.sleep(self.res.heartbeat_interval_s)
            now, beats = time.time(), [self._beat(node) for node in nodes]
            live = [
                beat for beat in beats if beat and self._beat_age(beat, now) < self.res.heartbeat_timeout_s
            ]
            busy = [
                beat for beat in live if beat.get("snapshots_pending")
            ]  # a dead executor persists nothing
            if not busy:
                return
            waiting = [beat["snapshot_waiting"] for beat in busy if beat.get("snapshot_waiting")]
            if len(waiting) < len(busy):
                stuck_since = None
            elif stuck_since is None:
                stuck_since = now
            elif now - stuck_since > grace_s:
                for save in waiting:
                    abandon(save["final"], save["save_id"])
                    self.events.write(
                        "abandoned", checkpoint=save["final"], reason="a node died before its share"
                    )
                stuck_since = None

    def stop_nodes(self, nodes: list[str], action: str = "stop") -> None:
        for node in nodes:
            self._command(node, action)
        deadline = time.time() + self.res.heartbeat_timeout_s + (60 if action == "terminate" else 0)
        while time.time() < deadline:
            beats = [self._beat(node) for node in nodes]
            if all(beat is None or beat["state"] != "running" for beat in beats):
                return
            time.sleep(self.res.heartbeat_interval_s)

    def diagnose(self, nodes: list[str], attempt: int) -> list[str]:
        """Run the self-check on `nodes`; returns those that failed it, never answered, or were markedly
        slower than the others."""
        res = self.res
        seq_before = self.seq
        for node in nodes:
            self._command(
                node,
                "diagnose",
                attempt=attempt,
                inject=self.inject,
                nproc_per_node=res.nproc_per_node,
                bandwidth=res.diagnose_bandwidth,
                expected_gflops=res.expected_gflops,
                expected_alltoall_gbps=res.expected_alltoall_gbps,
                min_speed_ratio=res.min_speed_ratio,
            )
        results = self._answers(nodes, "diag", seq_before)
        passed = {node: result for node, result in results.items() if result["passed"]}
        # Rates say which node is slow only when each node has a machine of its own: nodes sharing one
        # (local executors) share its cores, and one measured while the others ran looks slow.
        if len({self.registered[node]["host"] for node in passed}) == len(passed):
            for node, slow in slower_than_peers(passed, res.min_speed_ratio).items():
                results[node] = {**results[node], "passed": False, "reason": slow}
        healthy = [node for node in nodes if node in results and results[node]["passed"]]
        if res.diagnose_bandwidth and len(healthy) >= 2:
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

    def _answers(self, nodes: list[str], key: str, seq_before: int) -> dict[str, dict[str, Any]]:
        """The nodes' answers under `<key>/<node>` to a command sent after `seq_before`, as they come in
        until every node whose executor runs has answered, or resilience.diagnose_timeout_s has passed."""
        answers: dict[str, dict[str, Any]] = {}
        deadline = time.time() + self.res.diagnose_timeout_s
        while time.time() < deadline:
            waiting = [node for node in nodes if node not in answers and not self.executor_exited(node)]
            if not waiting:
                break
            for node in waiting:
                answer = answers.get(node) or self.store.fetch(f"{key}/{node}")
                if answer and answer["seq"] > seq_before:
                    answers[node] = answer
            time.sleep(0.2)
        return answers

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
        self._write_record()
        if self.previous is not None:
            adopt(self)
        elif self.res.executors == "local":
            self.start_executors()
        store_lost = None
        try:
            return self._loop()
        except StoreLost as err:
            store_lost = err
            step = self._verified_checkpoint_step()
            self.events.write(
                "give_up",
                reason=f"{err}; resumable from the checkpoint of step {step}: run `megascale launch` again "
                f"with training.run_dir = {self.run_dir}",
            )
            return 1
        finally:
            if store_lost is None:
                self.discover()
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

    def _wait_until_left(self, nodes: list[str]) -> None:
        """Until every live executor has said its last word (a TCPStore closes with this driver)."""
        deadline = time.time() + self.res.heartbeat_timeout_s
        while time.time() < deadline:
            beats, now = [self._beat(node) for node in nodes], time.time()
            live = [
                beat for beat in beats if beat and self._beat_age(beat, now) < self.res.heartbeat_timeout_s
            ]
            if all(beat["state"] == "left" for beat in live):
                return
            time.sleep(0.1)

    def _loop(self) -> int:
        if self.previous is not None:
            attempt, nodes, running = resume_point(self)
        else:
            attempt, nodes, running = 0, self.wait_for_nodes()[: self.res.nodes], False
        while True:
            if not running:
                if not self._layout_fits(len(nodes)):
                    self.events.write(
                        "give_up", reason=f"{len(nodes)} healthy nodes cannot run the job's layout"
                    )
                    return 1
                self.start_attempt(nodes, attempt)
            fault = self.watch(nodes, attempt, recovered=running or attempt == 0)
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
            hung = fault.kind in ("hang", "comm_flat") and self.watching is not None
            named = self.watching.blame() if hung and self.watching is not None else None
            if named is not None:
                self.events.write("blame", attempt=attempt, **named)
            if fault.kind == "input_error":
                self.stop_nodes(nodes)
                self.wait_for_snapshots(nodes)
                self.events.write("give_up", reason=f"an error in the job's input: {fault.detail}")
                return 2
            self._stop_and_evict(fault, nodes, attempt, named)
            if attempt >= self.res.max_restarts:
                self.events.write(
                    "give_up", reason=f"resilience.max_restarts = {self.res.max_restarts} reached"
                )
                return 1
            attempt += 1
            nodes = self.healthy_nodes()[: self.res.nodes]
            # The newest checkpoint in storage; the ranks may resume from a newer snapshot still in their
            # nodes' memory (`recovered` says where they did).
            self.events.write(
                "restart", attempt=attempt, checkpoint_step=self._newest_checkpoint_step(attempt)
            )

    def _stop_and_evict(
        self, fault: Fault, nodes: list[str], attempt: int, named: dict[str, Any] | None
    ) -> None:
        """After a fault: fence dead executors' processes (restarting our executors), stop the other nodes
        keeping their snapshots, and evict what is to blame: a straggler, a node whose executor is gone, a
        node failing its self-check, a node blamed for HANGS_TO_EVICT hangs."""
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
        if named is not None and len(named["nodes"]) == 1:
            # A node that passes its self-check but hangs again and again is as bad as a failing one.
            (node,) = named["nodes"]
            self.hang_blames[node] = self.hang_blames.get(node, 0) + 1
            if self.hang_blames[node] >= HANGS_TO_EVICT and node not in read_blocklist(self.run_dir):
                evict(self.run_dir, node)
                self.events.write("evict", node=node, reason=f"blamed for {HANGS_TO_EVICT} hangs")

    def _newest_checkpoint_step(self, attempt: int) -> int:
        from megascale.checkpoint.checkpointer import list_checkpoints

        root = self.cfg.checkpoint.location or str(Path(self.cfg.training.run_dir) / "checkpoints")
        checkpoints = list_checkpoints(root)
        if checkpoints and any(
            f.kind == "corrupt_checkpoint" for f in active_faults(self.inject, attempt - 1)
        ):
            corrupt_checkpoint(checkpoints[-1][1])
            self.events.write("injected", kind="corrupt_checkpoint", checkpoint=checkpoints[-1][1])
        return self._verified_checkpoint_step()

    def _verified_checkpoint_step(self) -> int:
        """The step of the newest checkpoint that verifies: what the trainer will resume from (0: none)."""
        from megascale.checkpoint.checkpointer import Checkpointer, read_manifest

        root = self.cfg.checkpoint.location or str(Path(self.cfg.training.run_dir) / "checkpoints")
        newest = Checkpointer(root, keep=1).latest_verified()
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

    def _beat_age(self, beat: dict[str, Any], now: float | None = None) -> float:
        """How old a heartbeat is, counted from the end of the store's last outage at the earliest: no
        executor could beat while the store was away."""
        return (now or time.time()) - max(beat["time"], self.store.back_at)

    def _reseed(self, store: ControlStore) -> None:
        """The store answers again after an outage. A Redis server restarted empty has lost the job's keys:
        put back what the driver knows (its mark, the registrations, each node's last command), so that
        executors find their job and commands, and a new registration gets a ticket after the known ones."""
        began, ended = self.store.outages[-1]
        emptied = store.fetch("driver") is None
        if emptied:
            store.put("driver", {"job": self.job, "time": time.time()})
            store.add("registered", len(self.tickets))
            for ticket, info in enumerate(self.tickets):
                store.put(f"node/{ticket}", info)
            for node, command in self.commands.items():
                store.put(f"cmd/{node}", command)
        self.events.write("store_back", outage_s=round(ended - began, 1), reseeded=emptied)

    def _request_stop(self, signum: int, frame: Any) -> None:
        self.stop_requested = True
