"""Expert load per expert-parallel rank (observe/experts.py): a rank's part of every rank's load from its MoE
layers' counts, the ep ranks' load over the mean, and a real 4-process run with ep 2 whose metrics.jsonl
carries the loads, adding up to the step's routed slots in each expert-parallel group."""

import json

import pytest
import torch

from megascale.config import load_config
from megascale.models.moe import MoE
from megascale.observe.experts import (
    ep_rank_experts,
    ep_rank_load_over_mean,
    expert_slots_by_rank,
    routed_expert_share,
)
from megascale.observe.metrics import read_metrics
from tests.conftest import train_processes

MOE = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=4", "--model.moe.experts=4"]


def test_a_rank_sends_each_member_of_its_group_the_slots_of_that_members_experts():
    cfg = load_config(None, MOE)
    layers = [MoE(cfg.model), MoE(cfg.model)]
    layers[0].load.copy_(torch.tensor([5.0, 1.0, 0.0, 2.0]))
    layers[1].load.copy_(torch.tensor([0.0, 3.0, 4.0, 1.0]))
    # ep 2 over global ranks 4 and 6 of an 8-rank job: rank 4 holds experts 0-1, rank 6 experts 2-3.
    slots = expert_slots_by_rank(layers, [4, 6], 8, torch.device("cpu"))
    assert slots.tolist() == [0, 0, 0, 0, 5 + 1 + 3, 0, 2 + 4 + 1, 0]
    assert expert_slots_by_rank([], [4, 6], 8, torch.device("cpu")).tolist() == [0] * 8  # a dense stage


def test_each_ep_rank_load_sums_its_ranks_over_the_mean():
    # ep 2 x edp 2: ranks 0 and 2 hold experts 0-1, ranks 1 and 3 experts 2-3.
    assert ep_rank_load_over_mean([300, 100, 250, 150], [0, 1, 0, 1]) == [1.375, 0.625]
    assert ep_rank_load_over_mean([0, 0], [0, 1]) == [1.0, 1.0]
    assert ep_rank_experts(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_the_routed_experts_share_of_the_flops():
    assert routed_expert_share(load_config(None, MOE[:3]).model, 32) == 0.0  # dense
    share = routed_expert_share(load_config(None, MOE).model, 32)
    more_experts = routed_expert_share(load_config(None, [*MOE, "--model.moe.top_k=4"]).model, 32)
    assert 0 < share < more_experts < 1


@pytest.mark.slow
def test_an_expert_parallel_run_logs_each_ep_ranks_load(tiny_corpus, tmp_path):
    run_dir = train_processes(
        4,
        tiny_corpus,
        tmp_path,
        "--parallel.dp_shard=4",
        "--parallel.ep=2",
        "--model.moe.experts=4",
        "--training.global_batch_size=8",
        "--training.steps=3",
        "--training.val_every=100",
        "--checkpoint.enabled=false",
        "--metrics.straggler_window=2",  # the detector sees the loads from step 2
        timeout=240,
    )
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    # Each rank's expert-parallel index as it knows it (its coordinates, in its own trace).
    coordinates = {}
    for trace in sorted((run_dir / "traces" / "from-step-00000000").glob("rank-*.json")):
        labels = next(e for e in json.loads(trace.read_text()) if e.get("name") == "process_labels")
        coordinates[int(trace.stem.split("-")[1])] = labels["args"]["coords"]["ep"]
    routed_per_sequence = 32 * 2 * 2  # tokens x top_k x MoE layers
    for record in records:
        assert record["ep_rank_of_rank"] == [coordinates[rank] for rank in range(4)] == [0, 1, 0, 1]
        assert record["ep_rank_experts"] == [[0, 1], [2, 3]]
        slots = record["rank_expert_slots"]
        # Each expert-parallel group (ranks 0-1, ranks 2-3) computes the slots of its 4 sequences.
        assert slots[0] + slots[1] == slots[2] + slots[3] == 4 * routed_per_sequence
        mean = sum(slots) / 2
        assert record["ep_rank_load_over_mean"] == pytest.approx(
            [(slots[0] + slots[2]) / mean, (slots[1] + slots[3]) / mean], abs=1e-4
        )
        assert record["moe_load_max_over_mean"] >= max(record["ep_rank_load_over_mean"]) - 1e-4
