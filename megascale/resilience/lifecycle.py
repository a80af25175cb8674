"""What the driver's parts ask of its hold on the nodes: their heartbeats, and their executors' lifecycle.

The driver (driver.py) owns its nodes through nodes.py's `NodeControl`; watching an attempt (watch.py) and
taking over a killed driver's job (takeover.py) are typed against these interfaces, and each adds the
few things of the job it needs, so that neither imports the driver.
"""

from __future__ import annotations

from typing import Any, Protocol


class Heartbeats(Protocol):
    """The nodes' newest heartbeats, as their executors put them in the store."""

    def heartbeat(self, node: str) -> dict[str, Any] | None:
        """`node`'s newest heartbeat (None: none yet, or the store lost it)."""
        ...

    def heartbeat_age(self, beat: dict[str, Any], now: float | None = None) -> float:
        """Seconds since `beat`, counted from the end of the store's last outage at the earliest."""
        ...

    @property
    def outage_ended_at(self) -> float:
        """time.time() when the store last answered again after an outage (0.0: none yet)."""
        ...


class ExecutorLifecycle(Protocol):
    """The executors of the job: started, adopted from a killed driver, replaced when one dies, and asked
    to keep the next attempt waiting as their warm standby."""

    def start_executor(self, node: str) -> None:
        """Start `node`'s executor on this machine."""
        ...

    def adopt_executor(self, node: str, identity: dict[str, Any]) -> None:
        """Keep `node`'s executor, a live process (`identity`) that a killed driver started."""
        ...

    def replace_executor(self, node: str) -> None:
        """Start `node`'s dead executor (one this driver keeps) again; it adopts the node's processes."""
        ...

    def executor_exited(self, node: str) -> bool:
        """Whether `node`'s executor is one this driver keeps, and it has exited."""
        ...

    def executor_gone(self, node: str) -> bool:
        """Whether `node`'s executor exited, or its heartbeat is past resilience.heartbeat_timeout_s."""
        ...

    def keep_standby(self, nodes: list[str], attempt: int) -> None:
        """While `attempt` trains: make sure attempt + 1 waits on `nodes` as its warm standby."""
        ...
