"""The rules megascale documents for refusing a combination, written from the documents, apart from its
validator: a second opinion on the parity matrix's refusals (tests/test_config_space.py).

Each rule is a predicate over a job's settings (knob key -> value: a parity-matrix row with the matrix's
fixed numbers beside it) that is true where the rule refuses it, with the knobs it concerns and its
documented reason. The sources are the layout rules table of docs/parallelism.md ("The rules a layout must
satisfy"; the matrix's world size is the product of its degrees, so that rule holds by
construction), its activation-offload row, docs/moe.md (QK-norm) and the field descriptions of docs/config.md.
Nothing here calls megascale's validation (`JobConfig.check_rules`, `ParallelDims`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megascale.config import JobConfig, to_dict
from tests.parallel.config_space import Row
from tests.parallel.parity_matrix import BASE, layers

Settings = Mapping[str, Any]  # dotted key -> value: every knob and the numbers the rules read
V_SCHEDULES = (
    "zbv",
    "dualpipev",
)  # the zero-bubble schedules, two stages a rank in a V (docs/parallelism.md)


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _number(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        return text


def settings(row: Row) -> dict[str, Any]:
    """What the matrix trains `row` with: the config's defaults, the matrix's fixed numbers (BASE), the
    row's knobs and the depth it gives the row."""
    fixed = dict(flag.removeprefix("--").split("=", 1) for flag in BASE)
    return {
        **_flatten(to_dict(JobConfig())),
        **{key: _number(value) for key, value in fixed.items()},
        **row,
        "model.n_layers": layers(row),
    }


def _tp(job: Settings) -> int:
    return job["parallel.tp"]


def _pp(job: Settings) -> int:
    return job["parallel.pp"]


def _moe(job: Settings) -> bool:
    return job["model.moe.experts"] > 0


def _data_ranks(job: Settings) -> int:
    """dp_replicate x dp_shard: the ranks holding the same layers."""
    return job["parallel.dp_replicate"] * job["parallel.dp_shard"]


def _dp(job: Settings) -> int:
    """The data-parallel degree: distinct batches a step reads (cp ranks share one)."""
    return _data_ranks(job) // job["parallel.cp"]


def _per_rank_batch(job: Settings) -> int:
    return job["training.global_batch_size"] // _dp(job)


def _microbatches(job: Settings) -> int:
    return _per_rank_batch(job) // job["training.micro_batch_size"]


def _v_schedule(job: Settings) -> bool:
    return _pp(job) > 1 and job["parallel.pp_schedule"] in V_SCHEDULES


def _experts_over_tp(job: Settings) -> bool:
    return _moe(job) and job["parallel.moe_tp"] == "ep" and _tp(job) > 1


def _expert_ranks(job: Settings) -> int:
    return job["parallel.ep"] * (_tp(job) if _experts_over_tp(job) else 1)


def _head_dim(job: Settings) -> int:
    return job["model.attention.head_dim"] or job["model.dim"] // job["model.attention.n_heads"]


@dataclass(frozen=True)
class Rule:
    """A documented refusal: `refuses(job)` is true where it applies."""

    name: str
    knobs: tuple[str, ...]  # the fields it concerns, one of which a refusal by it should name
    reason: str  # as the documents give it
    refuses: Callable[[Settings], bool]


RULES: tuple[Rule, ...] = (
    # docs/parallelism.md, "The rules a layout must satisfy"
    Rule(
        "tp divides the sharded sizes",
        (
            "parallel.tp",
            "model.dim",
            "model.attention.n_heads",
            "model.attention.n_kv_heads",
            "model.vocab_size",
        ),
        "tp divides model.dim, n_heads, n_kv_heads and vocab_size",
        lambda job: any(
            job[key] % _tp(job)
            for key in (
                "model.dim",
                "model.attention.n_heads",
                "model.attention.n_kv_heads",
                "model.vocab_size",
            )
        ),
    ),
    Rule(
        "tp divides the learned position table",
        ("parallel.tp", "model.position", "model.max_seq_len"),
        "with learned positions, tp divides model.max_seq_len",
        lambda job: job["model.position"] == "learned" and job["model.max_seq_len"] % _tp(job) != 0,
    ),
    Rule(
        "tp divides the sequence-parallel sequence",
        ("parallel.tp", "parallel.sequence_parallel", "data.seq_len"),
        "with sequence parallelism, tp divides data.seq_len",
        lambda job: job["parallel.sequence_parallel"] and job["data.seq_len"] % _tp(job) != 0,
    ),
    Rule(
        "a stage needs a layer",
        ("parallel.pp", "parallel.pp_virtual_stages", "model.n_layers"),
        "pp x pp_virtual_stages <= model.n_layers",
        lambda job: _pp(job) * job["parallel.pp_virtual_stages"] > job["model.n_layers"],
    ),
    Rule(
        "virtual stages need a schedule that has them",
        ("parallel.pp_virtual_stages", "parallel.pp_schedule"),
        "pp_virtual_stages > 1 needs pp_schedule = interleaved_1f1b, or exactly 2 with zbv / dualpipev",
        lambda job: (
            (
                job["parallel.pp_virtual_stages"] > 1
                and job["parallel.pp_schedule"] not in ("interleaved_1f1b", *V_SCHEDULES)
            )
            or (_v_schedule(job) and job["parallel.pp_virtual_stages"] != 2)
        ),
    ),
    Rule(
        "the zero-bubble schedules run overlapped",
        ("parallel.pp_schedule", "parallel.overlap.pp"),
        "zbv / dualpipev run with overlap.pp on",
        lambda job: _v_schedule(job) and not job["parallel.overlap.pp"],
    ),
    Rule(
        "the zero-bubble schedules split the backward",
        ("parallel.pp_schedule", "training.compile", "parallel.activation_checkpoint"),
        "zbv / dualpipev run without training.compile or selective activation checkpointing",
        lambda job: (
            _v_schedule(job)
            and (job["training.compile"] or job["parallel.activation_checkpoint"] == "selective")
        ),
    ),
    Rule(
        "the zero-bubble schedules without tensor parallelism",
        ("parallel.pp_schedule", "parallel.tp"),
        "zbv / dualpipev run without tensor parallelism",
        lambda job: _v_schedule(job) and _tp(job) > 1,
    ),
    Rule(
        "the zero-bubble schedules with ZeRO 1 or 2 beside data parallelism",
        ("parallel.pp_schedule", "parallel.zero_stage"),
        "zbv / dualpipev run with zero_stage 1 or 2 beside data parallelism",
        lambda job: _v_schedule(job) and job["parallel.zero_stage"] == 3 and _data_ranks(job) > 1,
    ),
    Rule(
        "DualPipeV's micro-batches",
        ("parallel.pp_schedule", "training.micro_batch_size"),
        "DualPipeV needs at least 2 x pp micro-batches per step",
        lambda job: (
            _v_schedule(job)
            and job["parallel.pp_schedule"] == "dualpipev"
            and _microbatches(job) < 2 * _pp(job)
        ),
    ),
    Rule(
        "the global batch splits over the data-parallel ranks",
        ("training.global_batch_size", "parallel.dp_replicate", "parallel.dp_shard", "parallel.cp"),
        "global_batch_size divisible by dp",
        lambda job: job["training.global_batch_size"] % _dp(job) != 0,
    ),
    Rule(
        "the micro-batch divides the per-rank batch",
        ("training.micro_batch_size",),
        "micro_batch_size divides the per-rank batch global_batch_size / dp",
        lambda job: _per_rank_batch(job) % job["training.micro_batch_size"] != 0,
    ),
    Rule(
        "a pipeline needs pp micro-batches",
        ("training.micro_batch_size", "parallel.pp"),
        "with pp > 1, at least pp micro-batches per step",
        lambda job: _pp(job) > 1 and _microbatches(job) < _pp(job),
    ),
    Rule(
        "interleaved 1F1B needs a multiple of pp micro-batches",
        ("training.micro_batch_size", "parallel.pp", "parallel.pp_schedule"),
        "with interleaved 1F1B, a multiple of pp micro-batches per step",
        lambda job: (
            _pp(job) > 1
            and job["parallel.pp_schedule"] == "interleaved_1f1b"
            and _microbatches(job) % _pp(job) != 0
        ),
    ),
    Rule(
        "tied embeddings with a pipeline only in a V",
        ("model.tie_embeddings", "parallel.pp", "parallel.pp_schedule"),
        "tied embeddings with pp > 1 only with zbv / dualpipev (their V holds the embedding and the output "
        "layer on one rank)",
        lambda job: job["model.tie_embeddings"] and _pp(job) > 1 and not _v_schedule(job),
    ),
    Rule(
        "float8 layers not beside the overlapped tensor-parallel GEMMs",
        ("training.fp8", "parallel.overlap.tp"),
        "float8 linear layers (training.fp8) not beside the overlapped TP GEMMs (they multiply the weights "
        "themselves)",
        lambda job: (
            job["training.fp8"] != "none"
            and _tp(job) > 1
            and job["parallel.sequence_parallel"]
            and job["parallel.overlap.tp"]
        ),
    ),
    Rule(
        "float8 all-gathers need tensorwise scales",
        ("training.fp8_all_gather", "training.fp8"),
        "training.fp8_all_gather needs fp8 = tensorwise",
        lambda job: job["training.fp8_all_gather"] and job["training.fp8"] != "tensorwise",
    ),
    Rule(
        "no compilation with tensor parallelism",
        ("training.compile", "parallel.tp"),
        "no training.compile with tp > 1 (a compiled tensor-parallel block fails in its backward)",
        lambda job: job["training.compile"] and _tp(job) > 1,
    ),
    Rule(
        "expert parallelism needs experts",
        ("parallel.ep", "model.moe.experts"),
        "ep > 1 needs an MoE model",
        lambda job: job["parallel.ep"] > 1 and not _moe(job),
    ),
    Rule(
        "ep divides dp_shard and the experts",
        ("parallel.ep", "parallel.dp_shard", "model.moe.experts"),
        "ep divides dp_shard and model.moe.experts",
        lambda job: (
            _moe(job)
            and (
                job["parallel.dp_shard"] % job["parallel.ep"] != 0
                or job["model.moe.experts"] % job["parallel.ep"] != 0
            )
        ),
    ),
    Rule(
        "no selective checkpointing of split experts",
        ("parallel.activation_checkpoint", "parallel.ep", "parallel.moe_tp"),
        "no ep > 1 with selective activation checkpointing (the experts' FSDP unit runs other ops when "
        "recomputed); with moe_tp = ep neither",
        lambda job: _expert_ranks(job) > 1 and job["parallel.activation_checkpoint"] == "selective",
    ),
    Rule(
        "experts over the tp ranks",
        ("parallel.moe_tp", "parallel.tp", "model.moe.experts", "data.seq_len"),
        "with moe_tp = ep, ep x tp divides model.moe.experts and tp divides data.seq_len",
        lambda job: (
            _experts_over_tp(job)
            and (job["model.moe.experts"] % _expert_ranks(job) != 0 or job["data.seq_len"] % _tp(job) != 0)
        ),
    ),
    Rule(
        "cp divides dp_shard and the sequence's chunks",
        ("parallel.cp", "parallel.dp_shard", "data.seq_len"),
        "cp divides dp_shard; data.seq_len divisible by 2 x cp",
        lambda job: (
            job["parallel.dp_shard"] % job["parallel.cp"] != 0
            or job["data.seq_len"] % (2 * job["parallel.cp"]) != 0
        ),
    ),
    Rule(
        "context parallelism needs RoPE",
        ("parallel.cp", "model.position"),
        "with cp > 1: RoPE (no learned positions)",
        lambda job: job["parallel.cp"] > 1 and job["model.position"] != "rope",
    ),
    Rule(
        "context parallelism without experts over the tp ranks",
        ("parallel.cp", "parallel.moe_tp"),
        "with cp > 1: not moe_tp = ep (the tp ranks would route parts of a cp rank's chunks)",
        lambda job: job["parallel.cp"] > 1 and _experts_over_tp(job),
    ),
    # docs/moe.md: QK-norm's gain is shared by the heads that tensor parallelism splits
    Rule(
        "no QK-norm with tensor parallelism",
        ("model.attention.qk_norm", "parallel.tp"),
        "QK-norm is refused with tensor parallelism",
        lambda job: job["model.attention.qk_norm"] and _tp(job) > 1,
    ),
    # docs/parallelism.md, the activation_offload row of the memory table
    Rule(
        "no offload with selective checkpointing",
        ("parallel.activation_offload", "parallel.activation_checkpoint"),
        "activation_offload is refused with selective checkpointing",
        lambda job: (
            job["parallel.activation_offload"] and job["parallel.activation_checkpoint"] == "selective"
        ),
    ),
    # docs/config.md, the fields' descriptions
    Rule(
        "heads divide the width",
        ("model.attention.n_heads", "model.dim"),
        "n_heads must divide model.dim unless head_dim is set",
        lambda job: (
            job["model.attention.head_dim"] is None and job["model.dim"] % job["model.attention.n_heads"] != 0
        ),
    ),
    Rule(
        "key/value heads divide the heads",
        ("model.attention.n_kv_heads", "model.attention.n_heads"),
        "n_kv_heads must divide n_heads",
        lambda job: job["model.attention.n_heads"] % job["model.attention.n_kv_heads"] != 0,
    ),
    Rule(
        "RoPE needs an even head size",
        ("model.attention.n_heads", "model.attention.head_dim", "model.position"),
        "RoPE rotates pairs of a head's dimensions",
        lambda job: job["model.position"] == "rope" and _head_dim(job) % 2 != 0,
    ),
    Rule(
        "top_k experts at most",
        ("model.moe.top_k", "model.moe.experts"),
        "top_k: at most experts",
        lambda job: _moe(job) and job["model.moe.top_k"] > job["model.moe.experts"],
    ),
    Rule(
        "an MoE model keeps an MoE layer",
        ("model.moe.dense_layers", "model.n_layers"),
        "dense_layers leaves an MoE layer",
        lambda job: _moe(job) and job["model.moe.dense_layers"] >= job["model.n_layers"],
    ),
    Rule(
        "sequences fit the model",
        ("data.seq_len", "model.max_seq_len"),
        "data.seq_len at most model.max_seq_len",
        lambda job: job["data.seq_len"] > job["model.max_seq_len"],
    ),
    Rule(
        "whole micro-batches",
        ("training.global_batch_size", "training.micro_batch_size"),
        "global_batch_size must be a multiple of micro_batch_size",
        lambda job: job["training.global_batch_size"] % job["training.micro_batch_size"] != 0,
    ),
)


def refusing(row: Row) -> list[Rule]:
    """The documented rules that refuse the matrix's combination `row`."""
    job = settings(row)
    return [rule for rule in RULES if rule.refuses(job)]
