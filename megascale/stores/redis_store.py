"""A `torch.distributed.Store` kept in a Redis server, usable as `init_process_group(store=...)`.

Every process group's set-up is a rendezvous through the store: each rank writes its address, reads its
peers', and the group ends in a barrier. torch's TCPStore serves all of that from one server thread in one
of the training processes; MegaScale replaced it with Redis, which cut communicator set-up on 2,048 GPUs
from 1,047 s to 361 s (paper §3.5). torch ships no Redis store, but c10d accepts a Python subclass of
`Store` (a pybind trampoline calls the Python methods from C++, taking the GIL, so gloo's own threads can
use it too), so this is one: the Store contract with TCPStore's semantics, checked against TCPStore by
`tests/resilience/test_redis_store.py`:

- `get`, `multi_get` and `wait` block until every key exists, then fail after the store's timeout (or
  `wait`'s own) with `DistStoreError`, as TCPStore does; a timeout of 0 fails at once, as it does there.
- `add` is Redis's INCRBY, so values are decimal text and `get` after `add(k, 3)` returns b"3".
- `compare_set` is one Lua script (atomic on the server), with TCPStore's rules: a missing key is created
  only when `expected` is empty; otherwise the call returns `expected` for a missing key, `desired` after
  a swap, and the current value when it does not match.
- Keys live under `prefix`, so jobs and restarts share one server; `num_keys` counts this prefix's keys
  with SCAN, which is O(keys in the database), not O(1) as in TCPStore (nothing hot calls it).

How a blocked `wait` learns that a key appeared: every write that can create a key also PUBLISHes to a
channel named after the key, in the same round trip. A waiter first checks the keys (one EXISTS: the
common case, the key is already there, costs a single round trip); if some are missing it SUBSCRIBEs to
their channels, waits for the server to confirm the subscriptions, checks again (a key set before the
subscription took effect is seen here, one set after it is published to us), and then sleeps in the
socket until a message comes or the deadline passes. That wakes every waiter of a key within one network
hop of the write, with no polling load on a server shared by thousands of ranks. Keyspace notifications
would do the same without the PUBLISH, but they need `notify-keyspace-events` set on the server, which
managed Redis services often forbid; BLPOP on a per-key signal list wakes one waiter, not all. Subscriber
connections are kept in a small pool and reused, since a subscribed connection cannot run other commands.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, cast

import redis
import torch.distributed as dist

# A write that may create a key announces it here; channels are not keys, so they never show in num_keys.
_SET_CHANNEL = "c10d-store-set:"

# KEYS[1] the key; ARGV: expected, desired, the key's channel. TCPStore's compareSet, atomically.
_COMPARE_SET_LUA = """
local current = redis.call('GET', KEYS[1])
if current == false then
  if ARGV[1] ~= '' then return ARGV[1] end
elseif current ~= ARGV[1] then
  return current
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('PUBLISH', ARGV[3], '')
return ARGV[2]
"""


def _network_errors(method):
    """Report a lost or unreachable Redis server as torch's DistNetworkError, as TCPStore does."""

    @functools.wraps(method)
    def wrapper(self: RedisStore, *args: Any) -> Any:
        try:
            return method(self, *args)
        except (redis.ConnectionError, redis.TimeoutError) as err:
            raise dist.DistNetworkError(f"redis store {self.url}: {err}") from err

    return wrapper


def _glob_escape(text: str) -> str:
    return "".join("\\" + char if char in "*?[]\\^" else char for char in text)


class RedisStore(dist.Store):
    """The c10d Store contract over a Redis server at `url` (redis://HOST:PORT/DB), keys under `prefix`.

    `timeout` bounds every blocking call (`set_timeout` changes it, as on any Store) and how long the
    constructor waits for the server to answer. Safe to call from several threads at once.

    Keep a reference for as long as a process group uses the store: c10d holds only the C++ side of a
    Python store, and once the Python object is collected its calls fail with "Not implemented"."""

    timeout: timedelta  # Store's property (torch's stubs lack it)

    def __init__(self, url: str, prefix: str = "", timeout: timedelta = timedelta(seconds=300)):
        super().__init__()
        self.set_timeout(timeout)
        self.url, self.prefix = url, prefix
        socket_timeout_s = max(1.0, timeout.total_seconds())
        self._redis = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
        )
        self._compare_set_script = self._redis.register_script(_COMPARE_SET_LUA)
        self._idle_subscribers: list[redis.client.PubSub] = []
        self._subscribers_lock = threading.Lock()
        self._clones: list[RedisStore] = []
        self._connect(time.monotonic() + timeout.total_seconds())

    def _connect(self, deadline: float) -> None:
        """Wait for the server as a TCPStore client waits for its master: until the timeout."""
        while True:
            try:
                self._redis.ping()
                return
            except (redis.ConnectionError, redis.TimeoutError) as err:
                if time.monotonic() >= deadline:
                    raise dist.DistNetworkError(
                        f"redis store: no Redis server answered at {self.url} within "
                        f"{self.timeout.total_seconds():g} s ({err})"
                    ) from err
                time.sleep(0.1)

    def _name(self, key: str) -> str:
        return self.prefix + key

    def _channel(self, name: str) -> str:
        return _SET_CHANNEL + name

    # -- writes -----------------------------------------------------------------------------------------
    @_network_errors
    def set(self, key: str, value: str | bytes) -> None:
        name = self._name(key)
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(name, value)
        pipe.publish(self._channel(name), b"")
        pipe.execute()

    @_network_errors
    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the integer at `key` (0 if missing); the new value."""
        name = self._name(key)
        pipe = self._redis.pipeline(transaction=False)
        pipe.incrby(name, amount)
        pipe.publish(self._channel(name), b"")
        try:
            total, _ = pipe.execute()
        except redis.ResponseError as err:
            raise dist.DistStoreError(
                f"redis store: add({key!r}): the value there is not an integer ({err})"
            ) from err
        return int(total)

    @_network_errors
    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        name = self._name(key)
        return self._compare_set_script(
            keys=[name], args=[expected_value, desired_value, self._channel(name)]
        )

    @_network_errors
    def append(self, key: str, value: str | bytes) -> None:
        name = self._name(key)
        pipe = self._redis.pipeline(transaction=False)
        pipe.append(name, value)
        pipe.publish(self._channel(name), b"")
        pipe.execute()

    @_network_errors
    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        names = [self._name(key) for key in keys]
        pipe = self._redis.pipeline(transaction=False)
        pipe.mset(dict(zip(names, values, strict=True)))
        for name in names:
            pipe.publish(self._channel(name), b"")
        pipe.execute()

    @_network_errors
    def delete_key(self, key: str) -> bool:
        return bool(self._redis.delete(self._name(key)))

    # -- reads ------------------------------------------------------------------------------------------
    @_network_errors
    def get(self, key: str) -> bytes:
        """The value at `key`, waiting up to the store's timeout for it to be set."""
        deadline = self._deadline(None)
        while (value := self._redis.get(self._name(key))) is None:
            self._wait_until(deadline, [key], None)
        return cast(bytes, value)  # bytes: the client does not decode responses

    @_network_errors
    def multi_get(self, keys: list[str]) -> list[bytes]:
        deadline = self._deadline(None)
        names = [self._name(key) for key in keys]
        while None in (values := self._redis.mget(names) if names else []):
            self._wait_until(deadline, keys, None)
        return cast(list[bytes], values)

    @_network_errors
    def try_get(self, key: str) -> bytes | None:
        """The value at `key`, or None at once if there is none (not in the Store contract)."""
        return cast("bytes | None", self._redis.get(self._name(key)))

    @_network_errors
    def check(self, keys: list[str]) -> bool:
        """True if every key exists, without waiting."""
        return not keys or self._redis.exists(*map(self._name, keys)) == len(keys)

    @_network_errors
    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists; DistStoreError after `timeout` (default: the store's)."""
        self._wait_until(self._deadline(timeout), keys, timeout)

    @_network_errors
    def num_keys(self) -> int:
        """Keys under this store's prefix (SCAN: O(keys in the database))."""
        return sum(1 for _ in self._redis.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000))

    # torch's trampoline calls these two by their C++ names (as PrefixStore and gloo do).
    getNumKeys = num_keys  # noqa: N815
    deleteKey = delete_key  # noqa: N815

    def has_extended_api(self) -> bool:
        return True  # append, multi_get and multi_set are implemented

    def clone(self) -> RedisStore:
        """A new client of the same store (torch clones a group's store when it shrinks the group). This
        store keeps it alive: c10d holds only the C++ side of what it is handed (see the class)."""
        copy = RedisStore(self.url, self.prefix, self.timeout)
        self._clones.append(copy)
        return copy

    # -- waiting ----------------------------------------------------------------------------------------
    def _deadline(self, timeout: timedelta | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout).total_seconds()

    def _wait_until(self, deadline: float, keys: list[str], timeout: timedelta | None) -> None:
        """Return once every key exists; DistStoreError at `deadline` (see the module docstring)."""
        names = [self._name(key) for key in keys]
        if not names or self._redis.exists(*names) == len(names):
            return
        by_channel = {self._channel(name).encode(): name for name in names}
        subscriber = self._take_subscriber()
        try:
            subscriber.subscribe(*by_channel)
            unconfirmed = set(by_channel)
            while unconfirmed:
                message = self._next_message(subscriber, deadline, keys, timeout)
                if message is not None and message["type"] == "subscribe":
                    unconfirmed.discard(message["channel"])
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            missing = {name for name, found in zip(names, pipe.execute()) if not found}
            while missing:
                message = self._next_message(subscriber, deadline, keys, timeout)
                if message is None or message["type"] != "message":
                    continue
                announced = by_channel.get(message["channel"])
                # A message may be stale (left from this connection's earlier use): confirm before trusting.
                if announced in missing and self._redis.exists(announced):
                    missing.discard(announced)
        except BaseException:
            subscriber.close()  # its state is unknown: never reuse it
            raise
        subscriber.unsubscribe()
        with self._subscribers_lock:
            self._idle_subscribers.append(subscriber)

    def _next_message(
        self, subscriber: redis.client.PubSub, deadline: float, keys: list[str], timeout: timedelta | None
    ) -> dict[str, Any] | None:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            waited = self.timeout if timeout is None else timeout
            raise dist.DistStoreError(
                f"wait timeout after {waited.total_seconds() * 1000:.0f}ms, keys: {', '.join(keys)} "
                f"(redis store {self.url}, prefix {self.prefix!r})"
            )
        return subscriber.get_message(timeout=remaining_s)

    def _take_subscriber(self) -> redis.client.PubSub:
        with self._subscribers_lock:
            if self._idle_subscribers:
                return self._idle_subscribers.pop()
        return self._redis.pubsub()


@contextlib.contextmanager
def local_redis_server(timeout_s: float = 30.0) -> Iterator[str]:
    """A throwaway redis-server on a free loopback port, without persistence, for tests, benchmarks and a
    try-out on one machine; yields its URL (database 0) once it answers, and kills it (by pid) after."""
    from megascale.host import free_port

    port = free_port("127.0.0.1")
    proc = start_redis_server(port, timeout_s)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


def start_redis_server(port: int, timeout_s: float = 30.0) -> subprocess.Popen:
    """redis-server on loopback `port`, without persistence (a restart starts empty), once it answers."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not on PATH (Debian: apt-get install redis-server)")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                client.ping()
                return proc
            except redis.ConnectionError as err:
                if time.monotonic() > deadline or proc.poll() is not None:
                    proc.kill()
                    proc.wait()
                    raise RuntimeError(
                        f"redis-server on port {port} did not answer within {timeout_s} s"
                    ) from err
                time.sleep(0.05)
    finally:
        client.close()
