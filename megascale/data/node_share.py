"""Each batch read once per node: one rank reads it from the shards, the others on the node share it.

MegaScale reads each batch once per node into shared memory rather than once per GPU (paper §3.4): the
ranks of a tensor-parallel group (and pipeline stages placed on the same node) train on the same batch,
and reading it from storage once for each of them multiplies the I/O by their number.

The unit of sharing is a *share group*: the ranks on one node that have the same data-parallel rank (so
take the same batches). Its lowest rank is the reader: it reads each batch from the shards, as it must
for itself anyway, and publishes it into a ring of slots in shared memory; the others take it from
there and read the shards not at all. One reader per share group rather than one per node, because a
node-wide reader would read the batches of every data-parallel rank on the node, a straggler by
construction, while here no rank does more than it did before and each distinct batch is still read once
per node. A group of one (each rank its own batch) shares nothing and costs nothing.

The shared memory is an anonymous file (on /dev/shm where it exists, so it is memory) whose descriptor
the reader hands to the others over a Unix socket (SCM_RIGHTS): it has no name, so it is freed when the
last process holding it exits, after a crash too. The socket, whose name carries the job, the node, the
run generation (torchrun's restart count) and the reader's rank and pid, lives in Linux's abstract
namespace and vanishes with its process as well (elsewhere it is a path in the temporary directory,
removed once every rank connected; that branch has not run here). Over the socket the reader announces
each published batch (slot, stream position) and each taker acknowledges each batch it copied out, which
frees the slot; these are syscalls, so they also order the memory writes with no polling. A rank that
exits closes its end and the peer fails at once, naming it; a hung peer fails it after `timeout_s`.

Batches are pure functions of the stream position, so a taker accepts a published batch exactly when
its position is the one it wants. One it does not want yet is kept (a bounded number, oldest dropped
first): after a checkpoint load moves the stream, the reader and a taker move at slightly different
times, and a taker still on the old stream must not lose the batches the reader already published for
the new one; batches of the old stream published after the taker moved are kept and never asked for.
The taker also keeps the last batches it returned: its prefetch thread may have taken a batch of the new
stream while still working for the old one, then been stopped with that batch in hand (a stopped
prefetcher drops what it made), and the reader publishes each position of a stream once.
Python's multiprocessing.shared_memory was not used: its resource tracker unlinks a segment when a
process that merely attached exits (before Python 3.13), and a named segment outlives a crash.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist

from megascale.data.prefetch import POLL_S, Stopped
from megascale.errors import DataError

ANNOUNCE = struct.Struct("<qq")  # (slot, stream position) of a published batch
HELLO = struct.Struct("<q")  # a taker's global rank, its first message
LAYOUT = struct.Struct("<qqq")  # (slots, rows, columns) of the ring, sent with its descriptor
ACK = b"\x01"  # one per batch copied out of its slot
SHM_DIR = "/dev/shm"


def node_name() -> str:
    """This process's node, as sharing sees it: the machine (its boot id, else its host name) and the
    network namespace the reader's socket lives in, with torchrun's GROUP_RANK (several agents on one
    machine are several nodes to torchrun, and each keeps its own share groups). The host name alone is
    not enough: containers or network namespaces of one machine can share it and still not reach each
    other's sockets."""
    try:
        machine = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        network = os.stat("/proc/self/ns/net").st_ino
    except OSError:  # not Linux
        machine, network = socket.gethostname(), 0
    return f"{machine}-net{network}#{os.environ.get('GROUP_RANK', '0')}"


def _receive(
    connection: socket.socket,
    size: int,
    stop: threading.Event,
    deadline: float | None,
    timed_out: Callable[[], DataError],
) -> bytes:
    """Up to `size` bytes from `connection` (whose timeout is POLL_S), waiting while none come: raises
    Stopped once `stop` is set and `timed_out()` after `deadline`; b"" when the peer has gone."""
    while True:
        if stop.is_set():
            raise Stopped
        if deadline is not None and time.monotonic() > deadline:
            raise timed_out()
        try:
            return connection.recv(size)
        except TimeoutError:
            continue
        except OSError:
            return b""


@dataclass(frozen=True)
class ShareGroup:
    """The ranks on this node with this rank's data-parallel rank, the reader first."""

    ranks: tuple[int, ...]
    reader_pid: int
    rank: int
    node: str

    @property
    def reader(self) -> int:
        return self.ranks[0]

    @property
    def is_reader(self) -> bool:
        return self.rank == self.reader

    @property
    def takers(self) -> tuple[int, ...]:
        return self.ranks[1:]

    def address(self) -> str:
        """Where the reader listens: named by job, node, run generation, reader rank and pid."""
        job = os.environ.get("TORCHELASTIC_RUN_ID", "job")
        generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        name = f"megascale-data-{job}-{self.node}-g{generation}-r{self.reader}-p{self.reader_pid}"
        if len(name) > 90:  # socket names are limited (108 bytes on Linux, 104 elsewhere)
            digest = hashlib.sha256(name.encode()).hexdigest()[:16]
            name = f"megascale-data-{digest}-r{self.reader}-p{self.reader_pid}"
        if sys.platform == "linux":
            return "\0" + name  # the abstract namespace: no file, gone with the process
        return os.path.join(tempfile.gettempdir(), name[:60])  # untested: no other platform here


def find_share_group(dp_rank: int) -> tuple[ShareGroup | None, bool]:
    """This rank's share group (None when it takes its batches alone), and whether any rank of the job
    shares. Collective over the default process group: every rank calls it, once, in the same place."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (node_name(), dp_rank, os.getpid()))
    keys = [(node, dp) for node, dp, _ in everyone]
    anyone_shares = len(set(keys)) < len(keys)
    mine = keys[dist.get_rank()]
    ranks = tuple(rank for rank, key in enumerate(keys) if key == mine)
    if len(ranks) == 1:
        return None, anyone_shares
    return ShareGroup(ranks, everyone[ranks[0]][2], dist.get_rank(), mine[0]), anyone_shares


def open_shared_ring(
    dp_rank: int,
    rows: int,
    columns: int,
    slots: int,
    *,
    stop: threading.Event,
    timeout_s: float,
    wait_timeout_s: float | None,
) -> RingWriter | RingReader | None:
    """Join this rank's share group: the reader gets a RingWriter, the others a RingReader, a rank alone
    None. The ring holds `slots` batches of int64 [rows, columns]. Collective over the default process
    group (a gather and, when anyone shares, a barrier); connecting waits at most `timeout_s`. The ring's
    waits for batches watch `stop` and give up after `wait_timeout_s` (None: only `stop` ends them; the
    prefetcher bounds the wait instead)."""
    group, anyone_shares = find_share_group(dp_rank)
    listener = _listen(group) if group is not None and group.is_reader else None
    if anyone_shares:
        dist.barrier()  # every reader listens before any taker connects
    if group is None:
        return None
    if listener is not None:
        return RingWriter(group, listener, (slots, rows, columns), stop, timeout_s, wait_timeout_s)
    return RingReader(group, (slots, rows, columns), stop, timeout_s, wait_timeout_s)


def _listen(group: ShareGroup) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(group.address())
    listener.listen(len(group.takers))
    return listener


class RingWriter:
    """The reader's end: `publish` puts a batch in the next free slot and announces it to every taker."""

    def __init__(
        self,
        group: ShareGroup,
        listener: socket.socket,
        layout: tuple[int, int, int],
        stop: threading.Event,
        timeout_s: float,
        wait_timeout_s: float | None,
    ):
        self.group, self.layout, self.stop, self.wait_timeout_s = group, layout, stop, wait_timeout_s
        slots, rows, columns = layout
        size = slots * rows * columns * 8
        self._file = tempfile.TemporaryFile(dir=SHM_DIR if os.path.isdir(SHM_DIR) else None)
        os.ftruncate(self._file.fileno(), size)
        self._map = mmap.mmap(self._file.fileno(), size)
        self.slots = np.ndarray(layout, dtype=np.int64, buffer=self._map)
        self.connections: dict[int, socket.socket] = {}
        try:
            self._accept(listener, timeout_s)
        finally:
            listener.close()
            if not group.address().startswith("\0"):  # untested: a path outside Linux
                os.unlink(group.address())
        self.published = 0  # batches announced so far
        self.acknowledged = dict.fromkeys(self.connections, 0)  # batches each taker released
        self.waiting_on: int | None = None  # the taker a full ring waits for

    def _accept(self, listener: socket.socket, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.connections) < len(self.group.takers):
            listener.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                connection, _ = listener.accept()
                connection.settimeout(max(deadline - time.monotonic(), 0.001))
                (taker,) = HELLO.unpack(_receive_exactly(connection, HELLO.size))
                socket.send_fds(connection, [LAYOUT.pack(*self.layout)], [self._file.fileno()])
            except (TimeoutError, OSError) as err:
                missing = sorted(set(self.group.takers) - set(self.connections))
                raise DataError(
                    f"data: reader rank {self.group.rank} waited {timeout_s:.0f} s for rank(s) {missing} of "
                    f"its node to connect for shared batches ({err or 'timed out'}); see their logs"
                ) from None
            self.connections[taker] = connection

    def publish(self, position: int, rows: np.ndarray) -> None:
        """Copy `rows` into the next slot once every taker released it, then announce it."""
        slot = self.published % len(self.slots)
        self._wait_for_acks(self.published - len(self.slots) + 1)
        self.slots[slot] = rows
        announcement = ANNOUNCE.pack(slot, position)
        for taker, connection in self.connections.items():
            try:
                connection.sendall(announcement)
            except OSError:
                raise self._lost(taker) from None
        self.published += 1

    def _wait_for_acks(self, count: int) -> None:
        """Until every taker has released at least `count` batches."""
        deadline = None if self.wait_timeout_s is None else time.monotonic() + self.wait_timeout_s
        for taker, connection in self.connections.items():
            self.waiting_on = taker
            connection.settimeout(POLL_S)
            while self.acknowledged[taker] < count:

                def timed_out(taker: int = taker) -> DataError:
                    return DataError(
                        f"data: reader rank {self.group.rank} waited {self.wait_timeout_s:.0f} s for rank "
                        f"{taker} to take its shared batches; that rank is hung or far behind (see its log)"
                    )

                received = _receive(connection, 4096, self.stop, deadline, timed_out)
                if not received:
                    raise self._lost(taker)
                self.acknowledged[taker] += len(received)
        self.waiting_on = None

    def _lost(self, taker: int) -> DataError:
        return DataError(
            f"data: rank {taker} closed its connection to its node's batch reader (rank {self.group.rank}); "
            "it exited or failed (see its log)"
        )

    def waiting_for(self) -> str:
        if self.waiting_on is None:
            return "its read of the shards"
        return f"rank {self.waiting_on} to take its shared batches (the ring of {len(self.slots)} is full)"

    def close(self) -> None:
        if self._map.closed:
            return
        for connection in self.connections.values():
            connection.close()
        self.connections.clear()
        del self.slots
        self._map.close()
        self._file.close()


class RingReader:
    """A taker's end: `take(position)` copies the batch published for that position out of the ring."""

    def __init__(
        self,
        group: ShareGroup,
        layout: tuple[int, int, int],
        stop: threading.Event,
        timeout_s: float,
        wait_timeout_s: float | None,
    ):
        self.group, self.stop, self.wait_timeout_s = group, stop, wait_timeout_s
        self.connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.connection.settimeout(timeout_s)
        try:
            self.connection.connect(group.address())
            self.connection.sendall(HELLO.pack(group.rank))
            message, descriptors, _, _ = socket.recv_fds(self.connection, LAYOUT.size, 1)
        except (TimeoutError, OSError) as err:
            self.connection.close()
            raise DataError(
                f"data: rank {group.rank} could not join its node's batch reader, rank {group.reader} "
                f"({err}); see that rank's log"
            ) from None
        if len(message) != LAYOUT.size or len(descriptors) != 1 or LAYOUT.unpack(message) != layout:
            self.connection.close()
            raise DataError(
                f"data: rank {group.rank} and its node's batch reader, rank {group.reader}, disagree on the "
                f"shared ring ({LAYOUT.unpack(message) if len(message) == LAYOUT.size else message!r} vs "
                f"{layout}); every rank must run with the same data and training settings"
            )
        slots, rows, columns = layout
        self._map = mmap.mmap(descriptors[0], slots * rows * columns * 8)
        os.close(descriptors[0])  # the mapping keeps the memory
        self.slots = np.ndarray(layout, dtype=np.int64, buffer=self._map)
        self.connection.settimeout(POLL_S)
        self._partial = b""  # an announcement cut short by a stop, completed by the next take
        self.waiting_position: int | None = None
        # Batches published for positions this rank did not want yet, oldest first. While the reader and
        # this rank are on different streams (around a checkpoint load) the reader publishes at most its
        # prefetch depth plus the ring ahead of this rank: within 4 x slots unless they are out of step.
        self.early: dict[int, np.ndarray] = {}
        self.max_early = 4 * slots
        # The last batches returned, oldest first: asked for again when the prefetch thread that took one
        # was stopped before handing it over (a checkpoint load), with the reader's announcement used up.
        self.returned: dict[int, np.ndarray] = {}
        self.max_returned = slots

    def take(self, position: int) -> np.ndarray:
        """A copy of the batch for stream `position`: kept from earlier, or the next one published for it
        (keeping those published for other positions meanwhile)."""
        if position in self.early:
            return self._returning(position, self.early.pop(position))
        if position in self.returned:
            return self._returning(position, self.returned.pop(position))
        self.waiting_position = position
        for _ in range(self.max_early + 1):
            slot, published_position = ANNOUNCE.unpack(self._next_announcement())
            rows = np.array(self.slots[slot])
            # A reader gone after publishing needs no ack; its announcements still arrive, then end of file.
            with contextlib.suppress(OSError):
                self.connection.sendall(ACK)
            if published_position == position:
                self.waiting_position = None
                return self._returning(position, rows)
            self.early[published_position] = rows
            if len(self.early) > self.max_early:
                del self.early[next(iter(self.early))]
        raise DataError(
            f"data: rank {self.group.rank} wants the batch at stream position {position} but its node's "
            f"reader, rank {self.group.reader}, published {self.max_early + 1} others (the last at "
            f"{published_position}); the two are out of step (did only some ranks load a checkpoint?)"
        )

    def _returning(self, position: int, rows: np.ndarray) -> np.ndarray:
        """`rows`, noted as the last returned for `position`; the caller gets its own copy."""
        self.returned[position] = rows
        if len(self.returned) > self.max_returned:
            del self.returned[next(iter(self.returned))]
        return rows.copy()

    def _next_announcement(self) -> bytes:
        deadline = None if self.wait_timeout_s is None else time.monotonic() + self.wait_timeout_s
        while len(self._partial) < ANNOUNCE.size:
            received = _receive(
                self.connection,
                ANNOUNCE.size - len(self._partial),
                self.stop,
                deadline,
                lambda: DataError(
                    f"data: rank {self.group.rank} waited {self.wait_timeout_s:.0f} s for the batch at "
                    f"stream position {self.waiting_position} from its node's reader, rank "
                    f"{self.group.reader}; that rank is hung or far behind (see its log)"
                ),
            )
            if not received:
                raise self._lost()
            self._partial += received
        announcement, self._partial = self._partial[: ANNOUNCE.size], b""
        return announcement

    def _lost(self) -> DataError:
        return DataError(
            f"data: rank {self.group.rank} lost its node's batch reader, rank {self.group.reader} (it exited "
            "or failed; see its log)"
        )

    def waiting_for(self) -> str:
        return (
            f"its node's batch reader, rank {self.group.reader}, to publish stream position "
            f"{self.waiting_position}"
        )

    def close(self) -> None:
        if self._map.closed:
            return
        self.connection.close()
        del self.slots
        self._map.close()


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        received = connection.recv(size - len(data))
        if not received:
            raise OSError("the rank closed its connection while joining")
        data += received
    return data
