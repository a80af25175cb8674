"""The shared ring's taker, in one process (the reader's end in a thread): a batch it returned to a
prefetch thread that was then stopped can be taken again after the reader moved on and left."""

from __future__ import annotations

import os
import threading
import uuid

import numpy as np
import pytest

from megascale.data.node_share import RingReader, RingWriter, ShareGroup, _listen
from megascale.errors import DataError

LAYOUT = (4, 2, 5)  # slots, rows, columns


def open_pair() -> tuple[RingWriter, RingReader]:
    """A reader (rank 0) and a taker (rank 1) of one share group, connected."""
    node = f"test-{uuid.uuid4().hex[:8]}"
    writer_group = ShareGroup((0, 1), os.getpid(), 0, node)
    listener = _listen(writer_group)
    opened: list[RingWriter] = []

    def accept() -> None:
        opened.append(RingWriter(writer_group, listener, LAYOUT, threading.Event(), 10.0, 10.0))

    accepting = threading.Thread(target=accept)
    accepting.start()
    reader = RingReader(ShareGroup((0, 1), os.getpid(), 1, node), LAYOUT, threading.Event(), 10.0, 10.0)
    accepting.join(timeout=10.0)
    return opened[0], reader


def batch(position: int) -> np.ndarray:
    return np.full(LAYOUT[1:], position, dtype=np.int64)


def test_a_batch_taken_then_dropped_by_a_stopped_thread_is_taken_again():
    writer, reader = open_pair()
    try:
        for position in (0, 2, 4, 6):
            writer.publish(position, batch(position))
        assert np.array_equal(reader.take(0), batch(0))
        dropped = reader.take(2)  # a prefetch thread took it, then was stopped before handing it over
        dropped[:] = -1  # whatever its taker did with its copy
        writer.close()  # the reader finished its steps and left
        assert np.array_equal(reader.take(2), batch(2))  # the announcement for 2 was used up
        assert np.array_equal(reader.take(4), batch(4))
        assert np.array_equal(reader.take(6), batch(6))
        with pytest.raises(DataError, match="lost its node's batch reader, rank 0"):
            reader.take(8)  # never published: the reader's end of file, named
    finally:
        writer.close()
        reader.close()
