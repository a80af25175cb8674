"""What a node's processes need to know of their host: its addresses, free ports and network interfaces,
and its processes (their children, their I/O counters). Shared by the executor, the driver, the link
checks and the Redis store's launcher; it imports nothing of megascale.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path


def local_address(index: int) -> str:
    """A loopback address of its own for local node `index` (all of 127/8 reaches this machine), with
    three-digit octets so that the addresses sort as the indices do (valid for 15,600 nodes)."""
    return f"127.{100 + index // 100}.{100 + index % 100}.1"


def free_port(address: str | None) -> int:
    """A TCP port free on `address` (all of this host's addresses when None) right now: where this node
    would serve the next attempt's rendezvous."""
    with socket.socket() as sock:
        sock.bind((address or "", 0))
        return sock.getsockname()[1]


def interface_of(address: str) -> str | None:
    """The network interface that holds the IPv4 `address` (None for loopback and unknown addresses)."""
    try:
        if ipaddress.ip_address(address).is_loopback:
            return None
    except ValueError:
        return None  # a host name, not an address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                answer = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def io_bytes(pids: list[int]) -> int:
    """Bytes the processes have moved through read/write calls, sockets included (/proc/PID/io): their
    collectives' traffic, and what they write each step. A hung job's stops moving."""
    total = 0
    for pid in pids:
        try:
            fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
            total += int(fields["rchar"]) + int(fields["wchar"])
        except (OSError, KeyError, ValueError):
            continue  # exited meanwhile, or not ours to read
    return total


def children_alive(pid: int) -> list[int]:
    """Live child processes of `pid` (torchrun's workers), from /proc."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            alive.append(int(stat.parent.name))
    return alive


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` (R, S, D, T stopped, t traced, Z ...), None if there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
