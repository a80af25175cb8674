"""A pipeline whose sends and receives block, one call at a time (DeepSpeed's pipeline engine), priced as
its own order waits: the order replayed here, call by call, is the independent reference."""

import dataclasses

import pytest

from megascale.plan.job import Cluster, Layout
from megascale.plan.step import _sequential_pp_seconds, estimate_step
from megascale.plan.validation import bloom


def deepspeed_train_order(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """Stage `stage`'s calls in DeepSpeed's `TrainSchedule` (deepspeed/runtime/pipe/schedule.py): 2 (m + p
    - 1) steps; on even steps even stages run a forward and odd stages a backward, on odd steps the other
    way round; before a forward a stage receives its activation and sends the gradient of the micro-batch
    of its previous step, before a backward it sends that micro-batch's activation and receives its
    gradient. Calls: ("recv" or "send", neighbour stage) or ("F" or "B", micro-batch)."""
    p, m, s = stages, micro_batches, stage
    calls: list[tuple[str, int]] = []
    previous = -1
    for step in range(2 * (m + p - 1)):
        forward = step % 2 == s % 2
        if forward:
            micro_batch = (step if step % 2 == 0 else step - 1) // 2 - s // 2
        elif step % 2 == 0:
            micro_batch = step // 2 - p + (s + 1) // 2
        else:
            micro_batch = (step - 1) // 2 - p + 1 + s // 2
        valid, was_valid = 0 <= micro_batch < m, 0 <= previous < m
        if forward and s > 0:
            calls += [("recv", s - 1)] if valid else []
            calls += [("send", s - 1)] if was_valid else []
        if not forward and s < p - 1:
            calls += [("send", s + 1)] if was_valid else []
            calls += [("recv", s + 1)] if valid else []
        calls += [("F" if forward else "B", micro_batch)] if valid else []
        previous = micro_batch
    return calls


def replayed_makespan(
    stages: int, micro_batches: int, forward_s: float, backward_s: float, transfer_s: float
):
    """Every stage runs its calls in turn; a send and the receive it matches (in order, between the same
    two stages, the same way) both finish `transfer_s` after the later of the two reaches it."""
    orders = [deepspeed_train_order(stages, micro_batches, s) for s in range(stages)]
    position, clock = [0] * stages, [0.0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, other = orders[s][position[s]]
                if kind in ("F", "B"):
                    clock[s] += forward_s if kind == "F" else backward_s
                    position[s] += 1
                    progressed = True
                    continue
                matching = ("recv" if kind == "send" else "send", s)
                if position[other] >= len(orders[other]) or orders[other][position[other]] != matching:
                    break
                clock[s] = clock[other] = max(clock[s], clock[other]) + transfer_s
                position[s] += 1
                position[other] += 1
                progressed = True
        assert progressed, "the order deadlocked"
    return max(clock)


def estimate_with_exchange(row, exchange: str):
    features = dataclasses.replace(row.source.features, pp_exchange=exchange)
    return estimate_step(row.job, row.layout, features, row.source.profile, Cluster(row.gpus))


@pytest.mark.parametrize("stages", [2, 3, 4, 7, 12])
@pytest.mark.parametrize("micro_batches", [1, 2, 5, 16, 37])
def test_one_blocking_call_at_a_time_waits_for_every_transfer_of_a_micro_batch(stages, micro_batches):
    """Four transfers of each micro-batch through a stage with two neighbours, two with one, whatever the
    forward, backward and transfer times: the replayed order's wait, exactly."""
    transfer_s = 0.25
    priced_s = _sequential_pp_seconds(Layout(pp=stages), micro_batches, 2 * transfer_s)
    for forward_s, backward_s in ((1.0, 2.0), (1.0, 3.0), (1.3, 2.1)):
        waited = replayed_makespan(stages, micro_batches, forward_s, backward_s, transfer_s)
        waited -= replayed_makespan(stages, micro_batches, forward_s, backward_s, 0.0)
        assert priced_s == pytest.approx(waited)


def test_blooms_deepspeed_pipeline_waits_for_its_transfers_one_call_at_a_time():
    """BLOOM's row (12 stages, 128 micro-batches, DeepSpeed's engine): the step's pipeline term is its
    replayed order's wait at the row's own transfer time, and none of it rides in the bubble."""
    row = bloom()[0]
    estimate, paired = row.predict(), estimate_with_exchange(row, "paired")
    m, stages = estimate.micro_batches, row.layout.pp
    transfer_s = paired.terms_s["pp_exposed"] / (2 * m)  # paired: two transfers a micro-batch's turn
    waited = replayed_makespan(stages, m, 1.0, 3.0, transfer_s) - replayed_makespan(stages, m, 1.0, 3.0, 0.0)
    assert estimate.terms_s["pp_exposed"] == pytest.approx(waited)
    assert estimate.terms_s["pp_exposed"] > 1.9 * paired.terms_s["pp_exposed"]
    assert estimate.terms_s["bubble"] < paired.terms_s["bubble"]
