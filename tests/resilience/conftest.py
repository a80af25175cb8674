"""A real redis-server on a free loopback port, and two hosts in network namespaces; both started and
stopped by the tests (processes by pid)."""

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url():
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (.ci/run installs it: apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.kill()
    proc.wait()


class Hosts:
    """Two "hosts": network namespaces joined by a veth pair, each with its own address."""

    def __init__(self, tag: str):
        self.names = [f"ms{tag}a", f"ms{tag}b"]
        self.addresses = ["10.77.0.1", "10.77.0.2"]
        self.procs: list[subprocess.Popen] = []

    def create(self) -> None:
        a, b = self.names
        for command in (
            f"ip netns add {a}",
            f"ip netns add {b}",
            f"ip link add {a}v type veth peer name {b}v",
            f"ip link set {a}v netns {a}",
            f"ip link set {b}v netns {b}",
            f"ip -n {a} addr add {self.addresses[0]}/24 dev {a}v",
            f"ip -n {b} addr add {self.addresses[1]}/24 dev {b}v",
            f"ip -n {a} link set {a}v up",
            f"ip -n {b} link set {b}v up",
            f"ip -n {a} link set lo up",
            f"ip -n {b} link set lo up",
        ):
            subprocess.run(command.split(), check=True, capture_output=True, text=True, timeout=30)

    def start(self, host: int, command: list[str], **kwargs) -> subprocess.Popen:
        """Run `command` on host 0 or 1 (`ip netns exec` execs it, so the pid is the command's)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.names[host], *command], start_new_session=True, **kwargs
        )
        self.procs.append(proc)
        return proc

    def remove(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for name in self.names:  # deleting a namespace deletes its end of the veth pair, and so both
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None:
        pytest.skip("two-host test: the `ip` command (Debian iproute2) is not installed")
    hosts = Hosts(str(os.getpid()))
    try:
        hosts.create()
    except subprocess.CalledProcessError as err:
        hosts.remove()
        pytest.skip(
            f"two-host test: cannot create network namespaces here ({err.stderr.strip()}); it needs root "
            "(CAP_NET_ADMIN)"
        )
    yield hosts
    hosts.remove()
