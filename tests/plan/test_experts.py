"""The planner's mixture-of-experts terms: active FLOPs, expert memory by ep, the all-to-all's volume and
overlap, the layouts it refuses, and MegaScale-MoE's published comparison."""

import dataclasses
import math
from pathlib import Path

import pytest

from megascale.cli import main
from megascale.config import load_config
from megascale.errors import ConfigError
from megascale.models.flops import flops_per_token, num_params
from megascale.plan.comm import all_to_all_seconds
from megascale.plan.experts import (
    MoEWork,
    busiest_rank_load,
    expected_max_of_normals,
    exposed_all_to_all_seconds,
    layout_problem,
    moe_activation_bytes,
    moe_work,
)
from megascale.plan.hardware import PROFILES
from megascale.plan.job import Cluster, Features, Job, Layout, job_from_config, layout_from_config
from megascale.plan.memory import memory_per_device, stage_param_groups
from megascale.plan.report import config_overrides
from megascale.plan.step import estimate_step
from megascale.plan.validation import DATA, Published, load_table
from tests.plan.paper import MODEL_352B

REPO = Path(__file__).resolve().parents[2]
H800 = PROFILES["h800"]
MODEL = MODEL_352B
JOB = Job(MODEL, 8192, 720)
H, F, E = 4096, 14336, 32


def test_the_352b_model_counts_its_parameters_and_active_flops_by_hand():
    attention = 2 * H * H + 2 * H * 1024
    expert = 3 * H * F
    per_layer = attention + H * E + (E + 1) * expert + 2 * H  # router, 32 routed + 1 shared, two norms
    assert num_params(MODEL) == 60 * per_layer + 2 * 65536 * H + H
    active = 60 * (attention + H * E + (3 + 1) * expert) + 65536 * H
    assert flops_per_token(MODEL, 8192) == 6 * active + 12 * 60 * H * 8192


def test_expert_memory_divides_by_the_expert_parallel_group():
    def experts_per_device(ep: int) -> float:
        layout = Layout(tp=1, pp=15, dp=16, ep=ep, moe_tp="whole", zero_stage=1)
        return stage_param_groups(JOB, layout)[1].params

    assert experts_per_device(1) == 4 * E * 3 * H * F  # 4 of the 60 layers per stage
    assert experts_per_device(8) == experts_per_device(1) / 8
    groups = stage_param_groups(JOB, Layout(tp=1, pp=15, dp=16, ep=8, moe_tp="whole"))
    assert (groups[0].ranks, groups[1].ranks) == (16, 2)  # experts are data-parallel over dp / ep
    spread = memory_per_device(JOB, Layout(tp=1, pp=15, dp=16, ep=8, moe_tp="whole", recompute="full"))
    whole = memory_per_device(JOB, Layout(tp=1, pp=15, dp=16, ep=1, moe_tp="whole", recompute="full"))
    assert spread.weights_bytes < whole.weights_bytes / 4


def test_weights_applied_in_the_experts_activation_keep_no_expert_output():
    """Megatron-Core scales each slot by its router weight inside the SwiGLU, so the combine's backward
    needs no expert output: h fewer elements kept a routed slot, by hand (4 experts of 8 on ep 8, 1,024
    tokens of the tp 8 group's 8,192 each, top-3)."""
    layout = Layout(tp=8, pp=15, dp=2, ep=8, moe_tp="ep", attention="sp", recompute="selective")
    slots = 8192 / 8 * 3
    multiplied = moe_activation_bytes(JOB, layout)
    assert multiplied == 2 * (slots * (2 * H + 3 * F) + 1024 * (3 * F + H))  # with the shared expert
    assert moe_activation_bytes(JOB, layout, weighted_activation=True) == multiplied - 2 * slots * H
    features = Features(moe_tp=("ep",), moe_weighted_activation=True)
    weighted = estimate_step(JOB, layout, features, H800, Cluster(240)).memory.activations_bytes
    assert (
        weighted
        < estimate_step(JOB, layout, Features(moe_tp=("ep",)), H800, Cluster(240)).memory.activations_bytes
    )


def test_an_all_to_all_sends_each_peer_its_share_over_the_link_it_reaches_it_by():
    sent = 64e6
    bandwidth = H800.intra_node_bytes_per_s * H800.network_efficiency
    within = all_to_all_seconds(sent, 8, 1, H800)
    assert within == pytest.approx(H800.intra_node_latency_s + 7 / 8 * sent / bandwidth)
    nic = H800.inter_node_bytes_per_s * H800.network_efficiency
    across = all_to_all_seconds(sent, 16, 1, H800)  # 7 peers on the node, 8 on the other
    assert across == pytest.approx(H800.inter_node_latency_s + 8 / 16 * sent / nic)
    assert all_to_all_seconds(sent, 1, 1, H800) == 0


def test_the_dispatch_moves_each_slot_of_the_ranks_share_of_the_sequence():
    layout = Layout(tp=8, pp=15, dp=2, ep=8, moe_tp="ep", attention="sp")
    work = moe_work(JOB, layout, H800, lambda m, k, n: 0.0)
    slots_bytes = 8192 / 8 * 3 * H * 2  # its 1024 tokens, top-3, bf16, as the busiest rank receives them
    one = all_to_all_seconds(slots_bytes * busiest_rank_load(JOB, layout), 8, 1, H800)
    assert work.all_to_all_s == pytest.approx(4 * one)  # dispatch + combine, forward + backward
    assert work.forward_all_to_all_s == pytest.approx(2 * one)


def test_full_recomputation_repeats_the_forward_exchanges():
    """Dispatch and combine go again in the recomputed forward."""
    layout = Layout(tp=8, pp=15, dp=2, ep=8, moe_tp="ep", attention="sp")

    def exchanged_s(**changes) -> float:
        return moe_work(JOB, dataclasses.replace(layout, **changes), H800, lambda m, k, n: 0.0).all_to_all_s

    none, full = exchanged_s(recompute="none"), exchanged_s(recompute="full")
    assert full == pytest.approx(1.5 * none)


def test_the_busiest_expert_parallel_rank_sets_the_pace_by_its_expected_share_of_independent_routing():
    """8 ranks of 4 experts each, 8,192 tokens a micro-batch each picking 3 of 32: a rank's slots have mean
    3,072 and variance 8,192 x 3 x 1/8 x 7/8 x 29/31; the busiest of 8 exceeds the mean by 1.4236 standard
    deviations of the ranks' loads about their mean (sd / sqrt(7/8))."""
    assert expected_max_of_normals(1) == pytest.approx(0.0, abs=1e-6)
    assert expected_max_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-4)
    assert expected_max_of_normals(8) == pytest.approx(1.4236, abs=1e-4)
    megascale_moe = Layout(tp=8, pp=15, dp=2, ep=8, moe_tp="ep", attention="sp")
    spread = math.sqrt(8192 * 3 * (1 / 8) * (7 / 8) * (29 / 31) / (7 / 8))
    assert busiest_rank_load(JOB, megascale_moe) == pytest.approx(1 + 1.4236 * spread / 3072, rel=1e-4)
    assert 1.02 < busiest_rank_load(JOB, megascale_moe) < 1.03
    # Every rank computing a share of every slot: no rank is busier than another.
    assert busiest_rank_load(JOB, Layout(tp=8, pp=15, dp=2, moe_tp="split")) == 1.0
    # A capacity caps what any expert, and so any rank, takes.
    capped = dataclasses.replace(MODEL, moe=dataclasses.replace(MODEL.moe, capacity_factor=1.01))
    assert busiest_rank_load(dataclasses.replace(JOB, model=capped), megascale_moe) == 1.01
    work = moe_work(JOB, megascale_moe, H800, lambda m, k, n: 2 * m * k * n)
    even = 4 * 3 * 3 * 2 * (3072 / 4) * H * F / H800.grouped_gemm_efficiency  # 4 experts' 3 GEMMs x 3
    assert work.expert_gemm_s == pytest.approx(even * busiest_rank_load(JOB, megascale_moe))


def test_the_overlap_hides_all_but_the_first_chunk_while_the_experts_last():
    long_experts = MoEWork(
        gemm_s=10.0, expert_gemm_s=9.0, other_ops_s=0.0, all_to_all_s=1.0, forward_all_to_all_s=0.5
    )
    assert exposed_all_to_all_seconds(long_experts, "none", 12.0) == 1.0
    assert exposed_all_to_all_seconds(long_experts, "both", 12.0) == pytest.approx(0.25)
    short_experts = dataclasses.replace(long_experts, expert_gemm_s=0.5)
    assert exposed_all_to_all_seconds(short_experts, "both", 12.0) == pytest.approx(0.25 + 0.5)


def test_exchanges_beside_another_micro_batch_hide_behind_its_whole_block():
    """Megatron-Core's combined 1F1B: the forward's dispatch and combine run beside the other
    micro-batch's backward of the block (two thirds of its compute), the backward's beside its forward
    (a third); no chunk is exposed, and the experts' GEMMs alone do not bound what hides."""
    work = MoEWork(gemm_s=1.0, expert_gemm_s=0.5, other_ops_s=0.0, all_to_all_s=4.0, forward_all_to_all_s=2.0)
    assert exposed_all_to_all_seconds(work, "batch", 6.0) == 0.0
    assert exposed_all_to_all_seconds(work, "batch", 2.4) == pytest.approx((2.0 - 1.6) + (2.0 - 0.8))
    assert exposed_all_to_all_seconds(work, "batch", 2.4) < exposed_all_to_all_seconds(work, "both", 2.4)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(ep=3, moe_tp="whole", dp=3), "32 experts do not split over 3 ranks"),
        (dict(ep=4, moe_tp="ep", attention="sp"), "must be a multiple of tp 8"),
        (dict(ep=24, moe_tp="ep", attention="sp"), "ep 24 / tp 8 must divide dp 2"),
        (dict(ep=4, moe_tp="whole", dp=2), "ep 4 must divide dp 2"),
    ],
)
def test_layouts_that_cannot_hold_the_experts_are_refused_naming_why(changes, message):
    layout = Layout(**{**dict(tp=8, pp=15, dp=2), **changes})
    with pytest.raises(ConfigError, match=message):
        estimate_step(JOB, layout, Features(), H800, Cluster(layout.devices))


def test_a_megascale_moe_config_plans_its_own_expert_parallel_layout():
    overrides = ["--parallel.dp_shard=4", "--parallel.ep=2", "--training.micro_batch_size=4"]
    cfg = load_config(REPO / "configs" / "moe.toml", overrides)
    layout = layout_from_config(cfg, 4)
    assert (layout.ep, layout.moe_tp, layout.dp) == (2, "whole", 4)
    estimate = estimate_step(job_from_config(cfg), layout, Features(), PROFILES["h100"], Cluster(4))
    assert estimate.terms_s["ep_exposed"] > 0 and estimate.tokens_per_s > 0


def test_experts_over_the_tp_ranks_plan_as_megascale_moes_layout_and_print_the_trainers_overrides():
    overrides = ["--parallel.tp=2", "--parallel.moe_tp=ep", "--parallel.dp_shard=4", "--parallel.ep=2"]
    cfg = load_config(REPO / "configs" / "moe.toml", [*overrides, "--training.micro_batch_size=4"])
    layout = layout_from_config(cfg, 8)
    assert (layout.ep, layout.moe_tp, layout.attention, layout.dp) == (4, "ep", "tp", 4)
    assert layout_problem(job_from_config(cfg), layout) is None
    printed = config_overrides(layout, "tp-dp-pp", moe=True)
    assert "--parallel.moe_tp=ep --parallel.ep=2" in printed
    assert "not by" in config_overrides(dataclasses.replace(layout, attention="sp"), "tp-dp-pp", moe=True)
    whole = dataclasses.replace(layout, moe_tp="whole")
    estimates = [
        estimate_step(job_from_config(cfg), each, Features(), PROFILES["h100"], Cluster(8))
        for each in (layout, whole)
    ]
    # Each tp rank computes its half of the slots instead of all of them.
    assert estimates[0].terms_s["gemm"] < estimates[1].terms_s["gemm"]


def test_megascale_plan_searches_expert_parallel_layouts_and_prints_their_overrides(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = [
        "plan",
        "--config",
        "configs/moe.toml",
        "--devices",
        "8",
        "--hardware",
        "h100",
        "--system",
        "trainer",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert " ep" in out.split("memory limit")[0]
    assert "--parallel.ep=" in out


def moe_table() -> dict[str, Published]:
    return {row.label: row for row in load_table(DATA / "megascale-moe-table3.toml").rows}


def test_both_systems_throughputs_are_predicted_within_ten_percent_at_every_published_size():
    for row in moe_table().values():
        error = row.step_s / row.predicted.step_s - 1  # predicted over published tokens/s, less one
        print(f"{row.label}: {error:+.1%}")
        assert abs(error) <= 0.10


def test_megascale_moe_beats_megatron_lm_at_every_published_size():
    rows = moe_table()
    for gpus in ("240", "480", "720", "960", "1,440"):
        megatron, megascale = rows[f"Megatron-LM on {gpus}"], rows[f"MegaScale-MoE on {gpus}"]
        assert megatron.predicted.step_s > 1.5 * megascale.predicted.step_s
        assert megascale.predicted.memory.total_bytes <= 0.9 * H800.hbm_bytes
        assert megatron.predicted.memory.total_bytes <= 0.9 * H800.hbm_bytes
