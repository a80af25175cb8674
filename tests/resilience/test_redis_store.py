"""The c10d Store contract, run on torch's TCPStore and on the Redis-backed store alike.

Every contract test takes `backend` and runs on both, so the suite is checked to describe what TCPStore
does before it judges RedisStore. The Redis server is the session's real `redis-server` (conftest.py);
each test's keys go under a fresh prefix. Differences, deliberate and tested only on Redis: `add` on a
value that is not a number raises DistStoreError (TCPStore's server drops the connection), and an
unreachable server raises DistNetworkError after the timeout.
"""

import multiprocessing
import os
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta

import pytest
import redis
import torch
import torch.distributed as dist

from megascale.config import load_config
from megascale.errors import ConfigError
from megascale.host import free_port
from megascale.observe.metrics import read_metrics
from megascale.parallel.distributed import init_distributed, rendezvous_prefix
from megascale.stores.redis_store import RedisStore
from tests.conftest import tiny_args
from tests.parallel.multiprocess import join_or_kill

LONG = timedelta(seconds=20)
SHORT_S = 0.3


class TCPBackend:
    """A TCPStore server in this process on a port chosen up front, so that processes forked before it
    starts can connect (forking after a store server exists hangs the children)."""

    def __init__(self):
        self.port = free_port("127.0.0.1")
        self.server = None

    def serve(self) -> None:
        self.server = dist.TCPStore(
            "127.0.0.1", self.port, is_master=True, timeout=LONG, wait_for_workers=False
        )

    def client(self, timeout: timedelta = LONG) -> dist.Store:
        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timeout)


class RedisBackend:
    """Clients of the session's Redis server under a prefix of their own."""

    def __init__(self, url: str):
        self.url, self.prefix = url, f"test-{uuid.uuid4().hex[:8]}/"

    def serve(self) -> None:
        pass

    def client(self, timeout: timedelta = LONG) -> dist.Store:
        return RedisStore(self.url, prefix=self.prefix, timeout=timeout)


@pytest.fixture(params=["tcp", "redis"])
def unserved_backend(request):
    """For tests that fork: the TCPStore server is started only after the fork (`run_children`)."""
    if request.param == "tcp":
        return TCPBackend()
    return RedisBackend(request.getfixturevalue("redis_url"))


@pytest.fixture
def backend(unserved_backend):
    unserved_backend.serve()
    return unserved_backend


@pytest.fixture
def store(backend):
    return backend.client()


def raises_timeout_after(call, expected_s: float) -> None:
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout"):
        call()
    assert expected_s * 0.9 <= time.monotonic() - started < expected_s + 2.0


# -- each method -------------------------------------------------------------------------------------------
def test_set_get_and_overwrite_across_clients(backend, store):
    other = backend.client()
    store.set("text", "hello")
    store.set("binary", b"\x00\xff\x10")
    assert other.get("text") == b"hello" and other.get("binary") == b"\x00\xff\x10"
    other.set("text", "again")
    assert store.get("text") == b"again"


def test_add_counts_from_zero_and_stores_decimal_text(store):
    assert store.add("n", 3) == 3
    assert store.get("n") == b"3"
    assert store.add("n", -5) == -2 and store.add("n", 0) == -2
    store.set("preset", "40")
    assert store.add("preset", 2) == 42 and store.get("preset") == b"42"


def test_check_delete_key_and_num_keys(store):
    assert store.check([]) and not store.check(["a"])
    assert store.num_keys() == 0
    store.set("a", "1")
    store.add("b", 1)
    store.multi_set(["c", "d"], ["3", "4"])
    assert store.check(["a", "b", "c"]) and not store.check(["a", "missing"])
    assert store.num_keys() == 4
    assert store.delete_key("a") is True and store.delete_key("a") is False
    assert not store.check(["a"]) and store.num_keys() == 3


@pytest.mark.parametrize(
    "initial, expected, desired, returned, stored",
    [
        (None, "", "new", b"new", b"new"),  # a missing key is created only against an empty expected value
        (None, "old", "new", b"old", None),  # missing and expected something: `expected` back, nothing set
        ("old", "old", "new", b"new", b"new"),  # match: swapped
        ("old", "other", "new", b"old", b"old"),  # mismatch: the current value back
        ("old", "", "new", b"old", b"old"),  # an empty expectation does not match a value
        ("", "", "new", b"new", b"new"),  # ... but does match an empty value
    ],
)
def test_compare_set(store, initial, expected, desired, returned, stored):
    if initial is not None:
        store.set("k", initial)
    assert store.compare_set("k", expected, desired) == returned
    assert (store.get("k") if store.check(["k"]) else None) == stored


def test_multi_set_multi_get_and_append(store):
    store.multi_set(["x", "y", "z"], ["1", b"2", "3"])
    assert store.multi_get(["z", "x", "y"]) == [b"3", b"1", b"2"]
    assert store.multi_get([]) == []
    store.append("log", "a")
    store.append("log", b"bc")
    assert store.get("log") == b"abc"


def test_a_prefix_store_around_it_namespaces_every_call(backend, store):
    outer = dist.PrefixStore("job", store)
    outer.set("k", "v")
    assert outer.get("k") == b"v" and outer.add("n", 2) == 2 and outer.check(["k", "n"])
    assert not store.check(["k"]) and store.get("job/k") == b"v"
    outer.wait(["k", "n"])
    assert outer.multi_get(["k", "n"]) == [b"v", b"2"]
    assert outer.compare_set("k", "v", "w") == b"w" and outer.delete_key("k")
    assert outer.num_keys() == store.num_keys() == 1  # num_keys is the underlying store's
    copy = outer.clone()  # what torch does when it shrinks a group: a new client through C++
    copy.set("cloned", "1")
    assert store.get("job/cloned") == b"1"


# -- timeouts --------------------------------------------------------------------------------------------
def test_get_and_multi_get_wait_for_the_store_timeout(backend):
    store = backend.client(timeout=timedelta(seconds=SHORT_S))
    assert store.timeout == timedelta(seconds=SHORT_S)
    raises_timeout_after(lambda: store.get("never"), SHORT_S)
    store.set("here", "1")
    raises_timeout_after(lambda: store.multi_get(["here", "never"]), SHORT_S)


def test_wait_takes_its_own_timeout_or_the_stores(store):
    raises_timeout_after(lambda: store.wait(["never"], timedelta(seconds=SHORT_S)), SHORT_S)
    store.set_timeout(timedelta(seconds=SHORT_S))
    assert store.timeout == timedelta(seconds=SHORT_S)
    raises_timeout_after(lambda: store.wait(["never"]), SHORT_S)
    raises_timeout_after(lambda: store.get("never"), SHORT_S)
    raises_timeout_after(lambda: store.wait(["never"], timedelta(0)), 0.0)  # 0 fails at once
    store.set("a", "1")
    started = time.monotonic()
    store.wait(["a"], LONG)  # not 0: TCPStore's client then gives up before its own reply can arrive
    assert time.monotonic() - started < 1.0


def test_get_and_wait_return_as_soon_as_another_client_sets_the_key(backend, store):
    other = backend.client()
    for call in (lambda: store.get("late"), lambda: store.wait(["late", "later"])):
        other.delete_key("late")
        timers = [
            threading.Timer(0.2, other.set, ("late", "v")),
            threading.Timer(0.3, other.add, ("later", 1)),
        ]
        started = time.monotonic()
        for timer in timers:
            timer.start()
        call()
        elapsed = time.monotonic() - started
        for timer in timers:
            timer.join()
        assert 0.15 < elapsed < 2.0, elapsed


# -- many processes --------------------------------------------------------------------------------------
def _adder(backend, adds, results):
    store = backend.client()
    results.put([store.add("counter", 1) for _ in range(adds)])


def _waiter(backend, results):
    store = backend.client()
    started = time.monotonic()
    store.wait(["go"], timedelta(seconds=10))
    results.put((store.get("go"), time.monotonic() - started))


def run_children(backend, target, args_per_child: list[tuple], timeout_s: float = 30.0, after_start=None):
    """Fork one process per args tuple, start the store's server after the fork, and collect one result
    each; every child is joined or killed by pid."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    children = [context.Process(target=target, args=(backend, *args, results)) for args in args_per_child]
    for child in children:
        child.start()
    try:
        backend.serve()
        if after_start is not None:
            after_start()
        return [results.get(timeout=timeout_s) for _ in children]
    finally:
        join_or_kill(children)


def test_concurrent_adds_from_eight_processes_are_each_counted_once(unserved_backend):
    backend = unserved_backend
    tickets = run_children(backend, _adder, [(200,)] * 8)
    assert sorted(ticket for child in tickets for ticket in child) == list(range(1, 1601))
    assert backend.client().get("counter") == b"1600"


def test_one_set_releases_every_waiting_process(unserved_backend):
    backend = unserved_backend

    def set_go_later():
        time.sleep(0.5)  # the waiters are blocked by now
        backend.client().set("go", "now")

    released = run_children(backend, _waiter, [()] * 4, after_start=set_go_later)
    assert [value for value, _ in released] == [b"now"] * 4
    assert all(waited_s < 8 for _, waited_s in released), released


# -- Redis only: deliberate differences and the server's absence -----------------------------------------
def test_add_on_text_is_a_store_error_on_redis(redis_url):
    store = RedisStore(redis_url, prefix=f"{uuid.uuid4().hex}/")
    store.set("text", "abc")
    with pytest.raises(dist.DistStoreError, match="not an integer"):
        store.add("text", 1)


def test_no_server_is_a_network_error_after_the_timeout():
    started = time.monotonic()
    with pytest.raises(dist.DistNetworkError, match="no Redis server answered"):
        RedisStore(f"redis://127.0.0.1:{free_port('127.0.0.1')}/0", timeout=timedelta(seconds=SHORT_S))
    assert time.monotonic() - started < 3


def test_prefixes_keep_stores_apart_on_one_server(redis_url):
    first, second = RedisStore(redis_url, prefix="job-a/"), RedisStore(redis_url, prefix="job-b/")
    first.set("addr", "1")
    assert not second.check(["addr"]) and second.try_get("addr") is None and first.try_get("addr") == b"1"


# -- process groups through it ---------------------------------------------------------------------------
def _gloo_rank(url, rank, world_size, how, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), TORCHELASTIC_RUN_ID=how)
    try:
        if how.startswith("init_distributed"):
            init_distributed(torch.device("cpu"), 20.0, store=url)
        else:  # a PrefixStore around it, as torch's own groups use it
            store = RedisStore(url, prefix=rendezvous_prefix(), timeout=LONG)
            dist.init_process_group(
                "gloo", store=dist.PrefixStore("outer", store), rank=rank, world_size=world_size, timeout=LONG
            )
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        pair = dist.new_group([0, 1])
        ones = torch.ones(2)
        if rank < 2:
            dist.all_reduce(ones, group=pair)
        dist.barrier()
        results.put((rank, total.item(), ones.tolist()))
    except BaseException as err:  # noqa: BLE001 (reported to the parent, which fails the test)
        results.put((rank, repr(err), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("how, world_size", [("init_distributed", 4), ("prefix-store", 2)])
def test_gloo_process_group_through_redis(redis_url, how, world_size):
    how = f"{how}-{uuid.uuid4().hex[:8]}"  # the run id: this test's own keys
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [
        context.Process(target=_gloo_rank, args=(redis_url, rank, world_size, how, results))
        for rank in range(world_size)
    ]
    for proc in ranks:
        proc.start()
    try:
        outcomes = sorted(results.get(timeout=60) for _ in ranks)
    finally:
        join_or_kill(ranks)
    expected_total = world_size * (world_size + 1) / 2
    assert outcomes == [
        (rank, expected_total, [2.0, 2.0] if rank < 2 else [1.0, 1.0]) for rank in range(world_size)
    ]
    # The rendezvous went through Redis, under the launch's run id and restart count.
    keys = RedisStore(redis_url, prefix=f"megascale/pg/{how}/0/").num_keys()
    assert keys > 0


def test_rendezvous_prefix_names_the_launch_and_the_restart(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7-2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert rendezvous_prefix() == "megascale/pg/job7-2/3/"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default --rdzv-id
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert rendezvous_prefix() == "megascale/pg/10.0.0.1:29500/0/"


@pytest.mark.parametrize("value", ["tcp://10.0.0.1:29500", "redis://10.0.0.1", "redis://h:6379/db", "env:"])
def test_parallel_store_must_be_env_or_a_redis_url(value):
    with pytest.raises(ConfigError, match=r"parallel\.store = .* must be 'env' or redis://HOST:PORT/DB"):
        load_config(overrides=[f"--parallel.store={value}"])
    assert load_config(overrides=["--parallel.store=redis://10.0.0.1:6379/0"]).parallel.store.endswith("/0")


def test_a_two_process_job_meets_in_redis(redis_url, tiny_corpus, tmp_path):
    """`megascale train --nproc 2 --parallel.store=redis://...`: the trainer's process groups are built
    through the Redis server (its rendezvous keys are there) and the job trains to the end."""
    run_dir = tmp_path / "run"
    args = tiny_args(tiny_corpus, run_dir, tmp_path / "data", "--parallel.dp_shard=2", "--training.steps=2")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "megascale.cli",
            "train",
            "--nproc",
            "2",
            *args,
            f"--parallel.store={redis_url}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [record["step"] for record in read_metrics(run_dir)] == [1, 2]
    keys = redis.Redis.from_url(redis_url).keys("megascale/pg/*")
    assert keys, "no rendezvous key in the Redis server"
