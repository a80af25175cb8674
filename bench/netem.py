"""An emulated cluster network on one Linux machine: "nodes" are network namespaces joined by a veth pair,
with `tc` limits on the links inside each node (its loopback) and between the nodes (the veth).

The limits are `netem` (bandwidth and delay) where the kernel has it; a kernel without `sch_netem` (this
project's CI VM has none) gets a token bucket (`tbf`): the bandwidth is limited, the delay is not
emulated, and `delay_emulated` says so.

Used by bench/overlap.py to give communication a realistic cost next to CPU compute, and by the two-host
test of the resilience driver (without limits). Needs root (CAP_NET_ADMIN) and iproute2's `ip` and `tc`.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass


@dataclass
class Link:
    """A netem limit on one direction of a link: bandwidth and one-way delay."""

    rate: str  # tc's notation: "1gbit", "200mbit"
    delay_ms: float

    def netem(self) -> list[str]:
        return ["netem", "rate", self.rate, "delay", f"{self.delay_ms}ms"]

    def token_bucket(self) -> list[str]:
        # The burst must exceed the largest packet (loopback's MTU is 64 KiB), or such packets never pass.
        return ["tbf", "rate", self.rate, "burst", "1mb", "latency", "100ms"]


class EmulatedNodes:
    """Two nodes, 10.77.0.1 and 10.77.0.2; `start` runs a command inside one of them."""

    def __init__(self, tag: str, inside: Link | None = None, between: Link | None = None):
        self.names = [f"ms{tag}a", f"ms{tag}b"]
        self.addresses = ["10.77.0.1", "10.77.0.2"]
        self.devices = [f"{name}v" for name in self.names]
        self.inside, self.between = inside, between
        self.procs: list[subprocess.Popen] = []
        self.delay_emulated = True

    def create(self) -> None:
        (a, b), (va, vb) = self.names, self.devices
        commands = [
            f"ip netns add {a}",
            f"ip netns add {b}",
            f"ip link add {va} type veth peer name {vb}",
            f"ip link set {va} netns {a}",
            f"ip link set {vb} netns {b}",
            f"ip -n {a} addr add {self.addresses[0]}/24 dev {va}",
            f"ip -n {b} addr add {self.addresses[1]}/24 dev {vb}",
            f"ip -n {a} link set {va} up",
            f"ip -n {b} link set {vb} up",
            f"ip -n {a} link set lo up",
            f"ip -n {b} link set lo up",
        ]
        for command in commands:
            _run(command.split())
        for name, device in zip(self.names, self.devices):
            for link, dev in ((self.between, device), (self.inside, "lo")):
                if link is not None:
                    self._limit(name, dev, link)

    def _limit(self, namespace: str, device: str, link: Link) -> None:
        head = ["tc", "-n", namespace, "qdisc", "add", "dev", device, "root"]
        try:
            _run([*head, *link.netem()])
        except subprocess.CalledProcessError:  # no sch_netem in this kernel: bandwidth only
            self.delay_emulated = False
            _run([*head, *link.token_bucket()])

    def start(self, node: int, command: list[str], **kwargs) -> subprocess.Popen:
        """Run `command` on node 0 or 1 (`ip netns exec` execs it, so the pid is the command's)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.names[node], *command], start_new_session=True, **kwargs
        )
        self.procs.append(proc)
        return proc

    def describe(self) -> str:
        links = [
            f"{where} {link.rate}" + (f" {link.delay_ms} ms" if self.delay_emulated else "")
            for where, link in (("inside a node", self.inside), ("between nodes", self.between))
            if link
        ]
        note = (
            ""
            if self.delay_emulated
            else " (no sch_netem in this kernel: bandwidth limited by tbf, no delay)"
        )
        return f"2 nodes; {', '.join(links) or 'no limits'}{note}"

    def remove(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for name in self.names:  # deleting a namespace deletes its end of the veth pair, and so both
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=30)
