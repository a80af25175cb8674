"""Uneven pipeline stages: the planner prices the busiest rank as megascale's trainer splits the layers."""

import dataclasses

import pytest

from megascale.errors import ConfigError
from megascale.plan.hardware import PROFILES
from megascale.plan.job import Cluster, Job, Layout
from megascale.plan.stages import RankShare, rank_shares
from megascale.plan.step import estimate_step
from megascale.plan.systems import MEGASCALE, MEGATRON, TRAINER
from tests.plan.paper import llama

LLAMA_405B = Job(llama(16384, 126, 128, 8, 53248, 128256, 8192), seq_len=8192, global_batch=2048)
H100 = PROFILES["h100"]


def test_a_uniform_split_gives_the_earlier_stages_the_remainder():
    shares = rank_shares(LLAMA_405B, Layout(tp=8, pp=16, dp=64))
    assert [share.blocks for share in shares] == [8] * 14 + [7] * 2
    assert [share.output for share in shares] == [False] * 15 + [True]


def test_a_params_split_takes_a_layer_off_the_first_and_last_stage_as_llama_3_ran_405b():
    """Llama 3 (arXiv 2407.21783 §3.3.2): 126 layers over 16 stages, one fewer on the first and the last,
    whose embedding and output layer (2.1B weights each, 0.66 of a block) balance them."""
    shares = rank_shares(LLAMA_405B, Layout(tp=8, pp=16, dp=64, virtual_stages=2, stage_split="params"))
    assert [share.blocks for share in shares] == [7] + [8] * 14 + [7]


def test_a_v_schedule_puts_the_output_layer_on_rank_0():
    shares = rank_shares(LLAMA_405B, Layout(tp=8, pp=16, dp=64, virtual_stages=2, zero_bubble=True))
    assert shares[0].output and not any(share.output for share in shares[1:])


def test_the_step_runs_at_the_busiest_ranks_pace_not_an_average():
    """126 blocks over 16 stages cost 8 blocks a micro-batch (the busiest rank holds no output layer), as
    128 over 16 do, not 126/16 = 7.875 plus the output layer."""
    layout = Layout(tp=8, pp=16, dp=64, recompute="none")
    uneven = estimate_step(LLAMA_405B, layout, MEGASCALE, H100, Cluster(8192))
    even_model = dataclasses.replace(LLAMA_405B.model, n_layers=128)
    even = estimate_step(
        dataclasses.replace(LLAMA_405B, model=even_model), layout, MEGASCALE, H100, Cluster(8192)
    )
    assert uneven.terms_s["gemm"] == pytest.approx(even.terms_s["gemm"])
    assert uneven.terms_s["output_layer"] == 0 < even.terms_s["output_layer"]


def test_more_stages_than_layers_are_refused_in_one_line():
    small = dataclasses.replace(LLAMA_405B, model=dataclasses.replace(LLAMA_405B.model, n_layers=12))
    with pytest.raises(ConfigError, match="16 pipeline stages for model.n_layers = 12"):
        rank_shares(small, Layout(tp=8, pp=8, dp=1, virtual_stages=2))
    assert rank_shares(small, Layout(pp=12)) == [RankShare(1, False)] * 11 + [RankShare(1, True)]


def test_a_configs_pp_split_reaches_the_layout_and_the_overrides():
    from megascale.config import load_config
    from megascale.plan.job import layout_from_config
    from megascale.plan.report import config_overrides

    cfg = load_config(None, ["--model.n_layers=5", "--parallel.pp=2", "--parallel.pp_split=params"])
    layout = layout_from_config(cfg, 2)
    assert layout.stage_split == "params" and "split=params" in layout.describe()
    assert "--parallel.pp_split=params" in config_overrides(layout, "tp-dp-pp", False, True)


def test_the_search_tries_uneven_stages_and_interleaving_only_for_a_system_that_runs_them():
    from megascale.plan.search import candidate_layouts

    job = dataclasses.replace(LLAMA_405B, model=dataclasses.replace(LLAMA_405B.model, n_layers=126))

    def pipelines(features) -> set[tuple[int, int]]:
        layouts = candidate_layouts(job, 1024, H100, {"tp": 8}, ("none",), features)
        return {(layout.pp, layout.virtual_stages) for layout in layouts}

    assert {(4, 1), (16, 2), (8, 8)} <= pipelines(MEGASCALE)  # 126 layers over 4, 32 and 64 stages
    evenly = dataclasses.replace(MEGATRON, interleaved_min_pp=2)  # were Megatron-LM to interleave 2 stages
    assert (4, 1) not in pipelines(evenly) and (2, 7) in pipelines(evenly)  # 126 = 2 x 7 x 9
    # Megatron-LM interleaves over more than 2 stages only; DeepSpeed's pipeline engine never does.
    assert pipelines(MEGATRON) == {(1, 1), (2, 1)}
    assert {(2, 2), (4, 2)} <= pipelines(TRAINER)
    assert {v for _, v in pipelines(dataclasses.replace(MEGASCALE, interleaved_min_pp=None))} == {1}
