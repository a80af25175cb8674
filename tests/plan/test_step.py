"""The step model's terms: the bubble, what each overlap hides, stragglers, and FLOPs-to-seconds pieces."""

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

from megascale.config import load_config
from megascale.models.feed_forward import ffn_dim_of
from megascale.plan.compute import block_time, gemm_seconds, keys_per_query
from megascale.plan.hardware import PROFILES
from megascale.plan.job import (
    FP32_WEIGHTS,
    FP32_WEIGHTS_BF16_GATHERS,
    Cluster,
    Features,
    Job,
    Layout,
    layout_from_config,
)
from megascale.plan.step import _pp_seconds, estimate_step
from megascale.plan.systems import MEGASCALE, MEGATRON, TRAINER
from tests.plan.paper import LAYOUT_175B, MODEL_175B, llama, with_ptb_swa

A100 = PROFILES["a100"]
JOB = Job(with_ptb_swa(MODEL_175B), seq_len=2048, global_batch=768)


def estimate(features=MEGASCALE, devices=256, **changes):
    layout = Layout(dp=devices // 64, **{**LAYOUT_175B, **changes})
    return estimate_step(JOB, layout, features, A100, Cluster(devices))


def test_terms_add_up_to_the_step_and_mfu_follows_tokens_per_second():
    step = estimate()
    assert step.step_s == pytest.approx(sum(step.terms_s.values()))
    assert step.tokens_per_s == pytest.approx(768 * 2048 / step.step_s)
    assert 0 < step.mfu < 1


def test_the_bubble_is_pp_minus_one_over_v_micro_batch_times():
    one_f_one_b, interleaved = estimate(virtual_stages=1), estimate(virtual_stages=6)
    assert one_f_one_b.terms_s["bubble"] / interleaved.terms_s["bubble"] == pytest.approx(6, rel=0.05)
    assert estimate(pp=1, tp=8, virtual_stages=1, devices=256).terms_s["bubble"] == 0


def test_a_zero_bubble_v_schedule_leaves_a_third_of_interleaved_1f1bs_bubble():
    """pp - 1 of a micro-batch's 3 v equal parts: 3 of 48 unit actions a rank at pp 4, as torch's ZB-V
    order replayed with unit costs leaves (bench/pipeline_bubble.py)."""
    interleaved, v_shaped = estimate(virtual_stages=2), estimate(virtual_stages=2, zero_bubble=True)
    assert interleaved.terms_s["bubble"] / v_shaped.terms_s["bubble"] == pytest.approx(3, rel=0.05)
    cfg = load_config(
        None, ["--parallel.pp=4", "--parallel.pp_virtual_stages=2", "--parallel.pp_schedule=dualpipev"]
    )
    assert layout_from_config(cfg, 8).zero_bubble and "zb-v" in layout_from_config(cfg, 8).describe()


@pytest.mark.parametrize(
    ("overlap", "term"),
    [("tp_overlap", "tp_exposed"), ("pp_overlap", "pp_exposed"), ("dp_overlap", "dp_exposed")],
)
def test_each_overlap_hides_its_own_communication(overlap, term):
    without = estimate(features=dataclasses.replace(MEGASCALE, **{overlap: False}))
    with_it = estimate(features=MEGASCALE)
    assert with_it.terms_s[term] < without.terms_s[term]
    assert with_it.step_s < without.step_s


def test_stragglers_cost_more_on_more_hosts():
    small = estimate_step(JOB, Layout(dp=4, **LAYOUT_175B), MEGATRON, A100, Cluster(256, 0.005, 0.1))
    large = estimate_step(JOB, Layout(dp=192, **LAYOUT_175B), MEGATRON, A100, Cluster(12288, 0.005, 0.1))
    share = lambda step: step.terms_s["stragglers"] / step.step_s  # noqa: E731
    assert 0 < share(small) < share(large) <= 0.1


def test_a_gemm_earns_efficiency_with_size_and_a_window_caps_keys():
    rate = lambda m, k, n: 2 * m * k * n / gemm_seconds(m, k, n, A100, "bfloat16")  # noqa: E731
    assert rate(256, 256, 512) < rate(8192, 8192, 8192) <= A100.gemm_efficiency * 312e12
    assert keys_per_query(4, None) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert keys_per_query(4, 2) == pytest.approx((1 + 2 + 2 + 2) / 4)


def test_a_thin_gemm_is_bound_by_its_bytes_a_square_one_by_its_flops():
    """The roofline: a router's [tokens, 4096] x [4096, 8] moves its input once for 8 outputs a token, far
    under the A100's ~100 FLOPs a byte; a square 8192^3 GEMM is compute-bound at the large-GEMM rate."""
    overhead_s = A100.gemm_half_flops / (A100.gemm_efficiency * 312e12)
    thin_s = gemm_seconds(65536, 4096, 8, A100, "bfloat16")
    assert thin_s - overhead_s == pytest.approx((65536 * 4096 + 4096 * 8 + 65536 * 8) * 2 / 2039e9)
    square_s = gemm_seconds(8192, 8192, 8192, A100, "bfloat16")
    assert square_s - overhead_s == pytest.approx(2 * 8192**3 / (A100.gemm_efficiency * 312e12))
    # Float8 halves a thin GEMM's input bytes, not its 2-byte output.
    h100 = PROFILES["h100"]
    thin8_s = gemm_seconds(65536, 4096, 8, h100, "float8")
    thin8_s -= h100.gemm_half_flops / (h100.gemm_efficiency * h100.float8_gemm_efficiency * 1979e12)
    assert thin8_s == pytest.approx((65536 * 4096 + 4096 * 8 + 65536 * 8 * 2) / 3350e9)


def test_float8_gemms_reach_their_measured_share_of_the_float8_peak_and_casts_are_torchaos_traffic():
    """A compute-bound float8 GEMM runs at 0.92 of the bf16 curve's fraction of the float8 peak (measured
    on an H200, docs/gpu.md); a float8 block adds, per linear layer, its input cast twice (amax pass, then
    a 2-byte read and a 1-byte write, forward and backward), its output gradient's amax pass and two casts,
    and its weight cast twice: GPT-3 175B's six linear layers (q, k, v, output, fc1, fc2) at tp8, one
    2048-token micro-batch."""
    h100 = PROFILES["h100"]
    rate = 0.68 * 0.92 * 1979e12
    assert gemm_seconds(8192, 8192, 8192, h100, "float8") == pytest.approx((2 * 8192**3 + 2e9) / rate)
    layout = Layout(tp=8, dp=1, sequence_parallel=True)
    h, tokens = 12288, 2048
    shapes = [(h, h // 8)] * 3 + [(h // 8, h), (h, 4 * h // 8), (4 * h // 8, h)]
    cast_bytes = sum(tokens * (10 * n_in + 8 * n_out) + 10 * n_in * n_out for n_in, n_out in shapes)
    bf16 = block_time(dataclasses.replace(JOB, dtype="bfloat16"), layout, h100, fused_kernels=True)
    fp8 = block_time(dataclasses.replace(JOB, dtype="bfloat16", fp8=True), layout, h100, fused_kernels=True)
    assert fp8.elementwise_s - bf16.elementwise_s == pytest.approx(cast_bytes / 3350e9)
    assert fp8.gemm_s < bf16.gemm_s / 1.7


def test_a_float8_all_gather_moves_a_byte_an_element_and_casts_each_ranks_shard_of_the_weights():
    """training.fp8_all_gather: FSDP gathers the float8 layers' weights a byte an element, each of the 8
    ranks casting its eighth before each gather; an MoE model's experts are gathered as they are."""
    from megascale.plan.job import job_from_config

    args = ["--training.dtype=bfloat16", "--training.fp8=tensorwise", "--parallel.dp_shard=8"]
    plain = job_from_config(load_config(None, args))
    gathered = job_from_config(load_config(None, [*args, "--training.fp8_all_gather=true"]))
    assert gathered.fp8_all_gather and gathered.precision.block_gather_bytes == 1
    assert plain.precision.block_gather_bytes == 2
    moe_toml = Path(__file__).resolve().parents[2] / "configs" / "moe.toml"
    moe = job_from_config(load_config(moe_toml, [*args, "--training.fp8_all_gather=true"]))
    assert moe.precision.block_gather_bytes == 2
    h100, layout = PROFILES["h100"], Layout(dp=8, micro_batch=2)
    model = plain.model
    q, kv, ffn = (
        model.dim,
        model.dim * model.attention.n_kv_heads // model.attention.n_heads,
        ffn_dim_of(model),
    )
    weights = model.dim * (q + 2 * kv) + q * model.dim + 3 * model.dim * ffn
    saved_s = (
        block_time(plain, layout, h100, False).elementwise_s
        - block_time(gathered, layout, h100, False).elementwise_s
    )
    assert saved_s == pytest.approx(10 * weights * (1 - 1 / 8) / 3350e9)


def test_under_a_pipeline_fsdp_reduce_scatters_once_a_step_and_zero_3_gathers_once_a_micro_batch():
    """torch's pipelining schedules (megascale's trainer) hold FSDP's gradient sync to the step's end and
    keep the weights gathered through each backward; without a pipeline the trainer syncs every
    micro-batch. Nothing is overlapped in the trainer, so the DP term is all of the traffic."""
    model = load_config(None, []).model

    def dp_s(pp: int, zero_stage: int, micro_batches: int) -> float:
        layout = Layout(pp=pp, dp=2, micro_batch=1, zero_stage=zero_stage, recompute="none")
        job = Job(model, seq_len=256, global_batch=2 * micro_batches, dtype="bfloat16")
        return estimate_step(job, layout, TRAINER, A100, Cluster(2 * pp)).terms_s["dp_exposed"]

    assert dp_s(2, 2, 8) == pytest.approx(dp_s(2, 2, 1))  # one reduce-scatter, one gather a step
    gather_s = dp_s(2, 3, 1) - dp_s(2, 2, 1)  # ZeRO-3's second gather of one micro-batch
    assert gather_s > 0
    assert dp_s(2, 3, 8) - dp_s(2, 3, 1) == pytest.approx(7 * gather_s)
    assert dp_s(1, 2, 8) == pytest.approx(8 * dp_s(1, 2, 1))  # no pipeline: all of it every micro-batch


def test_megascales_trainer_prices_its_attention_at_the_measured_curve_and_flashattention_2_below_it():
    """The trainer calls torch's scaled_dot_product_attention, the kernel the Hopper attention curve was
    measured on (docs/gpu.md), as fast as the fused kernels of `fused_kernels` systems. FlashAttention-2
    runs at 0.62 of that on Hopper (FlashAttention-3 paper, Fig. 5) and is the fastest kernel on Ampere;
    FlashAttention-1 at half FlashAttention-2's speed."""
    job = Job(load_config(None, []).model, seq_len=2048, global_batch=8, dtype="bfloat16")
    layout = Layout(micro_batch=8, recompute="none")

    def attention_s(features, profile):
        return estimate_step(job, layout, features, profile, Cluster(1)).terms_s["attention"]

    h100, a100 = PROFILES["h100"], PROFILES["a100"]
    trainer = attention_s(TRAINER, h100)
    assert trainer == pytest.approx(attention_s(MEGASCALE, h100))
    flash2 = dataclasses.replace(TRAINER, attention_kernel="flash2")
    flash1 = dataclasses.replace(TRAINER, attention_kernel="flash")
    assert attention_s(flash2, h100) == pytest.approx(trainer / 0.62)
    assert attention_s(flash1, h100) == pytest.approx(2 * trainer / 0.62)
    assert attention_s(flash2, a100) == pytest.approx(attention_s(TRAINER, a100))
    assert attention_s(flash1, a100) == pytest.approx(2 * attention_s(flash2, a100))


def test_full_recomputation_costs_a_forward_and_features_off_cost_time():
    assert estimate(recompute="full").terms_s["recompute"] > 0
    assert estimate(recompute="none").terms_s["recompute"] == 0
    assert estimate(features=Features()).step_s > estimate(features=MEGASCALE).step_s


def test_megascales_trainer_syncs_every_micro_batch_but_at_zero_stage_1():
    """Without a pipeline (under one, see the test below)."""
    trainer = dataclasses.replace(MEGASCALE, dp_sync_per_micro_batch=True, dp_overlap=False)
    once = dataclasses.replace(trainer, dp_sync_per_micro_batch=False)
    unpipelined = {"pp": 1, "virtual_stages": 1}
    dp_s = lambda features, stage: estimate(  # noqa: E731
        features, zero_stage=stage, **unpipelined
    ).terms_s["dp_exposed"]
    micro_batches = Layout(dp=4, **{**LAYOUT_175B, **unpipelined}).micro_batches(JOB)
    assert dp_s(trainer, 2) == pytest.approx(micro_batches * dp_s(once, 2))
    assert dp_s(trainer, 1) == pytest.approx(dp_s(once, 1))


def test_bfloat16_gathers_halve_the_blocks_all_gather_bytes_but_not_the_embeddings():
    """ZeRO-3 without overlap, bandwidth-bound: per step one float32 gradient reduce-scatter and two
    weight all-gathers, the blocks' in bfloat16 copies and the embedding and output layer in float32."""
    features = dataclasses.replace(MEGASCALE, dp_overlap=False)
    layout = Layout(dp=64, tp=4, zero_stage=3, micro_batch=1)
    fp32, bf16 = (
        estimate_step(dataclasses.replace(JOB, precision=precision), layout, features, A100, Cluster(256))
        for precision in (FP32_WEIGHTS, FP32_WEIGHTS_BF16_GATHERS)
    )
    model = JOB.model
    vocab = 2 * model.vocab_size * model.dim
    blocks = model.n_layers * (12 * model.dim**2 + 2 * model.dim)
    expected = (4 + 2 * (2 * blocks + 4 * vocab) / (blocks + vocab)) / (4 + 2 * 4)
    assert bf16.terms_s["dp_exposed"] / fp32.terms_s["dp_exposed"] == pytest.approx(expected, rel=0.02)


def test_a_profile_that_measured_tp_with_its_communication_adds_it_per_activation_byte_instead():
    """A CPU's TP probes run gloo's transfers on the cores that compute, so the profile measures what TP
    adds per byte of activations and the model adds no TP communication term of its own."""
    measured = dataclasses.replace(A100, tp_layer_overhead_s_per_byte=1e-12, tp_comm_measured=True)
    counted = estimate()
    with_bytes = estimate_step(JOB, Layout(dp=4, **LAYOUT_175B), MEGASCALE, measured, Cluster(256))
    assert counted.terms_s["tp_exposed"] > 0 and with_bytes.terms_s["tp_exposed"] == 0
    per_block = (
        LAYOUT_175B["micro_batch"] * JOB.seq_len * JOB.model.dim * JOB.precision.activation_bytes * 1e-12
    )
    blocks = with_bytes.micro_batches * JOB.model.n_layers / LAYOUT_175B["pp"]
    added = with_bytes.terms_s["host_dispatch"] - counted.terms_s["host_dispatch"]
    assert added == pytest.approx(blocks * per_block)


def test_a_ring_across_nodes_drives_one_nic_per_rank_it_holds_on_each_node():
    """Data parallelism over every GPU of 8 nodes (8 ranks a node) moves data between nodes at 8 NICs'
    rate; beside 8-way tensor parallelism (one rank of the group a node) at one NIC's."""
    from megascale.plan.comm import group_gather_or_scatter_seconds

    full = 8e9
    every_gpu = group_gather_or_scatter_seconds(full, 1, 64, A100)
    one_per_node = group_gather_or_scatter_seconds(full, 8, 64, A100)
    inside_a_node = group_gather_or_scatter_seconds(full, 1, 8, A100)
    assert one_per_node / every_gpu == pytest.approx(8, rel=0.02)  # less the latency, the same
    # Eight NICs (200 GB/s) are still slower than NVLink (300 GB/s).
    assert inside_a_node < every_gpu


def test_the_update_is_memory_traffic_over_what_each_device_owns():
    """Under ZeRO-3 the optimizer term shrinks with the data-parallel ranks that share the weights; it
    is bytes over HBM bandwidth, no fixed cost per weight."""
    model = Job(MODEL_175B, 2048, 1024).model
    job = Job(model, 2048, 1024)
    terms = [
        estimate_step(job, Layout(8, 8, dp, 1, 1, 3), MEGATRON, A100, Cluster(64 * dp)).terms_s["optimizer"]
        for dp in (4, 16)
    ]
    assert terms[0] / terms[1] == pytest.approx(4, rel=0.05)
    params_per_device = 175e9 / 64
    assert terms[0] < params_per_device * 40 / A100.hbm_bytes_per_s / 2  # ~30 bytes per owned weight


def test_materialised_attention_scores_cost_memory_traffic_and_are_recomputed_under_selective():
    """Megatron-LM before FlashAttention: the [heads, s, s] scores through memory (slower than a flash
    kernel), and selective recomputation redoes the attention core."""
    flash, materialized = MEGATRON, dataclasses.replace(MEGATRON, attention_kernel="materialized")
    plain = estimate(features=materialized, recompute="none")
    selective = estimate(features=materialized, recompute="selective")
    assert plain.terms_s["attention"] > estimate(features=flash, recompute="none").terms_s["attention"]
    assert plain.terms_s["recompute"] == 0
    # The forward again: less than half of forward and backward.
    assert 0.25 < selective.terms_s["recompute"] / plain.terms_s["attention"] < 0.5


def test_materialised_scores_without_dropout_skip_the_dropouts_traffic():
    """Of the 13 + 19 bytes a score element moves each step, 5 + 5 are the dropout's (its read, write and
    mask); a model without dropout moves the rest."""
    from megascale.plan.compute import (
        DROPOUT_SCORE_BYTES,
        MATERIALIZED_BYTES_BACKWARD,
        MATERIALIZED_BYTES_FORWARD,
        attention_seconds,
    )

    layout = Layout(tp=8, micro_batch=1)
    with_dropout = dataclasses.replace(JOB, dropout=True)
    forward, backward = attention_seconds(with_dropout, layout, A100, "materialized")
    forward_dropless, backward_dropless = attention_seconds(JOB, layout, A100, "materialized")
    square_s = (forward - forward_dropless) / DROPOUT_SCORE_BYTES
    assert square_s > 0
    assert backward - backward_dropless == pytest.approx(DROPOUT_SCORE_BYTES * square_s)
    matmuls_s = forward - MATERIALIZED_BYTES_FORWARD * square_s  # the matmuls alone, as the backward's half
    assert backward == pytest.approx(2 * matmuls_s + MATERIALIZED_BYTES_BACKWARD * square_s)


def test_without_sequence_parallelism_a_pipeline_transfer_is_scattered_over_the_tp_ranks():
    no_sp = dict(sequence_parallel=False, virtual_stages=1)
    scattered = estimate(features=MEGATRON, **no_sp).terms_s["pp_exposed"]
    whole = estimate(features=dataclasses.replace(MEGATRON, pp_scatter_gather=False), **no_sp)
    assert whole.terms_s["pp_exposed"] > 4 * scattered


def test_torchtitans_selective_op_checkpointing_recomputes_every_second_matmul_and_the_element_wise_work():
    """Llama 3 8B: of q, k, v, o and the MLP's gate, up and down projections, 'op' recomputes the forward
    of k, o and up (79.7M of the block's 218.1M weights) and every element-wise operator's."""
    from megascale.plan.compute import block_time

    job = Job(llama(4096, 32, 32, 8, 14336, 128256, 8192), seq_len=8192, global_batch=64)
    layout = Layout(dp=64, recompute="op", sequence_parallel=False)
    block = block_time(job, layout, A100, fused_kernels=False, attention_kernel="flash2")
    recomputed = [(4096, 1024), (4096, 4096), (4096, 14336)]
    gemms_s = sum(gemm_seconds(8192, n_in, n_out, A100, "bfloat16") for n_in, n_out in recomputed)
    assert block.recompute_s == pytest.approx(gemms_s + block.elementwise_s / 3)
    assert 0.1 < block.recompute_s / block.gemm_s < 0.15  # against full recomputation's third


def test_megatrons_collectives_per_column_row_pair_follow_sequence_parallelism():
    """With sequence parallelism: all-gather forward, all-gather again and reduce-scatter backward for the
    column-parallel layer, reduce-scatter forward and all-gather backward for the row-parallel one (5).
    Without it: an all-reduce forward and one backward (4). Full recomputation repeats the forward's."""
    from megascale.plan.step import pair_collectives

    assert pair_collectives(JOB, Layout(recompute="selective")) == 5
    assert pair_collectives(JOB, Layout(recompute="full")) == 7
    assert pair_collectives(JOB, Layout(recompute="selective", sequence_parallel=False)) == 4
    assert pair_collectives(JOB, Layout(recompute="full", sequence_parallel=False)) == 6


def megatron_1f1b_order(pp: int, chunks_per_rank: int, micro_batches: int, rank: int):
    """Rank `rank`'s actions, ("F" or "B", stage, micro-batch), in Megatron-LM's 1F1B order (its
    `forward_backward_pipelining_without_interleaving` and `..._with_interleaving`, and torch's Schedule1F1B
    and ScheduleInterleaved1F1B): warm-up forwards, then a forward and a backward in turn, then the rest
    of the backwards; interleaved, p micro-batches a round through each of the rank's chunks."""
    p, v, m = pp, chunks_per_rank, micro_batches
    if v == 1:
        warmup = min(p - rank - 1, m)
    else:
        warmup = m * v if m == p else min(2 * (p - rank - 1) + (v - 1) * p, m * v)

    def action(kind: str, k: int) -> tuple[str, int, int]:
        chunk = k % (p * v) // p
        return kind, rank + p * (v - 1 - chunk if kind == "B" else chunk), k // (p * v) * p + k % p

    order = [action("F", k) for k in range(warmup)]
    for k in range(m * v - warmup):
        order += [action("F", warmup + k), action("B", k)]
    return order + [action("B", k) for k in range(m * v - warmup, m * v)]


class _StubStage:
    """What torch's multi-stage schedules read of a stage to lay out their order."""

    def __init__(self, stage_index: int, num_stages: int, pp: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = stage_index, num_stages, pp, 0
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod, self.has_backward, self.dw_builder = torch.nn.Linear(1, 1), True, None
        self.stage_index_to_group_rank: dict[int, int] = {}


def torch_v_orders(schedule: type, pp: int, micro_batches: int):
    """Every rank's actions, (kind, stage, micro-batch), in torch's order for a V schedule (its own
    `pipeline_order`), a DualPipeV pair of a forward and a backward run one after the other; and which
    rank holds each stage."""
    stages = [_StubStage(0, 2 * pp, pp), _StubStage(2 * pp - 1, 2 * pp, pp)]
    order = schedule(stages, micro_batches, loss_fn=lambda output, target: output.sum()).pipeline_order
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    orders = {}
    for rank, actions in order.items():
        flat = [sub for a in actions if a is not None for sub in (getattr(a, "sub_actions", None) or (a,))]
        orders[rank] = [(kinds[a.computation_type.name], a.stage_index, a.microbatch_index) for a in flat]
    owner = {stage: min(stage, 2 * pp - 1 - stage) for stage in range(2 * pp)}
    return orders, owner


def replayed_step_s(orders, owner, forward_s: float, transfer_s: float) -> float:
    """The makespan of the ranks' `orders` with a chunk's forward taking `forward_s`, its backward twice
    that (an input gradient and a weight gradient, as split, each once), and every transfer between two
    ranks `transfer_s` (asynchronous: a rank computes on while one travels): each rank runs its actions
    in order, each as soon as the rank is free and its inputs have arrived."""
    stages = len(owner)
    costs = {"F": forward_s, "B": 2 * forward_s, "I": forward_s, "W": forward_s}
    done: dict[tuple[str, int, int], float] = {}
    position, free = dict.fromkeys(orders, 0), dict.fromkeys(orders, 0.0)
    while any(position[rank] < len(orders[rank]) for rank in orders):
        progressed = False
        for rank, order in orders.items():
            while position[rank] < len(order):
                kind, stage, micro_batch = order[position[rank]]
                hop = {stage: 0.0, stage - 1: transfer_s, stage + 1: transfer_s}
                hop = {s: 0.0 if owner.get(s) == rank else delay for s, delay in hop.items()}
                if kind == "F":
                    inputs = [(("F", stage - 1, micro_batch), hop[stage - 1])] if stage else []
                elif kind == "W":
                    inputs = [(("I", stage, micro_batch), 0.0)]
                else:
                    inputs = [(("F", stage, micro_batch), 0.0)]
                    if stage < stages - 1:
                        inputs.append((("I", stage + 1, micro_batch), hop[stage + 1]))
                if any(key not in done for key, _ in inputs):
                    break
                start = max([free[rank]] + [done[key] + delay for key, delay in inputs])
                free[rank] = start + costs[kind]
                done[("I" if kind == "B" else kind, stage, micro_batch)] = free[rank]
                position[rank] += 1
                progressed = True
        assert progressed, "the order deadlocked"
    return max(free.values())


def megatron_orders(pp: int, chunks_per_rank: int, micro_batches: int):
    orders = {rank: megatron_1f1b_order(pp, chunks_per_rank, micro_batches, rank) for rank in range(pp)}
    return orders, {stage: stage % pp for stage in range(pp * chunks_per_rank)}


def waited_s(orders_and_owner, forward_s: float, transfer_s: float) -> float:
    """What the transfers add to the replayed makespan."""
    orders, owner = orders_and_owner
    return replayed_step_s(orders, owner, forward_s, transfer_s) - replayed_step_s(
        orders, owner, forward_s, 0.0
    )


@pytest.mark.parametrize(
    ("pp", "virtual_stages", "micro_batches"),
    [(8, 1, 16), (4, 1, 48), (2, 1, 12), (8, 1, 12), (8, 6, 16), (4, 3, 12), (4, 2, 4), (2, 2, 12)],
)
def test_asynchronous_pipeline_transfers_leave_what_the_replayed_schedule_waits_for(
    pp, virtual_stages, micro_batches
):
    """Asynchronous, the step waits for what Megatron's 1F1B order, replayed with the estimate's transfer
    (a micro-batch's 2 v a stage, one a chunk each way) and chunk times, waits for beyond its compute: a
    share of each micro-batch's transfers without interleaving (exactly when the micro-batches fill whole
    rounds of pp, within two transfers otherwise), one micro-batch's path there and back with it."""
    layout = Layout(**{**LAYOUT_175B, "pp": pp, "virtual_stages": virtual_stages, "dp": 2})
    layout = dataclasses.replace(layout, micro_batch=768 // (2 * micro_batches))
    cluster = Cluster(layout.devices)
    overlapped = estimate_step(JOB, layout, MEGASCALE, A100, cluster)
    assert overlapped.micro_batches == micro_batches
    transfer_s = _pp_seconds(JOB, layout, A100, MEGASCALE) / (2 * virtual_stages)
    compute_s = sum(overlapped.terms_s[term] for term in ("gemm", "attention", "elementwise"))
    forward_s = compute_s / (3 * micro_batches * virtual_stages)  # a chunk's, for one micro-batch
    assert transfer_s < forward_s
    waited = waited_s(megatron_orders(pp, virtual_stages, micro_batches), forward_s, transfer_s)
    whole_rounds = virtual_stages > 1 or micro_batches % pp == 0
    tolerance = 1e-6 * waited if whole_rounds else 2 * transfer_s
    assert overlapped.terms_s["pp_exposed"] == pytest.approx(waited, abs=tolerance)


@pytest.mark.parametrize(
    ("pp", "virtual_stages", "micro_batches"), [(4, 5, 32), (3, 8, 12), (8, 2, 16), (4, 2, 64)]
)
def test_a_transfer_longer_than_a_chunks_forward_delays_the_chunks_turns_by_the_excess(
    pp, virtual_stages, micro_batches
):
    """Past a chunk's forward of slack interleaved 1F1B waits in its steady phase too: priced within a
    fifth of the replayed schedule's wait for transfers up to twice a chunk's forward."""
    from megascale.plan.step import _overlapped_pp_seconds

    layout, forward_s = Layout(pp=pp, virtual_stages=virtual_stages), 1.0
    chunk_forward_s = forward_s / virtual_stages
    for transfer_s in (1.5 * chunk_forward_s, 2 * chunk_forward_s):
        priced_s = _overlapped_pp_seconds(layout, micro_batches, 2 * virtual_stages * transfer_s, forward_s)
        waited = waited_s(megatron_orders(pp, virtual_stages, micro_batches), chunk_forward_s, transfer_s)
        assert 0.8 * waited <= priced_s <= 1.2 * waited


@pytest.mark.parametrize("schedule", [ScheduleZBVZeroBubble, ScheduleDualPipeV])
@pytest.mark.parametrize(("pp", "micro_batches"), [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_a_v_schedule_waits_for_one_micro_batchs_way_through_the_ranks_and_back(schedule, pp, micro_batches):
    """torch's ZB-V and DualPipeV orders, replayed with transfers a tenth of a chunk's forward, wait for
    about one micro-batch's way through the V and back, 4 (pp - 1) transfers, once a step: DualPipeV's
    exactly, ZB-V's within max(1, pp - 3) transfers; their bubble is (pp - 1)/6 of a micro-batch's work."""
    from megascale.plan.step import _overlapped_pp_seconds

    chunk_forward_s = 1.0
    transfer_s = chunk_forward_s / 10
    layout = Layout(pp=pp, virtual_stages=2, zero_bubble=True)
    priced_s = _overlapped_pp_seconds(layout, micro_batches, 4 * transfer_s, 2 * chunk_forward_s)
    orders = torch_v_orders(schedule, pp, micro_batches)
    waited = waited_s(orders, chunk_forward_s, transfer_s)
    assert priced_s == pytest.approx(4 * (pp - 1) * transfer_s)
    assert priced_s == pytest.approx(waited, abs=max(1, pp - 3) * transfer_s + 1e-9)
    work_s = micro_batches * 6 * chunk_forward_s  # two chunks a rank, each F + I + W
    bubble = (replayed_step_s(*orders, chunk_forward_s, 0.0) - work_s) / (6 * chunk_forward_s)
    assert bubble == pytest.approx((pp - 1) / 6)


def test_tensor_parallelism_splits_the_mlps_element_wise_work_and_sequence_parallelism_the_rest():
    """Without sequence parallelism every tp rank repeats the LayerNorms and bias-dropout-adds (half the
    passes) but holds 1/tp of the MLP's activations (the other half); with it, all of it is split."""
    from megascale.plan.compute import block_time

    def elementwise(tp: int, sequence_parallel: bool) -> float:
        layout = Layout(tp=tp, dp=1, sequence_parallel=sequence_parallel)
        return block_time(JOB, layout, A100, fused_kernels=False).elementwise_s

    whole = elementwise(1, False)
    assert elementwise(8, False) == pytest.approx(whole * (0.5 + 0.5 / 8))
    assert elementwise(8, True) == pytest.approx(whole / 8)


def test_eager_element_wise_operators_are_counted_operator_by_operator():
    """torch's eager Llama block, per token: two RMSNorms of composite float32 operators and two residual
    adds over the hidden size, RoPE on the queries and keys, the attention's output and SwiGLU over their
    widths; split over tp where the heads and the ffn width are, and the rest only with sequence
    parallelism."""
    from megascale.models.feed_forward import ffn_dim_of
    from megascale.plan import compute

    model = load_config(None, ["--model.dim=64", "--model.attention.n_heads=4"]).model
    q, kv, f = 64, 64 * model.attention.n_kv_heads // 4, ffn_dim_of(model)
    hidden = (2 * compute.EAGER_RMSNORM_BYTES + compute.EAGER_RESIDUAL_BYTES) * 64
    split = compute.EAGER_ROPE_BYTES * (q + kv) + compute.EAGER_ATTENTION_OUTPUT_BYTES * q
    split += compute.EAGER_SWIGLU_BYTES * f
    assert compute.eager_elementwise_bytes(model, 1, 1) == hidden + split
    assert compute.eager_elementwise_bytes(model, 2, 1) == hidden + split / 2
    assert compute.eager_elementwise_bytes(model, 2, 2) == (hidden + split) / 2
    # A GPT block (LayerNorm kernels, GeLU, learned positions) moves less than a Llama block of its size.
    gpt = dataclasses.replace(model, norm="layernorm", mlp="gelu", position="learned")
    assert compute.eager_elementwise_bytes(gpt, 1, 1) < compute.eager_elementwise_bytes(model, 1, 1)


def test_a_system_running_the_block_eagerly_spends_longer_in_element_wise_work():
    job = Job(load_config(None, []).model, seq_len=256, global_batch=8, dtype="bfloat16")
    layout = Layout(micro_batch=2)
    kernels = block_time(job, layout, A100, fused_kernels=False)
    eager = block_time(job, layout, A100, fused_kernels=False, elementwise="eager")
    assert eager.elementwise_s > kernels.elementwise_s and eager.gemm_s == kernels.gemm_s
    fused = block_time(job, layout, A100, fused_kernels=True, elementwise="eager")  # fusing wins
    assert fused.elementwise_s < kernels.elementwise_s


def test_a_data_parallel_overlap_without_a_pipeline_leaves_a_pipelines_traffic_exposed():
    """Megatron-LM of 2021-2022 ran torch's DDP (reduced behind the backward) only without a pipeline and
    its own DDP (reduced after it) with one: a pipelined layout's data-parallel traffic stays whole."""
    only_unpipelined = dataclasses.replace(MEGATRON, dp_overlap=True, dp_overlap_pipelined=False)
    overlapped = dataclasses.replace(MEGATRON, dp_overlap=True)
    pipelined = dict(pp=8, virtual_stages=1, devices=2048)
    assert (
        estimate(features=only_unpipelined, **pipelined).terms_s["dp_exposed"]
        == estimate(features=MEGATRON, **pipelined).terms_s["dp_exposed"]
        > estimate(features=overlapped, **pipelined).terms_s["dp_exposed"]
    )
    unpipelined = dict(pp=1, virtual_stages=1, devices=2048)
    assert (
        estimate(features=only_unpipelined, **unpipelined).terms_s["dp_exposed"]
        == estimate(features=overlapped, **unpipelined).terms_s["dp_exposed"]
        < estimate(features=MEGATRON, **unpipelined).terms_s["dp_exposed"]
    )


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_megatrons_column_parallel_backward_hides_two_collectives_a_pair_behind_its_gemms(sequence_parallel):
    """Megatron-LM's column-parallel backward (from 2021) runs two of a pair's collectives beside that
    layer's input- and weight-gradient GEMMs: with GEMMs longer than the collectives (a serial block's
    two pairs at 175B), the exposed time drops by 2 collectives a pair, computed here by hand."""
    from megascale.plan.comm import gather_or_scatter_seconds
    from megascale.plan.step import pair_collectives

    model = MODEL_175B  # a serial block: attention and MLP, two column/row-parallel pairs
    job = Job(model, seq_len=2048, global_batch=768)
    layout = Layout(
        tp=8, pp=8, dp=4, virtual_stages=1, micro_batch=1, recompute="selective",
        sequence_parallel=sequence_parallel,
    )  # fmt: skip
    backward = dataclasses.replace(MEGATRON, tp_backward_overlap=True)
    plain = estimate_step(job, layout, MEGATRON, A100, Cluster(256))
    hidden = estimate_step(job, layout, backward, A100, Cluster(256))
    collective_s = gather_or_scatter_seconds(2048 * model.dim * 2, 8, A100, cross_node=False)
    blocks_per_micro_batch = model.n_layers // 8
    micro_batches = 768 // 4
    per_block = 2 * pair_collectives(job, layout) * collective_s
    assert plain.terms_s["tp_exposed"] == pytest.approx(micro_batches * blocks_per_micro_batch * per_block)
    assert hidden.terms_s["tp_exposed"] == pytest.approx(
        micro_batches * blocks_per_micro_batch * (per_block - 2 * 2 * collective_s)
    )
    # On a link 1000 times slower each collective outlasts its GEMM, which hides only its own length.
    slow = dataclasses.replace(A100, intra_node_bytes_per_s=A100.intra_node_bytes_per_s / 1000)
    exposed = estimate_step(job, layout, MEGATRON, slow, Cluster(256)).terms_s["tp_exposed"]
    exposed_hidden = estimate_step(job, layout, backward, slow, Cluster(256)).terms_s["tp_exposed"]
    tokens, dim = 2048, model.dim
    attention_gemm_s = 3 * gemm_seconds(tokens, dim, dim // 8, A100, "bfloat16")  # q, k and v
    mlp_gemm_s = gemm_seconds(tokens, dim, 4 * dim // 8, A100, "bfloat16")
    gemms_hiding = 2 if sequence_parallel else 1  # input- and weight-gradient GEMMs, or the latter
    assert exposed - exposed_hidden == pytest.approx(
        micro_batches * blocks_per_micro_batch * gemms_hiding * (attention_gemm_s + mlp_gemm_s)
    )
