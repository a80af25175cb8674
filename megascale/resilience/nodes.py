"""The driver's hold on its nodes: their executors, their heartbeats and the commands it sends them.

`NodeControl` is the part of the driver (driver.py) that keeps the executors (started on this machine,
adopted from a killed driver, replaced when one dies, fenced, and replenished after an eviction), reads
their registrations and heartbeats from the store and writes their commands, answers who is healthy,
stops them, and waits for their answers and for the snapshots they persist. It decides nothing about the
job: the driver's loop does. It implements the heartbeats and the executor lifecycle of lifecycle.py,
which the driver's other parts (watch.py, takeover.py) are typed against.
"""

from __future__ import annotations

import contextlib
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
from megascale.host import local_address
from megascale.observe.events import EventLog
from megascale.resilience.executor import executor_command
from megascale.resilience.processes import AdoptedProcess
from megascale.resilience.records import read_blocklist
from megascale.resilience.takeover import write_record
from megascale.stores.control import ControlStore, OutageTolerantStore


def _address_key(info: dict[str, Any]) -> str:
    """What torchrun's c10d rendezvous numbers the nodes by: their address as a string."""
    return info.get("address") or info.get("host") or ""


class NodeControl:
    """The executors of one job, through its store (`store`, opened by the driver)."""

    def __init__(self, cfg: JobConfig, run_dir: Path):
        self.res = cfg.resilience
        self.run_dir = run_dir
        self.job = cfg.resilience.job_id or uuid.uuid4().hex[:8]
        self.events = EventLog(run_dir)
        self.store: OutageTolerantStore  # opened by the driver's run() (tests put a fake in)
        # The executors this driver started (local), or adopted from a killed driver that started them.
        self.executors: dict[str, subprocess.Popen | AdoptedProcess] = {}
        self.registered: dict[str, dict[str, Any]] = {}  # every executor that joined, by node name
        self.tickets_read = 0
        self.tickets: list[dict[str, Any]] = []  # every registration read, by ticket (to re-seed a store)
        self.commands: dict[str, dict[str, Any]] = {}  # the last command sent to each node (likewise)
        # Commands are numbered from the clock, so a driver taking the job over numbers its commands after
        # those its executors have already seen.
        self.seq = time.time_ns() // 1000

    def _command(self, node: str, action: str, **fields: Any) -> None:
        self.seq += 1
        self.commands[node] = {"seq": self.seq, "action": action, **fields}
        self.store.put(f"cmd/{node}", self.commands[node])

    def heartbeat(self, node: str) -> dict[str, Any] | None:
        return self.store.fetch(f"hb/{node}")

    def heartbeat_age(self, beat: dict[str, Any], now: float | None = None) -> float:
        """How old a heartbeat is, counted from the end of the store's last outage at the earliest: no
        executor could beat while the store was away."""
        return (now or time.time()) - max(beat["time"], self.outage_ended_at)

    @property
    def outage_ended_at(self) -> float:
        return self.store.back_at

    def start_executors(self) -> None:
        for index in range(self.res.nodes + self.res.spares):
            if f"node-{index}" not in read_blocklist(self.run_dir):
                self.start_executor(f"node-{index}")

    def replenish(self) -> None:
        """Local executors: for each evicted node, tell its executor to exit and start a new node under
        the next free name, so that resilience.spares stay spare: on one machine the counterpart of
        asking the cluster for a replacement host. External executors are the cluster's to replace."""
        if self.res.executors != "local":
            return
        blocked = set(read_blocklist(self.run_dir))
        for node in sorted(blocked & set(self.executors)):
            if not self.executor_exited(node) and self.commands.get(node, {}).get("action") != "exit":
                self._command(node, "exit")
        usable = [node for node in self.executors if node not in blocked]
        names = {*self.executors, *blocked}
        index = 1 + max(int(name[5:]) for name in names if name.startswith("node-") and name[5:].isdigit())
        while len(usable) < self.res.nodes + self.res.spares:
            while f"node-{index}" in blocked:
                index += 1
            self.start_executor(f"node-{index}")
            usable.append(f"node-{index}")
            index += 1

    def start_executor(self, node: str) -> None:
        """Start the executor of `node` (named node-<index>) on this machine, at the index's address."""
        address = local_address(int(node.rsplit("-", 1)[1]))
        command = executor_command(
            self.store.url, self.job, node, self.run_dir, self.res.heartbeat_interval_s, address
        )
        command += ["--store-grace", str(self.res.store_grace_s)]
        self.executors[node] = subprocess.Popen(command, start_new_session=True)  # type: ignore[assignment]
        self.write_record()

    def adopt_executor(self, node: str, identity: dict[str, Any]) -> None:
        """Keep `node`'s executor, which a killed driver started (`identity`: its process), as ours."""
        self.executors[node] = AdoptedProcess(identity)
        self.write_record()

    def restore_registrations(self, known: list[dict[str, Any]]) -> None:
        """Take the registrations a killed driver read (`known`, in ticket order) as read, and put them
        back in a store that died with it, so that a new executor's ticket comes after them."""
        self.registered.update((info["node"], info) for info in known)  # joined before: no new event
        if self.store.add("registered", 0) == 0:
            self.store.add("registered", len(known))
            for ticket, info in enumerate(known):
                self.store.put(f"node/{ticket}", info)

    def write_record(self) -> None:
        """The driver's record (takeover.py): what a driver started after this one dies takes over."""
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
        beat = self.heartbeat(node)
        return beat is None or self.heartbeat_age(beat) > self.res.heartbeat_timeout_s

    def fence(self, node: str) -> None:
        """Kill what a dead executor left running on this host: its torchrun's session and each worker's,
        which would otherwise live on as orphans in a collective, holding the node's memory. Processes on
        another host are out of reach from here; the survivors' collectives time out without them."""
        beat = self.heartbeat(node)
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
        """Start `node`'s executor again (one this driver started) and wait for its first heartbeat (or its
        exit): it adopts the node's processes and staging directory, and persists the snapshots the dead
        one had not."""
        old = self.executors.pop(node)
        if old.poll() is None:  # its heartbeat stopped, but it lives: hung
            with contextlib.suppress(ProcessLookupError):
                os.killpg(old.pid, signal.SIGKILL)
        old.wait()
        started = time.time()
        self.start_executor(node)
        deadline = started + self.res.startup_timeout_s
        while time.time() < deadline:
            self.discover()
            beat = self.heartbeat(node)
            if (beat is not None and beat["time"] > started) or self.executor_exited(node):
                break
            time.sleep(min(0.2, self.res.heartbeat_interval_s))
        self.events.write("executor_replaced", node=node, exit_code=old.returncode)

    def discover(self, record: bool = True) -> None:
        """Read the registrations of executors that joined since the last call (`joined` events unless
        not `record`: the job has ended, and they are only told to exit)."""
        joined = self.store.add("registered", 0)
        while self.tickets_read < joined:
            info = self.store.fetch(f"node/{self.tickets_read}")
            if info is None:  # the ticket is taken, the name not yet written
                return
            if info["node"] not in self.registered and record:
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
            beat = self.heartbeat(node)
            alive = beat is not None and self.heartbeat_age(beat, now) < self.res.heartbeat_timeout_s
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

    def stop_nodes(self, nodes: list[str], action: str = "stop") -> None:
        for node in nodes:
            self._command(node, action)
        deadline = time.time() + self.res.heartbeat_timeout_s + (60 if action == "terminate" else 0)
        while time.time() < deadline:
            beats = [self.heartbeat(node) for node in nodes]
            if all(beat is None or beat["state"] != "running" for beat in beats):
                return
            time.sleep(self.res.heartbeat_interval_s)

    def wait_for_snapshots(self, nodes: list[str], timeout_s: float = 600.0) -> None:
        """Until every node's executor has persisted the snapshots its training processes left.

        Call it with the training processes stopped. A coordinator still waiting for other nodes' share of
        a save while no other node persists anything waits for shares that can never come (those nodes
        died before theirs was ready): once that has held for a while, the save is abandoned."""
        deadline, stuck_since = time.time() + timeout_s, None
        grace_s = 2 * self.res.heartbeat_interval_s + 1.0  # a share written just now is seen by then
        while time.time() < deadline:
            now, beats = time.time(), [self.heartbeat(node) for node in nodes]
            live = [
                beat
                for beat in beats
                if beat and self.heartbeat_age(beat, now) < self.res.heartbeat_timeout_s
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
            time.sleep(self.res.heartbeat_interval_s)

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
            time.sleep(0.05)
        return answers

    def _own_hosts(self, nodes: list[str]) -> bool:
        """Whether each node has a machine of its own: nodes sharing one (local executors) share its cores,
        and one measured while the others ran looks slow."""
        return len({self.registered[node]["host"] for node in nodes}) == len(nodes)

    def _wait_until_left(self, nodes: list[str]) -> None:
        """Until every live executor has said its last word (a TCPStore closes with this driver)."""
        deadline = time.time() + self.res.heartbeat_timeout_s
        while time.time() < deadline:
            beats, now = [self.heartbeat(node) for node in nodes], time.time()
            live = [
                beat
                for beat in beats
                if beat and self.heartbeat_age(beat, now) < self.res.heartbeat_timeout_s
            ]
            if all(beat["state"] == "left" for beat in live):
                return
            time.sleep(0.1)

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
