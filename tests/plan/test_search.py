"""The layout search: only legal layouts, only those that fit, fastest first, and clear refusals."""

import dataclasses

import pytest

from megascale.errors import ConfigError
from megascale.plan.hardware import PROFILES
from megascale.plan.job import Cluster, Job
from megascale.plan.search import (
    MEMORY_HEADROOM,
    MIN_CONTEXT_POSITIONS,
    NoLayoutFits,
    candidate_layouts,
    fastest_per_split,
    memory_limit_bytes,
    search,
)
from megascale.plan.systems import MEGASCALE, MEGATRON, MEGATRON_CORE
from megascale.plan.validation import DATA, load_table
from tests.plan.paper import MODEL_175B, gpt, with_ptb_swa

A100 = PROFILES["a100"]
JOB = Job(with_ptb_swa(MODEL_175B), seq_len=2048, global_batch=768)


def test_every_plan_fits_in_memory_and_plans_come_fastest_first():
    plans = search(JOB, Cluster(256), A100, MEGASCALE)
    assert plans
    assert all(plan.estimate.memory.total_bytes <= MEMORY_HEADROOM * A100.hbm_bytes for plan in plans)
    times = [plan.estimate.step_s for plan in plans]
    assert times == sorted(times)
    for plan in plans:
        layout = plan.layout
        assert layout.devices == 256 and layout.tp <= A100.devices_per_node
        assert 768 % (layout.dp * layout.micro_batch) == 0


def test_a_smaller_memory_limit_excludes_what_no_longer_fits():
    roomy = search(JOB, Cluster(256), A100, MEGASCALE)
    small = dataclasses.replace(A100, hbm_bytes=40e9)
    tight = search(JOB, Cluster(256), small, MEGASCALE)
    assert len(tight) < len(roomy)
    assert all(plan.estimate.memory.total_bytes <= MEMORY_HEADROOM * 40e9 for plan in tight)


def test_pinned_degrees_are_respected():
    plans = search(JOB, Cluster(256), A100, MEGASCALE, fixed={"tp": 8, "pp": 8})
    assert {(plan.layout.tp, plan.layout.pp) for plan in plans} == {(8, 8)}


def test_nothing_fits_names_the_limit_the_smallest_layout_and_the_fix():
    tiny_memory = dataclasses.replace(A100, hbm_bytes=1e9)
    with pytest.raises(
        ConfigError, match=r"no layout fits 0\.9 GB per device .* optimizer state\): use more --devices$"
    ):
        search(JOB, Cluster(64), tiny_memory, MEGASCALE)


def test_no_legal_layout_says_why():
    with pytest.raises(
        ConfigError, match=r"no legal layout of 256 devices for batch 7: the batch must divide"
    ):
        search(dataclasses.replace(JOB, global_batch=7), Cluster(256), A100, MEGASCALE)


def test_a_pinned_degree_no_layout_takes_is_refused_with_the_degrees_that_are_taken():
    with pytest.raises(
        ConfigError,
        match=r"plan: --tp 3 is not a degree 256 devices can take for this job "
        r"\(these can: 1, 2, 4, 8\): TP divides the devices",
    ):
        search(JOB, Cluster(256), A100, MEGASCALE, fixed={"tp": 3})
    with pytest.raises(
        ConfigError, match=r"--cp 2 is not a degree .* \(these can: 1\): CP is a power of two"
    ):
        search(JOB, Cluster(256), A100, MEGASCALE, fixed={"cp": 2})  # 2,048 positions: too short to split
    with pytest.raises(
        ConfigError, match=r"--tp 8 --pp 64: each is legal alone but no layout of 256 devices"
    ):
        search(JOB, Cluster(256), A100, MEGASCALE, fixed={"tp": 8, "pp": 64})


def test_the_search_offers_only_the_zero_stages_the_system_has():
    """A system without a distributed optimizer (Megatron-LM in 2021) is offered plain data parallelism;
    one without model parallelism (llm-foundry), no TP or PP."""
    plain = dataclasses.replace(MEGASCALE, zero_stages=(0,))
    plans = search(JOB, Cluster(1024), A100, plain)
    assert {plan.layout.zero_stage for plan in plans if plan.layout.dp > 1} == {0}
    assert {plan.layout.zero_stage for plan in search(JOB, Cluster(1024), A100, MEGASCALE)} <= {1, 2, 3}

    small = Job(gpt(2048, 24, 16, 51200, 2048), 2048, 1024)
    fsdp_only = dataclasses.replace(MEGASCALE, model_parallel=False)
    assert {(p.layout.tp, p.layout.pp) for p in search(small, Cluster(256), A100, fsdp_only)} == {(1, 1)}
    assert len({(p.layout.tp, p.layout.pp) for p in search(small, Cluster(256), A100, MEGASCALE)}) > 1


def test_context_parallelism_is_offered_for_long_sequences_only():
    """Each cp rank keeps MIN_CONTEXT_POSITIONS (8,192) of a sequence at least: no cp at 2,048, up to 4
    at 32,768; --cp pins it."""
    short = {plan.layout.cp for plan in search(JOB, Cluster(256), A100, MEGASCALE)}
    long_model = dataclasses.replace(JOB.model, max_seq_len=32768)
    long_job = dataclasses.replace(JOB, model=long_model, seq_len=32768)
    offered = candidate_layouts(long_job, 256, A100, {}, ("none",), MEGASCALE)
    assert short == {1}
    assert MIN_CONTEXT_POSITIONS == 8192 and {layout.cp for layout in offered} == {1, 2, 4}
    assert all(layout.devices == 256 for layout in offered)
    pinned = candidate_layouts(long_job, 256, A100, {"cp": 2}, ("none",), MEGASCALE)
    assert pinned and {layout.cp for layout in pinned} == {2}


def test_the_search_offers_only_the_recomputation_and_sequence_parallelism_the_system_has():
    """Megatron-LM as SC'21 ran it: no sequence parallelism, and every block recomputed."""
    sc21 = load_table(DATA / "sc21-table1.toml").rows[0].features
    plans = search(JOB, Cluster(1024), A100, sc21)
    assert {plan.layout.recompute for plan in plans} == {"full"}
    assert not any(plan.layout.sequence_parallel for plan in plans)
    offered = candidate_layouts(JOB, 1024, A100, {}, ("none", "op"), MEGASCALE)
    assert {layout.recompute for layout in offered} == {"none", "op"}
    assert all(layout.sequence_parallel for layout in offered)


def test_the_search_interleaves_from_the_fewest_stages_the_system_interleaves_over():
    """Megatron-LM of 2021 interleaves from pp 3, Megatron-Core 0.8 from pp 2 (its transfers overlapped):
    on Megatron-Core's 70B row (84 layers, 8 micro-batches over pp 2) the published split tp8 pp2 can then
    run 21 chunks of two layers, which puts it among the search's first five splits."""
    chunks = {
        features.interleaved_min_pp: {
            layout.virtual_stages
            for layout in candidate_layouts(JOB, 1024, A100, {"pp": 2}, ("full",), features)
        }
        for features in (MEGATRON, MEGATRON_CORE)
    }
    assert chunks[3] == {1} and max(chunks[2]) == 48  # 96 layers over 2 stages, down to one a chunk
    rows = load_table(DATA / "megatron-core-r0.8-h100.toml").rows
    row = next(row for row in rows if row.label == "70B tp8 pp2 on 768")
    top = [(plan.layout.tp, plan.layout.pp) for plan in fastest_per_split(row.searched_plans())[:5]]
    assert (8, 2) in top and row.search_agrees()


@pytest.mark.xdist_group("published_tables")  # on the worker that searched them for the docs' test
def test_the_search_finds_a_layout_at_least_as_fast_as_every_published_one_it_could_run(published_tables):
    # Tuned runs use micro-batches that are no power of two (llm-foundry's MPT-7b at 6 a GPU, MPT-1b at
    # 12) and one layer a chunk (NeMo's Llama 2 70B at pp 4, 20 chunks); a published layout that fits the
    # memory model and the search's context-parallel floor is among the candidates, so the pick is never
    # predicted slower than it (activation offload is not searched).
    rows = [row for table in published_tables for row in table.rows]
    slower = []
    for row in rows:
        published, layout = row.predicted, row.layout
        if published.memory.total_bytes > memory_limit_bytes(row.profile, row.gpus):
            continue
        if layout.offload or layout.cp > 1 and row.job.seq_len // layout.cp < MIN_CONTEXT_POSITIONS:
            continue
        try:
            plans = row.searched_plans()
        except NoLayoutFits:
            slower.append((row.label, "no layout fits"))
            continue
        if plans[0].estimate.step_s > published.step_s * (1 + 1e-9):
            slower.append((row.label, plans[0].layout.describe(), plans[0].estimate.step_s, published.step_s))
    assert not slower, slower


def test_each_split_is_listed_once_at_its_fastest():
    plans = search(JOB, Cluster(256), A100, MEGASCALE)
    listed = fastest_per_split(plans)
    assert [plan.split for plan in listed] == list(dict.fromkeys(plan.split for plan in plans))
    for plan in listed:
        assert plan.estimate.step_s == min(p.estimate.step_s for p in plans if p.split == plan.split)
    assert len(listed) < len(plans)
