"""Fault injection for tests and rehearsals: `resilience.inject` or MEGASCALE_INJECT, e.g.
"kill:rank=1:step=7,slow:rank=2:factor=1.5".

Faults a training process injects into itself (`FaultInjector`, called by the trainer):
- kill:rank=R:step=S      SIGKILL itself when step S begins
- hang:rank=R:step=S      stop making progress at step S (sleep, holding its peers in the next collective)
- nan:step=S              make step S's loss NaN on every rank
- slow:rank=R:factor=F    rank R computes F times slower (from step S with :step=S): a straggler
- corrupt_checkpoint:step=S   when step S begins, rank 0 (or rank=R) truncates a shard of the newest
                          checkpoint committed by then: the next restart that reads storage meets it
Faults the executor's self-checks take (resilience/diagnostics.py, resilience/links.py):
- diagnose_fail:node=N    node N fails its self-check
- link_fail:node=N        node N's data is damaged in the all-reduce with its neighbour nodes
A fault fires in the first attempt only (`attempt=K` picks another), so a restart replays cleanly.

A spec of `@PATH` is read from the file PATH each time it is used (an absent file: no faults): a rehearsal
writes faults there while the job runs (`megascale rehearse --soak`), for an attempt and step to come.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload

from megascale.checkpoint.manifest import list_checkpoints
from megascale.errors import ConfigError

INJECT = "MEGASCALE_INJECT"
ATTEMPT = "MEGASCALE_ATTEMPT"
KINDS = {"kill", "hang", "nan", "slow", "diagnose_fail", "link_fail", "corrupt_checkpoint"}
RANK_KINDS = {"kill", "hang", "nan", "slow", "corrupt_checkpoint"}  # what training processes inject
ONE_RANK_KINDS = {"corrupt_checkpoint"}  # done once for the job: by rank 0, unless `rank=` names another
AT_A_STEP = {"kill", "hang", "nan", "corrupt_checkpoint"}  # faults that need their `step=`

log = logging.getLogger("megascale.inject")


@dataclass(frozen=True)
class Fault:
    kind: str
    params: dict[str, float] = field(default_factory=dict)

    @overload
    def get(self, name: str) -> float | None: ...
    @overload
    def get(self, name: str, default: float) -> float: ...
    def get(self, name: str, default: float | None = None) -> float | None:
        return self.params.get(name, default)


def read_spec(spec: str | None) -> str:
    """The spec itself, or the current contents of the file an `@PATH` spec names ("" while it is absent)."""
    if spec and spec.startswith("@"):
        try:
            return Path(spec[1:]).read_text()
        except FileNotFoundError:
            return ""
    return spec or ""


def parse_faults(spec: str | None) -> list[Fault]:
    """`kind:key=value:...` items separated by commas (or lines); raises ValueError naming the bad item."""
    faults = []
    for item in filter(None, (part.strip() for part in read_spec(spec).replace("\n", ",").split(","))):
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r} in {item!r}; known: {', '.join(sorted(KINDS))}")
        params = {}
        for pair in pairs:
            name, sep, value = pair.partition("=")
            try:
                params[name] = float(value)
            except ValueError:
                sep = ""
            if not sep:
                raise ValueError(f"fault {item!r}: {pair!r} is not key=number")
        if kind in AT_A_STEP and "step" not in params:
            raise ValueError(f"fault {item!r}: the step it happens at is missing (step=S)")
        faults.append(Fault(kind, params))
    return faults


def check_spec(spec: str | None) -> None:
    """Refuse a malformed spec up front, as a config error naming the field."""
    try:
        parse_faults(spec)
    except ValueError as err:
        raise ConfigError(f"config: resilience.inject = {spec!r}: {err}") from None


def active_faults(spec: str | None, attempt: int) -> list[Fault]:
    return [fault for fault in parse_faults(spec) if int(fault.get("attempt", 0)) == attempt]


class FaultInjector:
    """The faults of one training rank, called by the trainer around each step. `checkpoints`: the root
    of the job's checkpoints (a local path), which `corrupt_checkpoint` damages."""

    def __init__(
        self, spec: str | None, rank: int, attempt: int | None = None, checkpoints: str | None = None
    ):
        self.attempt = int(os.environ.get(ATTEMPT, "0")) if attempt is None else attempt
        self.spec = spec if spec is not None else os.environ.get(INJECT)
        self.rank = rank
        self.checkpoints = checkpoints
        check_spec(self.spec)
        self._faults = self._read()
        self._file_state: tuple[float, int] | None = None  # an `@PATH` spec's (mtime, size) when read

    def _read(self) -> list[Fault]:
        return [fault for fault in active_faults(self.spec, self.attempt) if self._takes(fault)]

    def _takes(self, fault: Fault) -> bool:
        """Whether this rank injects `fault`: a rank's fault, for this rank (`rank=`, else every rank, or
        rank 0 for a fault done once for the job)."""
        default = 0 if fault.kind in ONE_RANK_KINDS else self.rank
        return fault.kind in RANK_KINDS and int(fault.get("rank", default)) == self.rank

    @property
    def faults(self) -> list[Fault]:
        """This rank's faults of this attempt; an `@PATH` spec is read again when its file changed."""
        if self.spec and self.spec.startswith("@"):
            try:
                stat = os.stat(self.spec[1:])
                state = (stat.st_mtime, stat.st_size)
            except FileNotFoundError:
                state = None
            if state != self._file_state:
                self._file_state, self._faults = state, self._read()
        return self._faults

    def __bool__(self) -> bool:
        return bool(self.faults)

    def before_step(self, step: int) -> None:
        """`step` is the number of the step about to run (1-based)."""
        for fault in self.faults:
            if fault.kind == "corrupt_checkpoint" and step == fault.get("step") and self.checkpoints:
                newest = list_checkpoints(self.checkpoints)
                if newest:
                    shard = corrupt_checkpoint(newest[-1][1])
                    log.warning("inject: truncated %s of the checkpoint at %s", shard.name, newest[-1][1])
            if fault.kind == "kill" and step == fault.get("step"):
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "hang" and step == fault.get("step"):
                while True:
                    time.sleep(3600)

    def loss_scale(self, step: int) -> float:
        """1.0, or NaN at an injected NaN step (applied to the loss before backward)."""
        nan = any(fault.kind == "nan" and step == fault.get("step") for fault in self.faults)
        return float("nan") if nan else 1.0

    def stretch(self, step: int, compute_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        """Called after each piece of compute (a micro-batch's forward or backward, the optimizer) with its
        seconds on `clock`: a slow rank works on until `clock` has run `factor` times as long, as a slower
        device would; its peers then wait for it in the next collective. The work is a busy loop, not a
        sleep, so that a thread CPU clock (the timeline's on CPU) counts it as a slower CPU's would."""
        for fault in self.faults:
            if fault.kind == "slow" and step >= fault.get("step", 1):
                until = clock() + max(0.0, (fault.get("factor", 1.0) - 1.0) * compute_s)
                while clock() < until:
                    pass


def corrupt_checkpoint(location: str) -> Path:
    """Truncate one shard of the checkpoint at `location` to half its size (`corrupt_checkpoint`); returns
    the shard."""
    shards = sorted(path for path in Path(location).iterdir() if path.suffix == ".distcp")
    shard = random.Random(0).choice(shards)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard
