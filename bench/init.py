"""Process-group initialisation and the store behind it (paper §3.5), side by side in one run.

(a) groups: the time to create every group of a dp x tp x pp layout (megascale's 4-D mesh: pp, dp_replicate
    = 1, dp_shard = dp, tp) on 8, 16, 32 and 64 local processes, gloo, three ways:
    - `naive`: torch's `init_device_mesh` with a store barrier of the whole world after every group
      (`TORCH_DIST_INIT_BARRIER=1`, what torch did by default before 2.1 and what the paper removed);
    - `torch`: `init_device_mesh` as torch 2.13 ships it (every rank calls `new_group` for every group,
      member or not; no barrier);
    - `barrier_free`: `ParallelDims.build_mesh`, each rank creating only its own groups.
    Ranks are forked from this process after `import torch` (64 fresh imports on 2 cores take minutes); the
    cost of importing torch is measured apart, in fresh interpreters. The store (TCPStore, libuv) runs in a
    process of its own, so its CPU time is the store's work. Figures: the spread from the first rank with a
    world group to the last rank with all its groups, the rank CPU seconds, the store CPU seconds, the
    barriers each rank joined, and the log-log slopes of each mode's time and of its busiest rank's CPU
    time against the process count.
(b) store: latency (p50/p99 per operation) and throughput of set, get, add and wait, and of a barrier built
    from add + wait, with 16 to 1,024 concurrent clients, for torch's TCPStore (libuv server) and the Redis
    store. Clients are threads, one store connection each, in a few processes forked from this one after
    `import torch` (both clients are torch Store objects); the threads import nothing. A thread's latency
    includes waiting for its process's GIL, and RedisStore's client is Python (redis-py) where TCPStore's
    is C++ that releases the GIL, so this compares the two stores as megascale would use them; the Redis
    server's own capacity is measured beside them with redis-benchmark's C clients (SET, GET, INCR).
    TCPStore's set returns before the server replies, so its set latency is the client's send alone.

Prints one `name value` line per figure and writes them, with the machine, as JSON.

    python bench/init.py --out bench/results/init.json
    python bench/init.py --quick
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import torch.distributed as dist
from torch.distributed import distributed_c10d

from megascale.parallel.dims import ParallelDims
from megascale.stores.redis_store import local_redis_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.record, run as a script
from bench.record import save_record  # noqa: E402

TIMEOUT_S = 300.0
# TCPStore's server looks up the name of every client that connects, in its one thread; where the resolver
# is slow (this machine's, at times) a thousand clients take minutes to connect.
CONNECT_TIMEOUT_S = 900.0
SERVE_LIMIT_S = 3600.0  # a store server outlives every part that uses it; this bounds an orphaned one
MODES = ("naive", "torch", "barrier_free")
# dp x tp x pp per process count: every dimension grows in turn, as a job scaling out would.
LAYOUTS = {8: (2, 2, 2), 16: (4, 2, 2), 32: (4, 4, 2), 64: (4, 4, 4)}
FORK = multiprocessing.get_context("fork")


def import_torch_s(concurrent: int) -> float:
    """Wall seconds for `concurrent` fresh interpreters, started together, to import torch."""
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", "import torch"]) for _ in range(concurrent)]
    for proc in procs:
        proc.wait(timeout=TIMEOUT_S)
    return time.monotonic() - started


def serve_tcpstore(ports, stop, usage) -> None:
    """A TCPStore server (libuv) in its own process: reports its port, then its CPU seconds when stopped."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S)
    )
    ports.put(store.port)
    stop.wait(SERVE_LIMIT_S)
    own = resource.getrusage(resource.RUSAGE_SELF)
    usage.put(own.ru_utime + own.ru_stime)


class StoreServer:
    """A TCPStore server process, started before the clients connect and stopped by pid."""

    def __init__(self):
        self._ports, self._usage, self._stop = FORK.Queue(), FORK.Queue(), FORK.Event()
        self._proc = FORK.Process(target=serve_tcpstore, args=(self._ports, self._stop, self._usage))
        self._proc.start()
        self.port = self._ports.get(timeout=60)

    def stop(self) -> float:
        """Stops the server; its CPU seconds."""
        self._stop.set()
        cpu_s = self._usage.get(timeout=60)
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        return cpu_s


def group_rank(rank, world, port, mode, layout, results, release) -> None:
    """One rank of part (a): join the world group, then create every group of the layout."""
    real_barrier = distributed_c10d._store_based_barrier
    barriers = []

    def counting_barrier(*args, **kwargs):
        barriers.append(1)
        return real_barrier(*args, **kwargs)

    try:
        timeout = timedelta(seconds=TIMEOUT_S)
        started = time.monotonic()
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        world_ready = time.monotonic()
        distributed_c10d._store_based_barrier = counting_barrier
        if mode == "naive":
            os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
        cpu_started = time.process_time()
        dp, tp, pp = layout
        dims = ParallelDims(pp=pp, dp_replicate=1, dp_shard=dp, tp=tp)
        dims.build_mesh("cpu", timeout_s=TIMEOUT_S, barrier_free=mode == "barrier_free")
        done = time.monotonic()
        results.put((rank, started, world_ready, done, time.process_time() - cpu_started, len(barriers)))
    except BaseException as error:  # noqa: BLE001 (reported to the parent)
        results.put((rank, "error", repr(error)))
    release.wait(TIMEOUT_S)


def time_groups(world: int, mode: str) -> dict[str, float]:
    """Part (a) for one process count and mode, in freshly forked ranks."""
    server = StoreServer()
    results, release = FORK.Queue(), FORK.Event()
    forked = time.monotonic()
    procs = [
        FORK.Process(
            target=group_rank, args=(rank, world, server.port, mode, LAYOUTS[world], results, release)
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        rows = [results.get(timeout=TIMEOUT_S) for _ in range(world)]
    finally:
        release.set()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        store_cpu_s = server.stop()
    failed = [row for row in rows if row[1] == "error"]
    if failed:
        raise RuntimeError(f"{mode} on {world} processes: rank {failed[0][0]} failed: {failed[0][2]}")
    _, started, world_ready, done, cpu_s, barriers = zip(*rows)
    return {
        "fork_s": max(started) - forked,
        "world_group_s": max(world_ready) - min(started),
        "groups_s": max(done) - min(world_ready),
        "rank_cpu_max_s": max(cpu_s),
        "rank_cpu_total_s": sum(cpu_s),
        "store_cpu_s": store_cpu_s,
        "barriers_per_rank": max(barriers),
        "total_after_import_s": max(done) - forked,
    }


def slope(counts: list[int], seconds: list[float]) -> float:
    """Least-squares slope of log(seconds) against log(count): 1 is linear growth, 2 quadratic."""
    xs, ys = [math.log(count) for count in counts], [math.log(value) for value in seconds]
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)


def part_groups(counts: list[int], repeats: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    for concurrent in (1, 8):
        figures[f"import_torch_{concurrent}_processes_s"] = round(import_torch_s(concurrent), 2)
    medians: dict[str, list[float]] = {mode: [] for mode in MODES}
    rank_cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    for world in counts:
        dp, tp, pp = LAYOUTS[world]
        for mode in MODES:
            runs = [time_groups(world, mode) for _ in range(repeats)]
            for key in runs[0]:
                figures[f"groups_{world}_{mode}_{key}"] = round(
                    statistics.median(run[key] for run in runs), 4
                )
            medians[mode].append(figures[f"groups_{world}_{mode}_groups_s"])
            rank_cpu[mode].append(figures[f"groups_{world}_{mode}_rank_cpu_max_s"])
        figures[f"groups_{world}_layout_dp_tp_pp"] = f"{dp}x{tp}x{pp}"
        for mode in ("naive", "torch"):
            figures[f"groups_{world}_{mode}_over_barrier_free"] = round(
                figures[f"groups_{world}_{mode}_groups_s"] / figures[f"groups_{world}_barrier_free_groups_s"],
                2,
            )
    for mode in MODES:
        for smaller, larger, low, high in zip(counts, counts[1:], medians[mode], medians[mode][1:]):
            figures[f"groups_{mode}_growth_{smaller}_to_{larger}"] = round(high / low, 2)
        if len(counts) > 1:
            figures[f"groups_{mode}_loglog_slope"] = round(slope(counts, medians[mode]), 2)
            # What one rank does grows like the time a cluster, with a core per rank, would take.
            figures[f"groups_{mode}_rank_cpu_loglog_slope"] = round(slope(counts, rank_cpu[mode]), 2)
    return figures


class RedisPyStore:
    """Stand-in with the Redis store's interface, used only while megascale.stores.redis_store is
    absent."""

    def __init__(self, url: str, prefix: str = "", timeout: timedelta = timedelta(seconds=300)):
        import redis

        self._redis, self._prefix, self._timeout_s = (
            redis.Redis.from_url(url),
            prefix,
            timeout.total_seconds(),
        )

    def set(self, key: str, value) -> None:
        self._redis.set(self._prefix + key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._redis.get(self._prefix + key)

    def add(self, key: str, amount: int) -> int:
        return self._redis.incrby(self._prefix + key, amount)

    def wait(self, keys: list[str]) -> None:
        deadline = time.monotonic() + self._timeout_s
        while self._redis.exists(*[self._prefix + key for key in keys]) < len(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(keys)
            time.sleep(0.001)


def connect(kind: str, address: str):
    timeout = timedelta(seconds=CONNECT_TIMEOUT_S)
    if kind == "tcpstore":
        host, port = address.rsplit(":", 1)
        return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    try:
        from megascale.stores.redis_store import RedisStore
    except ImportError:
        return RedisPyStore(address, timeout=timeout)
    return RedisStore(address, timeout=timeout)


def run_client(store, phase: str, tag: str, client: int, clients: int, ops: int, start_at: float, out):
    """One client's part of one phase: its per-operation latencies and its first start / last end."""
    time.sleep(max(0.0, start_at - time.monotonic()))
    latencies = []
    first = time.monotonic()
    for index in range(ops):
        key = f"{tag}/{client}/{index}"
        began = time.monotonic()
        if phase == "set":
            store.set(key, b"x" * 64)
        elif phase == "get":
            store.get(key)
        elif phase == "add":
            store.add(f"{tag}/counter", 1)
        elif phase == "wait":
            store.wait([key])
        else:  # barrier: the last to arrive opens it, everyone waits for the opening
            arrived = store.add(f"{tag}/barrier/{index}", 1)
            if arrived == clients:
                store.set(f"{tag}/barrier/{index}/open", b"1")
            store.wait([f"{tag}/barrier/{index}/open"])
        latencies.append(time.monotonic() - began)
    out.append((latencies, first, time.monotonic()))


def client_process(conn) -> None:
    """Hosts store clients as threads; driven by (command, ...) messages from the parent."""
    stores = []
    while True:
        message = conn.recv()
        if message[0] == "connect":
            _, kind, address, count = message
            stores = [connect(kind, address) for _ in range(count)]
            conn.send("connected")
        elif message[0] == "phase":
            _, phase, tag, first_client, clients, ops, start_at = message
            out: list = []
            threads = [
                threading.Thread(
                    target=run_client,
                    args=(store, phase, tag, first_client + index, clients, ops, start_at, out),
                )
                for index, store in enumerate(stores)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(TIMEOUT_S)
            conn.send(out)
        else:
            stores.clear()
            conn.send("done")
            return


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def measure_store(kind: str, address: str, clients: int, processes: int, args) -> dict[str, float]:
    """Part (b) for one store and one client count: every phase, all clients at once."""
    procs, conns = [], []
    for _ in range(processes):
        parent_end, child_end = FORK.Pipe()
        proc = FORK.Process(target=client_process, args=(child_end,))
        proc.start()
        procs.append(proc)
        conns.append(parent_end)
    shares = [clients // processes + (index < clients % processes) for index in range(processes)]
    figures: dict[str, float] = {}
    try:
        connecting = time.monotonic()
        for conn, share in zip(conns, shares):
            conn.send(("connect", kind, address, share))
        for conn in conns:
            if not conn.poll(CONNECT_TIMEOUT_S):
                raise TimeoutError(f"{kind}: {clients} clients did not connect in {CONNECT_TIMEOUT_S} s")
            conn.recv()
        figures[f"store_{kind}_{clients}_connect_all_s"] = round(time.monotonic() - connecting, 3)
        tag = f"{kind}{clients}"
        ops = max(args.min_ops, args.ops // clients)
        for phase in ("set", "get", "add", "wait", "barrier"):
            count = args.barriers if phase == "barrier" else ops
            start_at = time.monotonic() + 0.2
            first = 0
            for conn, share in zip(conns, shares):
                conn.send(("phase", phase, tag, first, clients, count, start_at))
                first += share
            rows = []
            for conn in conns:
                if not conn.poll(TIMEOUT_S):
                    raise TimeoutError(f"{kind}: phase {phase} with {clients} clients timed out")
                rows.extend(conn.recv())
            latencies = [value for row in rows for value in row[0]]
            span_s = max(row[2] for row in rows) - min(row[1] for row in rows)
            name = f"store_{kind}_{clients}_{phase}"
            figures[f"{name}_p50_ms"] = round(1e3 * percentile(latencies, 0.5), 3)
            figures[f"{name}_p99_ms"] = round(1e3 * percentile(latencies, 0.99), 3)
            if phase == "barrier":
                figures[f"{name}_per_s"] = round(count / span_s, 1)
            else:
                figures[f"{name}_ops_per_s"] = round(len(latencies) / span_s)
        for conn in conns:
            conn.send(("close",))
            conn.poll(30) and conn.recv()
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return figures


def redis_benchmark(port: int, clients: int, ops: int) -> dict[str, float]:
    """The Redis server's own capacity, with redis-benchmark's C clients (no Python, no GIL): the same
    client counts, SET, GET and INCR (the store's set, get and add)."""
    tool = shutil.which("redis-benchmark")
    if tool is None:
        return {}
    command = [
        tool,
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-c",
        str(clients),
        "-n",
        str(ops),
        "-t",
        "set,get,incr",
    ]
    lines = subprocess.run([*command, "--csv"], capture_output=True, text=True, timeout=TIMEOUT_S).stdout
    figures = {}
    for line in lines.splitlines()[1:]:
        test, ops_per_s, _, _, p50_ms, _, p99_ms, _ = (field.strip('"') for field in line.split(","))
        name = f"store_redis_benchmark_{clients}_{test.lower()}"
        figures[f"{name}_p50_ms"] = float(p50_ms)
        figures[f"{name}_p99_ms"] = float(p99_ms)
        figures[f"{name}_ops_per_s"] = round(float(ops_per_s))
    return figures


def part_store(client_counts: list[int], args) -> dict[str, float]:
    if shutil.which("redis-server") is None:
        raise SystemExit(
            "part (b) needs redis-server on PATH (apt-get install redis-server), or --skip-store"
        )
    server = StoreServer()
    figures: dict[str, float] = {}
    try:
        with local_redis_server() as redis_url:
            redis_port = urlparse(redis_url).port
            addresses = {"tcpstore": f"127.0.0.1:{server.port}", "redis": redis_url}
            for clients in client_counts:
                processes = min(args.client_processes, clients)
                for kind in ("tcpstore", "redis"):
                    figures.update(measure_store(kind, addresses[kind], clients, processes, args))
                figures.update(redis_benchmark(redis_port, clients, max(args.ops, 20 * clients)))
                for phase in ("set", "get", "add", "wait"):
                    figures[f"store_{clients}_{phase}_redis_over_tcpstore_throughput"] = round(
                        figures[f"store_redis_{clients}_{phase}_ops_per_s"]
                        / figures[f"store_tcpstore_{clients}_{phase}_ops_per_s"],
                        2,
                    )
                figures[f"store_{clients}_barrier_redis_over_tcpstore_p50"] = round(
                    figures[f"store_redis_{clients}_barrier_p50_ms"]
                    / figures[f"store_tcpstore_{clients}_barrier_p50_ms"],
                    2,
                )
    finally:
        server.stop()
    return figures


def redis_store_class() -> str:
    try:
        from megascale.stores.redis_store import RedisStore
    except ImportError:
        return "bench stand-in (redis-py; megascale.stores.redis_store absent)"
    return f"{RedisStore.__module__}.{RedisStore.__qualname__}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="8 and 16 processes, 16 and 64 clients, 1 repeat."
    )
    parser.add_argument("--repeats", type=int, default=3, help="Runs of each mode per process count (a).")
    parser.add_argument("--ops", type=int, default=16_000, help="Operations per phase over all clients (b).")
    parser.add_argument("--min-ops", type=int, default=10, help="Operations per client at least (b).")
    parser.add_argument("--barriers", type=int, default=10, help="Barriers per client count (b).")
    parser.add_argument("--client-processes", type=int, default=4, help="Processes hosting the clients (b).")
    parser.add_argument("--skip-groups", action="store_true", help="Leave out part (a).")
    parser.add_argument("--skip-store", action="store_true", help="Leave out part (b).")
    parser.add_argument("--out", type=Path, default=Path("bench/results/init.json"))
    args = parser.parse_args()
    process_counts = [8, 16] if args.quick else [8, 16, 32, 64]
    client_counts = [16, 64] if args.quick else [16, 64, 256, 1024]
    repeats = 1 if args.quick else args.repeats
    figures: dict[str, float] = {}
    parts = [] if args.skip_groups else [lambda: part_groups(process_counts, repeats)]
    parts += [] if args.skip_store else [lambda: part_store(client_counts, args)]
    for part in parts:
        found = part()
        for name, value in found.items():
            print(f"{name} {value}", flush=True)
        figures.update(found)
    save_record(
        args.out,
        figures,
        {
            "layouts_dp_tp_pp": {str(world): LAYOUTS[world] for world in process_counts},
            "process_counts": process_counts,
            "client_counts": client_counts,
            "repeats": repeats,
            "redis_store": redis_store_class(),
            **vars(args),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
