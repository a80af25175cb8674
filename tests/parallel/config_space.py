"""The configuration space as one contract: the knobs that change how a step is computed, sharded or
scheduled, the values each takes, and what each needs set to make a difference.

Every config field is in exactly one of two lists. `KNOBS` holds the fields that choose *how* the job's
step is computed (the layout, the schedules, the overlaps, checkpointing of activations, the model's
building blocks, the optimizer, precision, compilation, how batches are fed), each with the values the parity
matrix tries and the condition under which it does anything. `NEUTRAL` holds every other field with the
reason it cannot make two layouts train different models: a number of the job that every layout uses
alike, or a field that only logs, paths, times or supervises. A test fails when a field is in neither, so
a new knob cannot escape the matrix (`tests/test_config_space.py`). Which combinations of them the
matrix runs is `tests.parallel.covering`'s choice.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megascale.config.parallel import V_SCHEDULES

Row = dict[str, Any]  # knob key -> value, every knob present


def _pp(row: Mapping[str, Any]) -> bool:
    return row["parallel.pp"] > 1


def _moe(row: Mapping[str, Any]) -> bool:
    return row["model.moe.experts"] > 0


def _dp(row: Mapping[str, Any]) -> bool:
    return row["parallel.dp_replicate"] * row["parallel.dp_shard"] > 1


def experts_split(row: Mapping[str, Any]) -> bool:
    """The experts are split over ranks, their token slots exchanged by all-to-all: over ep dp_shard
    ranks, or the tp ranks (parallel.moe_tp)."""
    return row["parallel.ep"] > 1 or row["parallel.moe_tp"] == "ep"


def _tp(row: Mapping[str, Any]) -> bool:
    return row["parallel.tp"] > 1


@dataclass(frozen=True)
class Knob:
    """A config field that changes how the step runs, and the values the matrix tries; `values[0]` is the one
    it keeps where it does nothing. `active(row)` says whether it does anything in a combination (the
    pipeline schedule does nothing without a pipeline)."""

    key: str
    values: tuple
    active: Callable[[Mapping[str, Any]], bool] = lambda row: True
    # A knob whose other values are costly to run (compiling): combinations take them only where a tuple
    # they are built for asks, so that few combinations pay.
    costly: bool = False
    # A knob whose other values loosen the bound a combination is held to (float8 layers): combinations take
    # them only where a tuple asks, so that most are held to their compute precision's bound.
    loosening: bool = False


# Layout knobs first: the others' activity depends on them.
KNOBS: tuple[Knob, ...] = (
    Knob("parallel.dp_replicate", (1, 2)),
    Knob("parallel.dp_shard", (1, 2)),
    Knob("parallel.tp", (1, 2)),
    Knob("parallel.cp", (1, 2), lambda row: row["parallel.dp_shard"] > 1),
    Knob("parallel.moe_tp", ("whole", "ep"), lambda row: _moe(row) and _tp(row)),
    Knob("parallel.ep", (1, 2), lambda row: _moe(row) and row["parallel.dp_shard"] > 1),
    Knob("parallel.ep_comm_dtype", ("float32", "bfloat16", "float8_e4m3fn"), experts_split),
    Knob("parallel.pp", (1, 2)),
    Knob("parallel.pp_schedule", ("1f1b", "interleaved_1f1b", "gpipe", *V_SCHEDULES), _pp),
    Knob(
        "parallel.pp_virtual_stages",
        (1, 2),
        lambda row: _pp(row) and row["parallel.pp_schedule"] in ("interleaved_1f1b", *V_SCHEDULES),
    ),
    Knob("parallel.pp_split", ("uniform", "params"), _pp),
    Knob("parallel.rank_order", ("tp-dp-pp", "tp-pp-dp"), lambda row: _pp(row) and _dp(row)),
    Knob("parallel.zero_stage", (3, 2, 1), _dp),
    Knob("parallel.sequence_parallel", (True, False), _tp),
    Knob("parallel.activation_checkpoint", ("none", "full", "selective")),
    Knob("parallel.activation_offload", (False, True)),
    Knob("parallel.overlap.dp", (True, False), _dp),
    Knob("parallel.overlap.tp", (True, False), lambda row: _tp(row) and row["parallel.sequence_parallel"]),
    Knob(
        "parallel.overlap.pp", (True, False), lambda row: _pp(row) and row["parallel.pp_schedule"] != "gpipe"
    ),
    Knob("parallel.overlap.ep", (True, False), experts_split),
    Knob("parallel.overlap.cp", (True, False), lambda row: row["parallel.cp"] > 1),
    Knob("model.block", ("serial", "parallel")),
    Knob("model.norm", ("rmsnorm", "layernorm")),
    Knob("model.mlp", ("swiglu", "gelu")),
    Knob("model.position", ("rope", "learned")),
    Knob("model.tie_embeddings", (False, True)),
    Knob("model.attention.window", (None, 8)),
    Knob("model.attention.n_kv_heads", (2, 4)),
    Knob("model.attention.qk_norm", (False, True)),
    Knob("model.moe.experts", (0, 4)),
    Knob("model.moe.top_k", (2, 1), _moe),
    Knob("model.moe.shared_experts", (0, 1), _moe),
    Knob("model.moe.dense_layers", (0, 1), _moe),
    Knob("model.moe.score", ("softmax", "sigmoid"), _moe),
    Knob(
        "model.moe.normalize_weights",
        (True, False),
        lambda row: _moe(row) and row["model.moe.score"] == "softmax",
    ),
    Knob("model.moe.aux_loss_coeff", (0.0, 0.01), _moe),
    Knob("model.moe.bias_update_rate", (0.0, 0.001), _moe),
    Knob("model.moe.capacity_factor", (None, 1.0), _moe),
    Knob("optim.name", ("adamw", "lamb")),
    Knob("optim.grad_clip", (0.5, None)),
    Knob("training.micro_batch_size", (2, 1, 4)),
    Knob("training.dtype", ("float32", "bfloat16")),
    Knob("training.fp8", ("none", "tensorwise", "rowwise"), loosening=True),
    Knob(
        "training.fp8_all_gather",
        (False, True),
        lambda row: row["training.fp8"] == "tensorwise" and row["parallel.dp_shard"] > 1,
    ),
    Knob("training.compile", (False, True), costly=True),
    Knob("data.share_per_node", (True, False), lambda row: _pp(row) or _tp(row)),
    Knob("data.prefetch", (1, 0)),
    Knob("checkpoint.async_save", (True, False)),
)

# Why each other field cannot make a layout train a different model from one process.
_SAME_NUMBER = "a number of the job: every layout computes the same function of it"
_DATA = "which data: every layout reads the same sequences of it"
_OUTSIDE = "outside the step: logging, paths, timing or supervision"
_RESILIENCE = "the driver's supervision of the job (docs/resilience.md), not the step"
_ROPE_TABLE = (
    "the RoPE tables' values: every rank builds the same tables for whole sequences, which every layout's "
    "attention applies alike (a knob once the sequence itself is split, with context parallelism)"
)
NEUTRAL: dict[str, str] = {
    **{
        f"model.attention.rope_scaling.{name}": _ROPE_TABLE
        for name in (
            "type",
            "factor",
            "original_max_seq_len",
            "low_freq_factor",
            "high_freq_factor",
            "beta_fast",
            "beta_slow",
            "truncate",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
        )
    },
    **dict.fromkeys(
        [
            "model.dim",
            "model.n_layers",
            "model.vocab_size",
            "model.ffn_dim",
            "model.max_seq_len",
            "model.norm_eps",
            "model.init_std",
            "model.attention.n_heads",
            "model.attention.rope_theta",
            "model.attention.head_dim",
            "model.moe.expert_dim",
            "model.moe.route_scale",
            "optim.lr",
            "optim.min_lr_ratio",
            "optim.warmup_steps",
            "optim.decay",
            "optim.beta1",
            "optim.beta2",
            "optim.eps",
            "optim.weight_decay",
            "optim.trust_clamp",
            "training.steps",
            "training.stop_at_step",
            "training.global_batch_size",
            "training.seed",
            "training.val_every",
            "training.val_sequences",
            "data.seq_len",
        ],
        _SAME_NUMBER,
    ),
    "training.fp8_exclude": "which linear layers stay out of float8: every layout and its one-process "
    "reference convert the same layers",
    "parallel.overlap.tp_chunks": "the TP overlap's chunk count: one code path for any count, checked "
    "against one process with 2 and 3 (uneven) chunks in tests/parallel/test_tensor.py",
    **dict.fromkeys(
        [
            "data.source",
            "data.tokenizer",
            "data.bpe_vocab_size",
            "data.jsonl_field",
            "data.text_field",
            "data.streaming",
            "data.mixture",
            "data.cache_dir",
            "data.val_fraction",
            "data.verify",
        ],
        _DATA,
    ),
    **dict.fromkeys(
        [
            "training.device",
            "training.threads",
            "training.run_dir",
            "training.log_every",
            "training.gc_every",
            "training.peak_tflops",
            "checkpoint.enabled",
            "checkpoint.every",
            "checkpoint.snapshot_every",
            "checkpoint.keep",
            "checkpoint.location",
            "checkpoint.resume",
            "checkpoint.init_from",
            "metrics.jsonl",
            "metrics.tensorboard",
            "metrics.wandb",
            "metrics.wandb_project",
            "metrics.wandb_entity",
            "metrics.progress",
            "metrics.timeline",
            "metrics.straggler_ratio",
            "metrics.straggler_window",
            "metrics.hang_dump_s",
            "parallel.timeout_s",
            "parallel.store",
        ],
        _OUTSIDE,
    ),
    **dict.fromkeys(
        [
            "resilience.anomaly_action",
            "resilience.anomaly_window",
            "resilience.comm_flat_timeout_s",
            "resilience.diagnose",
            "resilience.diagnose_bandwidth",
            "resilience.diagnose_timeout_s",
            "resilience.evict_stragglers",
            "resilience.executors",
            "resilience.expected_allreduce_gbps",
            "resilience.expected_alltoall_gbps",
            "resilience.expected_gflops",
            "resilience.hang_timeout_s",
            "resilience.heartbeat_interval_s",
            "resilience.heartbeat_timeout_s",
            "resilience.store_grace_s",
            "resilience.job_id",
            "resilience.loss_spike_z",
            "resilience.max_restarts",
            "resilience.min_speed_ratio",
            "resilience.spares",
            "resilience.standby",
            "resilience.stopped_timeout_s",
            "resilience.startup_timeout_s",
            "resilience.step_time_factor",
            "resilience.store",
        ],
        _RESILIENCE,
    ),
    "resilience.nodes": "times nproc_per_node, `megascale launch`'s world size, which the layout divides",
    "resilience.nproc_per_node": "times nodes, `megascale launch`'s world size, which the layout divides",
    "resilience.nan_policy": "what a non-finite loss does, which a run matching one process never has",
    "resilience.inject": "faults injected to rehearse recovery (tests/resilience), not a way to train",
}


@functools.cache
def knob(key: str) -> Knob:
    return next(k for k in KNOBS if k.key == key)


def default_row() -> Row:
    return {k.key: k.values[0] for k in KNOBS}


def world_size(row: Mapping[str, Any]) -> int:
    return math.prod(row[f"parallel.{name}"] for name in ("dp_replicate", "dp_shard", "tp", "pp"))


def canonical(row: Row) -> Row:
    """The row with every knob that does nothing in it at its default, so one combination has one form."""
    row = dict(row)
    for k in KNOBS:  # in declaration order: a knob's activity depends only on knobs before it
        if not k.active(row):
            row[k.key] = k.values[0]
    return row


def active_values(row: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return [(k.key, row[k.key]) for k in KNOBS if k.active(row)]


def tuples_of(row: Mapping[str, Any], strength: int) -> set[tuple]:
    """The `strength`-tuples of active (knob, value) pairs a row exercises."""
    return set(itertools.combinations(active_values(row), strength))


def fill(target: tuple, rng: random.Random, base: Row | None = None) -> Row:
    """A row holding `target`'s values with their prerequisites (a pipeline for a pipeline knob, ...), the
    other knobs from `base`, or random with the layout biased towards few processes; canonical."""
    row = (
        dict(base)
        if base is not None
        else {k.key: k.values[0] if k.costly or k.loosening else rng.choice(k.values) for k in KNOBS}
    )
    if base is None:
        for key in ("parallel.dp_replicate", "parallel.dp_shard", "parallel.tp", "parallel.pp"):
            row[key] = 1 if rng.random() < 0.5 else 2
    for pair in target:
        row.update(_VALUE_PREREQUISITES.get(pair, {}))
    row.update(dict(target))
    # Knobs the target needs active pull their prerequisites in: a pipeline for pipeline knobs, and so on.
    for _ in range(3):
        for key, _ in target:
            if not knob(key).active(row):
                _activate(row, key, rng)
        row.update(dict(target))
    return canonical(row)


_PREREQUISITES: dict[str, dict[str, Any]] = {
    "parallel.pp_schedule": {"parallel.pp": 2},
    "parallel.pp_virtual_stages": {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b"},
    "parallel.pp_split": {"parallel.pp": 2},
    "parallel.overlap.pp": {"parallel.pp": 2},
    "parallel.sequence_parallel": {"parallel.tp": 2},
    "parallel.overlap.tp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
    "parallel.cp": {"parallel.dp_shard": 2},
    "parallel.overlap.cp": {"parallel.dp_shard": 2, "parallel.cp": 2},
    "parallel.moe_tp": {"model.moe.experts": 4, "parallel.tp": 2},
    "parallel.ep": {"model.moe.experts": 4, "parallel.dp_shard": 2},
    "parallel.ep_comm_dtype": {"model.moe.experts": 4, "parallel.dp_shard": 2, "parallel.ep": 2},
    "parallel.overlap.ep": {"model.moe.experts": 4, "parallel.dp_shard": 2, "parallel.ep": 2},
    "training.fp8_all_gather": {"training.fp8": "tensorwise", "parallel.dp_shard": 2},
}
_MOE = {"model.moe.experts": 4}  # what every MoE knob but the expert count needs
# What a value needs besides its knob's prerequisites to be accepted, unless the combination sets it:
# the zero-bubble schedules' two stages a rank, their overlapped runtime, no tensor parallelism, ZeRO-2
# beside data parallelism (parallel/dims.py), and DualPipeV's 2 pp micro-batches.
_V_SCHEDULE = {
    "parallel.pp": 2,
    "parallel.tp": 1,
    "parallel.pp_virtual_stages": 2,
    "parallel.overlap.pp": True,
    "parallel.zero_stage": 2,
    "parallel.activation_checkpoint": "none",
    "training.compile": False,
}
_VALUE_PREREQUISITES: dict[tuple[str, Any], dict[str, Any]] = {
    ("parallel.pp_schedule", "zbv"): _V_SCHEDULE,
    ("parallel.pp_schedule", "dualpipev"): {**_V_SCHEDULE, "training.micro_batch_size": 1},
    # float8 layers run beside tensor parallelism without its overlapped GEMMs
    ("training.fp8", "tensorwise"): {"parallel.overlap.tp": False},
    ("training.fp8", "rowwise"): {"parallel.overlap.tp": False},
    # offload moves nothing that torch's selective checkpoint keeps (megascale/config)
    ("parallel.activation_offload", True): {"parallel.activation_checkpoint": "none"},
}


def prerequisite_values(key: str) -> dict[str, Any]:
    """What `key` needs set to make a difference (parallel.cp needs parallel.dp_shard = 2)."""
    return _PREREQUISITES.get(key, _MOE if key.startswith("model.moe.") else {})


def prerequisites(key: str) -> set[str]:
    """The knobs `key` needs set to make a difference."""
    return set(prerequisite_values(key))


def _activate(row: Row, key: str, rng: random.Random) -> None:
    row.update(prerequisite_values(key))
    if key == "parallel.overlap.pp" and row["parallel.pp_schedule"] == "gpipe":
        row["parallel.pp_schedule"] = rng.choice(("1f1b", "interleaved_1f1b"))
    if key in ("parallel.zero_stage", "parallel.overlap.dp", "parallel.rank_order") and not _dp(row):
        row[rng.choice(("parallel.dp_replicate", "parallel.dp_shard"))] = 2
    if key == "parallel.rank_order":
        row["parallel.pp"] = 2
    if key == "data.share_per_node" and not (_pp(row) or _tp(row)):
        row[rng.choice(("parallel.tp", "parallel.pp"))] = 2


def can_be_active(target: tuple) -> bool:
    """Whether the (knob, value) pairs of `target` can all do something in one combination (GPipe's and
    the pipeline overlap's cannot: GPipe has no overlap to switch)."""
    return holds(fill(target, random.Random(0), default_row()), target)


def holds(row: Mapping[str, Any], target: tuple) -> bool:
    """Whether the row has the tuple's values, each knob active."""
    active = dict(active_values(row))
    return all(key in active and active[key] == value for key, value in target)
