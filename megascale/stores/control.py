"""The control store the driver and executors talk through: torch's TCPStore, or a Redis server.

Heartbeats, commands and diagnostics results are small JSON values under well-known keys (the driver knows
the node names, or counts them with `add`, so nothing ever lists keys). TCPStore needs no setup: the
driver hosts it. Redis (`resilience.store = "redis://host:port/db"`) survives the driver and serves
thousands of clients; the MegaScale paper moved to it for exactly that (§3.5). Both sides are
torch.distributed Stores (Redis through `megascale.stores.redis_store.RedisStore`, the one the
training processes can rendezvous through too); this protocol only adds JSON values and a read that
does not wait.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol
from urllib.parse import urlparse

from megascale.errors import MegascaleError


class ControlStore(Protocol):
    url: str

    def put(self, key: str, value: Any) -> None: ...
    def fetch(self, key: str) -> Any | None: ...
    def delete(self, key: str) -> None: ...
    def add(self, key: str, amount: int) -> int: ...


class JsonStore:
    """JSON values over a torch.distributed Store (`_store`); each kind says how to read a key without
    waiting for it (`_read`)."""

    _store: Any
    url: str

    def put(self, key: str, value: Any) -> None:
        self._store.set(key, json.dumps(value))

    def fetch(self, key: str) -> Any | None:
        raw = self._read(key)
        return None if raw is None else json.loads(raw)

    def _read(self, key: str) -> bytes | None:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        self._store.delete_key(key)

    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the counter `key` (0 if new); its new value."""
        return int(self._store.add(key, amount))


class TorchStore(JsonStore):
    """torch.distributed.TCPStore; `host=True` serves it (the driver), else connects as a client."""

    def __init__(self, address: str, port: int, *, host: bool, timeout_s: float = 30.0):
        from torch.distributed import TCPStore

        self._store = TCPStore(
            address, port, is_master=host, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.url = f"tcp://{address}:{self._store.port}"

    def put(self, key: str, value: Any) -> None:
        # TCPStore's set is fire-and-forget: the server may answer another client's get before it applies
        # this set. A request with a reply on the same connection is served after it, so once `check`
        # returns, every client reads the new value.
        super().put(key, value)
        self._store.check([key])

    def _read(self, key: str) -> bytes | None:
        return self._store.get(key) if self._store.check([key]) else None


class RedisControlStore(JsonStore):
    """A Redis server, through the Redis-backed torch Store; keys are prefixed by the job so jobs can share
    a server."""

    def __init__(self, url: str, prefix: str, timeout_s: float = 30.0):
        from megascale.stores.redis_store import RedisStore

        self._store = RedisStore(url, prefix=prefix, timeout=timedelta(seconds=timeout_s))
        self.url = url

    def _read(self, key: str) -> bytes | None:
        return self._store.try_get(key)


class StoreLost(MegascaleError):
    """The control store stayed unreachable for longer than the grace period."""

    exit_status = 1


def _outage_errors() -> tuple[type[BaseException], ...]:
    """What a store client raises when its server is gone: a socket error, torch's DistNetworkError (a
    RuntimeError), redis-py's connection errors."""
    import redis

    return (OSError, RuntimeError, redis.ConnectionError, redis.TimeoutError)


class OutageTolerantStore:
    """A ControlStore that rides out its server's outage: a call that fails for want of the server is
    retried until the server answers again or `grace_s` has passed since the outage began (then
    StoreLost). `on_return(store)` runs once the server answers again, before the call that waited: a
    Redis restarted empty is seeded there. `reopen()`, if given, makes a new client after a failure: a
    TCPStore client never reconnects by itself (its socket stays broken once its server is gone)."""

    def __init__(
        self,
        store: ControlStore,
        grace_s: float,
        on_return: Callable[[ControlStore], None] | None = None,
        reopen: Callable[[], ControlStore] | None = None,
    ):
        self.inner, self.grace_s, self.on_return, self.reopen = store, grace_s, on_return, reopen
        self.url = store.url
        self.outage_since: float | None = None
        self.back_at = 0.0  # when the last outage ended (time.time(); 0: none yet)
        self.outages: list[tuple[float, float]] = []  # (began, ended), time.time()

    def _call(self, method: str, *args: Any) -> Any:
        errors = _outage_errors()
        broken = False
        while True:
            try:
                if broken and self.reopen is not None:
                    self.inner = self.reopen()
                result = getattr(self.inner, method)(*args)
            except errors as err:
                broken = True
                now = time.time()
                self.outage_since = self.outage_since or now
                if now - self.outage_since > self.grace_s:
                    raise StoreLost(
                        f"the control store {self.url} has been unreachable for "
                        f"{now - self.outage_since:.0f} s (resilience.store_grace_s = {self.grace_s:g}): "
                        f"{type(err).__name__}: {err}"
                    ) from err
                time.sleep(min(1.0, self.grace_s / 10))
                continue
            if self.outage_since is not None:
                began, self.outage_since = self.outage_since, None
                self.back_at = time.time()
                self.outages.append((began, self.back_at))
                if self.on_return is not None:
                    self.on_return(self.inner)
            return result

    def put(self, key: str, value: Any) -> None:
        self._call("put", key, value)

    def fetch(self, key: str) -> Any | None:
        return self._call("fetch", key)

    def delete(self, key: str) -> None:
        self._call("delete", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)


def open_store(url: str, *, job: str, host: bool = False, timeout_s: float = 30.0) -> ControlStore:
    """`tcp://addr:port` (port 0 with host=True picks a free one) or `redis://host:port/db`; a client waits
    up to `timeout_s` for the server to come up."""
    parsed = urlparse(url)
    if parsed.scheme == "redis":
        return RedisControlStore(url, prefix=f"megascale/{job}/", timeout_s=timeout_s)
    if parsed.scheme == "tcp":
        return TorchStore(parsed.hostname or "127.0.0.1", parsed.port or 0, host=host, timeout_s=timeout_s)
    raise ValueError(f"resilience.store must be tcp://HOST:PORT or redis://HOST:PORT/DB, got {url!r}")
