"""A blocking pipeline priced as its order waits: Megatron-LM's 1F1B, each send batched with the receive it
waits for. The order replayed here, call by call, is the independent reference."""

import pytest

from megascale.plan.hardware import PROFILES
from megascale.plan.job import Job, Layout
from megascale.plan.step import _pp_exposed_seconds, _pp_seconds
from megascale.plan.systems import MEGATRON
from tests.plan.paper import MODEL_175B

A100 = PROFILES["a100"]
JOB = Job(MODEL_175B, seq_len=2048, global_batch=768)

Call = tuple  # ("F" or "B", micro-batch), or ("x", messages): ("send" or "recv", neighbour stage) each


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
