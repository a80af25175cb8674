"""Aligned garbage collection: off between the chosen steps, restored afterwards."""

import gc

from megascale.gc_control import AlignedGC


def test_collection_is_off_inside_and_due_at_every_nth_step():
    assert gc.isenabled()
    with AlignedGC(every=50) as collector:
        assert not gc.isenabled()
        assert [step for step in range(1, 201) if collector.due(step)] == [50, 100, 150, 200]
    assert gc.isenabled()


def test_every_zero_leaves_the_collector_alone():
    with AlignedGC(every=0) as collector:
        assert gc.isenabled() and not collector.due(50)
    assert gc.isenabled()
