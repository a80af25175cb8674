"""The configuration space as one contract: the knobs that change how a step is computed, sharded or
scheduled, the values each takes, and a covering set of their combinations.

Every config field is in exactly one of two lists. `KNOBS` holds the fields that choose *how* the job's
step is computed (the layout, the schedules, the overlaps, checkpointing of activations, the model's
building blocks, the optimizer, precision, compilation, how batches are fed), each with the values the parity
matrix tries and the condition under which it does anything. `NEUTRAL` holds every other field with the
reason it cannot make two layouts train different models: a number of the job that every layout uses
alike, or a field that only logs, paths, times or supervises. A test fails when a field is in neither, so
a new knob cannot escape the matrix (`tests/test_config_space.py`).

`covering_rows` picks combinations so that every pair (or, with `strength=3`, every triple) of knob values
that can be active together appears in some combination megascale accepts; a pair that no accepted
combination can hold is returned as a refused combination instead, whose refusal the matrix asserts. No
library on our registries generates covering arrays under constraints that only a whole combination can
check (megascale's own validation decides), so the greedy construction (AETG's: grow each combination
around a missing tuple, keep the candidate that covers most) is written here.
"""

from __future__ import annotations

import collections
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


@dataclass
class Covering:
    """Accepted combinations; for each tuple no accepted one can hold, a refused one and megascale's
    reason; and the tuples the search could neither cover nor show refused (none, in a sound search)."""

    accepted: list[Row]
    refused: list[tuple[tuple, Row, str]]
    missed: list[tuple]
    strength: int


def _search(
    target: tuple,
    rng: random.Random,
    variant: Callable[[Row], Row],
    score: Callable[[Row], float | None],
    attempts: int,
    candidates: int,
) -> Row | None:
    """The best-scoring row of random fillings of `target` (each also with `variant`'s values), tried until
    `candidates` were tried with one accepted (`score` not None), or `attempts` in all."""
    best, best_score, tries = None, -1.0, 0
    while tries < attempts and (best is None or tries < candidates):
        tries += 1
        filled = _fill(target, rng)
        for row in (filled, canonical({**filled, **variant(filled), **dict(target)})):
            value = score(row)
            if value is not None and value > best_score:
                best, best_score = row, value
    return best


VERDICTS_KEPT = 200_000  # megascale's verdicts a covering search remembers (about 150 MB)


class Verdicts:
    """`refusal` of a row, the most recent `kept` verdicts remembered by the row's values: a search for
    triples scores millions of random rows, few of them twice, and remembering every verdict (by the
    rows' items) took more than 12 GB."""

    def __init__(self, refusal: Callable[[Row], str | None], kept: int = VERDICTS_KEPT) -> None:
        keys = tuple(k.key for k in KNOBS)
        self._keys = keys
        self._verdict = functools.lru_cache(maxsize=kept)(lambda values: refusal(dict(zip(keys, values))))

    def __call__(self, row: Row) -> str | None:
        return self._verdict(tuple(row[key] for key in self._keys))

    def remembered(self) -> int:
        return self._verdict.cache_info().currsize


def covering_rows(
    refusal: Callable[[Row], str | None],
    *,
    strength: int = 2,
    max_world: int = 8,
    seed: int = 0,
    candidates: int = 40,
    attempts: int = 120,
    required: tuple[Row, ...] = (),
    cost: Callable[[Row], float] = world_size,
    bonus: Callable[[Row, list[Row]], float] = lambda row, accepted: 0.0,
    variant: Callable[[Row], Row] = lambda row: {},
) -> Covering:
    """Combinations covering every `strength`-tuple of knob values that can be active together.

    `refusal(row)` is megascale's own verdict: None when it accepts the combination, else its one-line
    reason. Rows start with the `required` ones (e.g. one of one process); then, while a tuple is
    uncovered, the one whose cheapest row costs most is fixed, with its prerequisites, and the other
    knobs filled at random
    until `candidates` accepted rows of at most `max_world` processes are found (or `attempts` tried),
    keeping the one that covers most new tuples (plus its `bonus`, given the rows taken so far) for its
    `cost` (by default its processes); each filling is also tried with the values `variant` suggests for
    it (the target's kept), which lets a caller steer rows towards a property its bonus rewards. A tuple no
    accepted row was found for is refused when megascale refuses it with every other knob at its default,
    and otherwise reported missed."""
    rng = random.Random(seed)
    refused_why = Verdicts(refusal)

    uncovered = {target for target in wanted(strength) if can_be_active(target)}
    # The tuples that need the costliest rows (the largest layouts, a compilation) are targeted first: their
    # rows then take many cheap tuples along, instead of being added late for one tuple each.
    least_cost = {target: cost(_fill(target, random.Random(0), default_row())) for target in uncovered}
    cheapest = min(least_cost.values(), default=1.0)
    accepted: list[Row] = []
    refused: list[tuple[tuple, Row, str]] = []
    missed: list[tuple] = []

    def take(row: Row) -> None:
        accepted.append(row)
        uncovered.difference_update(tuples_of(row, strength))

    for row in required:
        row = canonical({**default_row(), **row})
        if refused_why(row) is None and world_size(row) <= max_world:
            take(row)
    pinned = list(accepted)
    # Targets in that order, once: each turn takes the first still uncovered (the order never changes).
    queue = iter(sorted(uncovered, key=lambda item: (-least_cost[item], _order(item))))
    while uncovered:
        target = next(item for item in queue if item in uncovered)
        # A costly row is searched harder (up to 10 times), so that few rows pay that much.
        effort = min(10, round(least_cost[target] / cheapest))
        effort = 10 if any(knob(key).costly for key, _ in target) else effort

        def score(row: Row, target: tuple = target) -> float | None:
            if not _holds(row, target) or world_size(row) > max_world or refused_why(row) is not None:
                return None
            return (len(tuples_of(row, strength) & uncovered) + bonus(row, accepted)) / cost(row)

        best = _search(target, rng, variant, score, attempts * effort, candidates * effort)
        if best is not None:
            take(best)
            continue
        uncovered.discard(target)
        row = _fill(target, random.Random(0), default_row())
        reason = refused_why(row)
        if reason is None:
            missed.append(target)
        else:
            refused.append((target, row, reason))
    rows = _without_redundant(accepted, strength, cost, pinned)
    rows = _cheapened(rows, strength, cost, pinned, lambda row: refused_why(row) is None, max_world)
    return Covering(rows, refused, missed, strength)


def _cheapened(
    rows: list[Row],
    strength: int,
    cost: Callable[[Row], float],
    pinned: list[Row],
    accepted: Callable[[Row], bool],
    max_world: int,
) -> list[Row]:
    """Each row (the costliest first) replaced, while one exists, by a cheaper accepted one that differs in
    one knob and still holds every tuple no other row holds: a local search after the greedy cover, which
    drops what a row paid for early and no longer needs (a compilation, a larger layout)."""
    rows = list(rows)
    holders = _holders(rows, strength)  # how many rows hold each tuple
    improved = True
    while improved:
        improved = False
        for index in sorted(range(len(rows)), key=lambda i: cost(rows[i]), reverse=True):
            row = rows[index]
            if any(row is pin for pin in pinned):
                continue
            held = tuples_of(row, strength)
            unique = {item for item in held if holders[item] == 1}
            for knob_ in KNOBS:
                for value in knob_.values:
                    changed = canonical({**row, knob_.key: value})
                    if (
                        cost(changed) < cost(row)
                        and world_size(changed) <= max_world
                        and tuples_of(changed, strength) >= unique
                        and accepted(changed)
                    ):
                        row, improved = changed, True
            if row is not rows[index]:
                holders.subtract(held)
                holders.update(tuples_of(row, strength))
            rows[index] = row
    return rows


def _without_redundant(
    rows: list[Row], strength: int, cost: Callable[[Row], float], pinned: list[Row]
) -> list[Row]:
    """`rows` less those whose every tuple others hold too, the costliest dropped first (a greedy set
    cover picks early rows before the later ones make them redundant); `pinned` rows stay."""
    kept = list(rows)
    holders = _holders(rows, strength)
    for row in sorted(rows, key=cost, reverse=True):
        if any(row is pin for pin in pinned):
            continue
        held = tuples_of(row, strength)
        if all(holders[item] > 1 for item in held):
            kept = [other for other in kept if other is not row]
            holders.subtract(held)
    return kept


def _holders(rows: list[Row], strength: int) -> collections.Counter:
    """How many of `rows` hold each tuple: a tuple one row alone holds is that row's to keep."""
    return collections.Counter(item for row in rows for item in tuples_of(row, strength))


def wanted(strength: int) -> set[tuple]:
    """Every `strength`-tuple of values of distinct knobs, active together or not."""
    wanted = set()
    for knobs in itertools.combinations(KNOBS, strength):
        for values in itertools.product(*(k.values for k in knobs)):
            wanted.add(tuple(zip((k.key for k in knobs), values)))
    return wanted


def _order(item: tuple) -> tuple:
    return tuple((key, repr(value)) for key, value in item)


def _fill(target: tuple, rng: random.Random, base: Row | None = None) -> Row:
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
    return _holds(_fill(target, random.Random(0), default_row()), target)


def _holds(row: Mapping[str, Any], target: tuple) -> bool:
    """Whether the row has the tuple's values, each knob active."""
    active = dict(active_values(row))
    return all(key in active and active[key] == value for key, value in target)
