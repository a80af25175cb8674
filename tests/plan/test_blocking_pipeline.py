"""Blocking pipelines priced as their own orders wait: DeepSpeed's engine, every send and receive a call
of its own, and Megatron-LM's 1F1B, each send batched with the receive it waits for. The orders replayed
here, call by call, are the independent reference."""

import dataclasses

import pytest

from megascale.plan.hardware import PROFILES
from megascale.plan.job import MEGATRON, Cluster, Job, Layout
from megascale.plan.paper import MODEL_175B
from megascale.plan.step import _pp_exposed_seconds, _pp_seconds, _sequential_pp_seconds, estimate_step
from megascale.plan.validation import bloom

A100 = PROFILES["a100"]
JOB = Job(MODEL_175B, seq_len=2048, global_batch=768)

Call = tuple  # ("F" or "B", micro-batch), or ("x", messages): ("send" or "recv", neighbour stage) each


def deepspeed_train_order(stages: int, micro_batches: int, stage: int) -> list[Call]:
    """Stage `stage`'s calls in DeepSpeed's `TrainSchedule` (deepspeed/runtime/pipe/schedule.py), each
    send and receive a call of its own: 2 (m + p - 1) steps; on even steps even stages run a forward and
    odd stages a backward, on odd steps the other way round; before a forward a stage receives its
    activation and sends the gradient of the micro-batch of its previous step, before a backward it sends
    that micro-batch's activation and receives its gradient."""
    p, m, s = stages, micro_batches, stage
    calls: list[Call] = []
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
            calls += [("x", (("recv", s - 1),))] if valid else []
            calls += [("x", (("send", s - 1),))] if was_valid else []
        if not forward and s < p - 1:
            calls += [("x", (("send", s + 1),))] if was_valid else []
            calls += [("x", (("recv", s + 1),))] if valid else []
        calls += [("F" if forward else "B", micro_batch)] if valid else []
        previous = micro_batch
    return calls


def megatron_blocking_order(stages: int, micro_batches: int, stage: int) -> list[Call]:
    """Stage `stage`'s calls in Megatron-LM's 1F1B without interleaving (2021's
    `forward_backward_pipelining_without_interleaving`), its exchanges batched (`batch_isend_irecv`, then
    a wait): warm-up forwards each between a receive and a send; then, a forward, the activation sent
    beside the gradient received, a backward, the gradient sent beside the next activation received; then
    the remaining backwards. The first stage has no one before it, the last no one after."""
    p, m, s = stages, micro_batches, stage

    def exchange(*messages) -> list[Call]:
        kept = tuple(message for message in messages if 0 <= message[1] < p)
        return [("x", kept)] if kept else []

    warmup = min(p - s - 1, m)
    calls: list[Call] = []
    for k in range(warmup):
        calls += exchange(("recv", s - 1)) + [("F", k)] + exchange(("send", s + 1))
    calls += exchange(("recv", s - 1)) if m > warmup else []
    for k in range(m - warmup):
        calls += [("F", warmup + k)] + exchange(("send", s + 1), ("recv", s + 1)) + [("B", k)]
        last = k == m - warmup - 1
        calls += exchange(("send", s - 1)) if last else exchange(("send", s - 1), ("recv", s - 1))
    for k in range(m - warmup, m):
        calls += exchange(("recv", s + 1)) + [("B", k)] + exchange(("send", s - 1))
    return calls


def replayed_makespan(orders: list[list[Call]], forward_s: float, backward_s: float, transfer_s: float):
    """Every stage runs its calls in turn. A send and the receive it matches (in order, between the same
    two stages, the same way) both finish `transfer_s` after the later of the two reaches it; a call
    returns when all its messages have finished."""
    partners: dict[tuple[int, int], list[tuple[int, int]]] = {}
    sends: dict[tuple[int, int], list[tuple[int, int]]] = {}
    receives: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for stage, calls in enumerate(orders):
        for index, (kind, messages) in enumerate(calls):
            for way, other in messages if kind == "x" else ():
                channel = (stage, other) if way == "send" else (other, stage)
                (sends if way == "send" else receives).setdefault(channel, []).append((stage, index))
    for channel, sent in sends.items():
        assert len(sent) == len(receives[channel]), channel
        for send, receive in zip(sent, receives[channel]):
            partners.setdefault(send, []).append(receive)
            partners.setdefault(receive, []).append(send)
    position, clock, reached = [0] * len(orders), [0.0] * len(orders), {}
    while any(position[s] < len(calls) for s, calls in enumerate(orders)):
        progressed = False
        for s, calls in enumerate(orders):
            while position[s] < len(calls):
                kind = calls[position[s]][0]
                if kind in ("F", "B"):
                    clock[s] += forward_s if kind == "F" else backward_s
                else:
                    here = (s, position[s])
                    reached.setdefault(here, clock[s])
                    if any(partner not in reached for partner in partners[here]):
                        break
                    clock[s] = max(reached[here], *(reached[partner] for partner in partners[here]))
                    clock[s] += transfer_s
                position[s] += 1
                progressed = True
        assert progressed, "the order deadlocked"
    return max(clock)


def waited(order, stages: int, micro_batches: int, forward_s: float, backward_s: float, transfer_s: float):
    """What the transfers add to the replayed makespan of `order`'s calls on every stage."""
    orders = [order(stages, micro_batches, stage) for stage in range(stages)]
    return replayed_makespan(orders, forward_s, backward_s, transfer_s) - replayed_makespan(
        orders, forward_s, backward_s, 0.0
    )


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
        replayed = waited(deepspeed_train_order, stages, micro_batches, forward_s, backward_s, transfer_s)
        assert priced_s == pytest.approx(replayed)


def test_blooms_deepspeed_pipeline_waits_for_its_transfers_one_call_at_a_time():
    """BLOOM's row (12 stages, 128 micro-batches, DeepSpeed's engine): the step's pipeline term is its
    replayed order's wait at the row's own transfer time, and none of it rides in the bubble."""
    row = bloom()[0]
    estimate, paired = row.predict(), estimate_with_exchange(row, "paired")
    m, stages = estimate.micro_batches, row.layout.pp
    transfer_s = _pp_seconds(row.job, row.layout, row.source.profile, row.source.features) / 2
    replayed = waited(deepspeed_train_order, stages, m, 1.0, 3.0, transfer_s)
    assert estimate.terms_s["pp_exposed"] == pytest.approx(replayed)
    assert estimate.terms_s["pp_exposed"] > 1.9 * paired.terms_s["pp_exposed"]
    assert estimate.terms_s["bubble"] < paired.terms_s["bubble"]


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("micro_batches", [1, 2, 5, 16])
def test_megatrons_paired_exchanges_wait_for_two_transfers_a_turn_and_one_between_two_stages(
    stages, micro_batches
):
    """Megatron-LM's blocking 1F1B, each send batched with the receive it waits for: each micro-batch's turn
    through a stage (m + p - 1 of them, the bubble's included) waits for two transfers, one where the
    pipeline has two stages, each with one neighbour: within three transfers of its replayed order's
    wait, exactly at two stages."""
    layout = Layout(pp=stages)
    transfer_s = _pp_seconds(JOB, layout, A100, MEGATRON) / 2
    per_turn_s = _pp_exposed_seconds(JOB, layout, A100, MEGATRON, micro_batches, forward_s=1.0)
    priced_s = per_turn_s * (micro_batches + stages - 1)
    replayed = waited(megatron_blocking_order, stages, micro_batches, 1.0, 3.0, transfer_s)
    assert priced_s == pytest.approx(replayed, abs=(1e-9 if stages == 2 else 3.001) * transfer_s)
