"""Context parallelism in the cost model (megascale/plan/context.py): per-rank work and memory by cp, the
ring's messages against their formula, what the overlap hides, and the layouts it refuses."""

import dataclasses

import pytest

from megascale.errors import ConfigError
from megascale.plan.comm import send_seconds
from megascale.plan.compute import block_time
from megascale.plan.context import (
    RING_BUFFERS,
    exposed_ring_seconds,
    ring_buffer_bytes,
    ring_message_bytes,
    ring_messages,
    ring_transfer_seconds,
)
from megascale.plan.hardware import PROFILES
from megascale.plan.job import Cluster, Job, Layout
from megascale.plan.memory import activation_bytes_per_block, memory_per_device, stage_param_groups
from megascale.plan.step import estimate_step
from megascale.plan.systems import MEGASCALE, TRAINER
from tests.plan.paper import MODEL_352B, llama

H100 = PROFILES["h100"]
# Llama 3 8B (8 key-value heads of 128) at 32,768 positions, 8 sequences a step.
JOB = Job(llama(4096, 32, 32, 8, 14336, 128256, 32768), seq_len=32768, global_batch=8)
NO_CP_OVERLAP = dataclasses.replace(MEGASCALE, cp_overlap=False)


def layout(cp: int, **changes) -> Layout:
    """Tensor parallelism over a node, 8 sequences over 8 // cp data-parallel ranks and cp ring ranks."""
    return Layout(**{**dict(tp=8, dp=8 // cp, cp=cp, recompute="none"), **changes})


def step(cp: int, features=MEGASCALE, **changes):
    chosen = layout(cp, **changes)
    return estimate_step(JOB, chosen, features, H100, Cluster(chosen.devices))


def test_without_context_parallelism_the_predictions_are_the_ones_published_before():
    """cp = 1 adds no term, byte or message."""
    assert step(1).terms_s["cp_exposed"] == 0 and ring_messages(JOB, layout(1)) == 0
    assert ring_buffer_bytes(JOB, layout(1)) == 0


def test_cp_ranks_each_compute_about_their_share_and_keep_their_share_of_activations():
    one, two = layout(1), layout(2)
    whole, half = block_time(JOB, one, H100, True), block_time(JOB, two, H100, True)
    # Half the causal work (the chunks balance it), in two ring steps' kernels, each a quarter of the
    # whole attention's and so a little less efficient on a Hopper.
    assert 0.5 < half.attention_s / whole.attention_s < 0.6
    assert half.elementwise_s == pytest.approx(whole.elementwise_s / 2)
    assert 0.5 <= half.gemm_s / whole.gemm_s < 0.55  # smaller GEMMs earn a little less
    assert activation_bytes_per_block(JOB, two) == activation_bytes_per_block(JOB, one) / 2
    ratio = memory_per_device(JOB, two).activations_bytes / memory_per_device(JOB, one).activations_bytes
    assert 0.5 < ratio < 0.55  # the ring's buffers on top


def test_the_weights_data_parallel_group_is_dp_times_cp_ranks():
    """ZeRO shards and gradient reduction span the cp ranks too: dp 4 x cp 2 holds what dp 8 does."""
    (group,) = stage_param_groups(JOB, layout(2))
    assert group.ranks == 8 and layout(2).fsdp_ranks == 8
    state = lambda chosen: memory_per_device(JOB, chosen).optimizer_bytes  # noqa: E731
    assert state(layout(2)) == state(layout(1))
    assert step(2).terms_s["dp_exposed"] == pytest.approx(step(1).terms_s["dp_exposed"], rel=0.05)


def test_a_ring_message_and_the_messages_per_layer_follow_the_formula():
    four = layout(4)
    # Keys and values stacked: 2 x (32,768 / 4) positions x (8 / 8) kv heads x 128 x 1 sequence x 2 bytes.
    assert ring_message_bytes(JOB, four) == 2 * 8192 * 1 * 128 * 1 * 2
    assert ring_messages(JOB, four) == (4 - 1) + (4 - 1) + 4  # forward; backward's keys and values, gradients
    assert ring_messages(JOB, layout(4, recompute="full")) == 2 * (4 - 1) + (4 - 1) + 4
    message_s = send_seconds(ring_message_bytes(JOB, four), H100, cross_node=True)  # tp 8: a node each
    assert ring_transfer_seconds(JOB, four, H100) == message_s
    blocks = JOB.model.n_layers
    assert step(4, NO_CP_OVERLAP).terms_s["cp_exposed"] == pytest.approx(
        four.micro_batches(JOB) * blocks * ring_messages(JOB, four) * message_s
    )
    activations = lambda chosen: memory_per_device(JOB, chosen).activations_bytes  # noqa: E731
    ring_bytes = activations(four) - activations(layout(1)) / 4  # a quarter of the rest, and the messages
    assert ring_bytes == pytest.approx(RING_BUFFERS * ring_message_bytes(JOB, four))


def test_the_overlap_hides_the_ring_behind_attention_but_the_gradients_last_hop():
    for cp in (2, 4, 8):
        hidden = exposed_ring_seconds(JOB, layout(cp), H100, MEGASCALE)
        waited = exposed_ring_seconds(JOB, layout(cp), H100, NO_CP_OVERLAP)
        assert 0 < hidden <= waited
        # At 32,768 positions every ring step's blocks outlast its transfers.
        assert hidden == pytest.approx(ring_transfer_seconds(JOB, layout(cp), H100))
    assert step(4).step_s < step(4, NO_CP_OVERLAP).step_s


def test_a_ring_inside_a_node_is_faster_than_one_across_nodes():
    inside, across = layout(4, tp=2, dp=4), layout(4, tp=8, dp=1)
    per_kv_head = lambda chosen: (  # noqa: E731
        ring_transfer_seconds(JOB, chosen, H100) / ring_message_bytes(JOB, chosen)
    )
    assert per_kv_head(inside) < per_kv_head(across)


@pytest.mark.parametrize(
    ("job", "chosen", "message"),
    [
        (dataclasses.replace(JOB, seq_len=32766), layout(2), "does not split into 2 x cp = 4 equal chunks"),
        (JOB, layout(2, attention="sp"), "beside sequence-parallel attention"),
        (
            Job(MODEL_352B, 8192, 8),
            layout(2, tp=2, dp=2, moe_tp="ep", ep=2),
            "moe_tp 'ep' beside context parallelism",
        ),
        (Job(MODEL_352B, 8192, 8), layout(2, tp=1, dp=4, ep=16, moe_tp="whole"), "dp 4 x cp 2"),
    ],
)
def test_layouts_context_parallelism_cannot_run_are_refused(job, chosen, message):
    with pytest.raises(ConfigError, match=message):
        estimate_step(job, chosen, MEGASCALE, H100, Cluster(chosen.devices))


MOE_JOB = Job(MODEL_352B, 8192, 8)


def moe_step(cp: int, ep: int = 1):
    """The 352B MoE model over 8 GPUs, one sequence per rank pair: dp x cp = 8 // tp ranks."""
    chosen = Layout(tp=1, pp=1, dp=8 // cp, cp=cp, ep=ep, moe_tp="whole", recompute="full", zero_stage=3)
    return estimate_step(MOE_JOB, chosen, NO_CP_OVERLAP, H100, Cluster(chosen.devices))


def test_an_moe_layer_beside_context_parallelism_computes_and_sends_its_ranks_tokens_only():
    """Each cp rank routes its own positions: the experts' GEMMs and the all-to-all's bytes divide by cp,
    and expert parallelism spans the dp x cp ranks that hold the same weights."""
    from megascale.plan.experts import busiest_rank_load, moe_work, slots_computed, tokens_in

    def layout_of(cp: int, ep: int = 8) -> Layout:
        return Layout(tp=1, dp=8 // cp, cp=cp, ep=ep, moe_tp="whole", recompute="full")

    assert tokens_in(MOE_JOB, layout_of(2)) == tokens_in(MOE_JOB, layout_of(1)) / 2 == 4096
    assert slots_computed(MOE_JOB, layout_of(4)) == 2048 * 3

    def work(cp: int):
        # seconds = FLOPs: the work
        return moe_work(MOE_JOB, layout_of(cp), H100, lambda m, k, n: 2 * m * k * n)

    # The busiest rank's share of the slots grows a little as each rank routes fewer tokens.
    ratio = busiest_rank_load(MOE_JOB, layout_of(2)) / busiest_rank_load(MOE_JOB, layout_of(1))
    assert 1 < ratio < 1.01
    assert work(2).expert_gemm_s == pytest.approx(work(1).expert_gemm_s / 2 * ratio)
    assert work(2).all_to_all_s == pytest.approx(work(1).all_to_all_s / 2 * ratio, rel=0.01)
    # Experts over 8 ranks of dp 4 x cp 2: each holds 4 of 32, data-parallel over none.
    experts = stage_param_groups(MOE_JOB, layout_of(2))[1]
    assert (experts.ranks, experts.params) == (1, 60 * 4 * 3 * 4096 * 14336)
    assert moe_step(2, ep=8).step_s < moe_step(1, ep=8).step_s * 1.05  # the same work, split otherwise
    assert moe_step(2).terms_s["cp_exposed"] > 0


def test_the_search_offers_context_parallelism_to_an_moe_model_beside_experts_over_data_parallel_ranks():
    from megascale.plan.search import candidate_layouts

    model = dataclasses.replace(MODEL_352B, max_seq_len=32768)
    offered = candidate_layouts(Job(model, 32768, 8), 32, H100, {}, ("full",), TRAINER)
    with_cp = [chosen for chosen in offered if chosen.cp > 1]
    assert {chosen.cp for chosen in with_cp} == {2, 4}
    assert {chosen.moe_tp for chosen in with_cp} == {"whole"}  # the trainer refuses moe_tp 'ep' with cp
    assert any(chosen.ep > chosen.dp for chosen in with_cp)  # experts over the dp x cp ranks
