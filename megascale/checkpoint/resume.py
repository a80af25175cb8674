"""What a run may change when it resumes from a checkpoint, checked before anything is written.

A checkpoint's manifest holds the whole config that wrote it. Resuming under another layout is what
resharding is for; resuming into another model is refused, naming the field. Everything else the config
may change, but the change is said: the trainer logs one line listing what differs and applies the new
values from the resumed step (a longer `training.steps` stretches the learning-rate schedule; a new peak
`optim.lr` rescales it). Two changes would be silently ignored, so they are refused instead: another
`optim.name` (the checkpoint holds the other optimizer's state) and a `checkpoint.init_from` that the run
resumed from never started from (it would resume the old run and drop the import).

Another data source continues from the checkpoint's data position (prepared data: the sampler's position
in the new order; streamed data: each source the checkpoint knows at its cursor, a new one at its
beginning). Prepared token shards and streamed data keep different states, which do not translate: a run
that switches `data.streaming` resumes everything but the data, which starts at its beginning, and says so.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from megascale.checkpoint.manifest import list_checkpoints, read_manifest
from megascale.config import JobConfig, RopeScalingConfig, flatten_keys, to_dict
from megascale.errors import CheckpointError, ConfigError

# Model fields that may change between a checkpoint and the run resuming from it: they change no tensor
# (the RoPE fields are how a long-context phase continues a run, docs/models.md).
RESUMABLE_MODEL_CHANGES = {
    "init_std",
    "norm_eps",
    "max_seq_len",
    "attention.window",
    "attention.rope_theta",
    *(f"attention.rope_scaling.{field.name}" for field in dataclasses.fields(RopeScalingConfig)),
}
# Fields (or sections) whose change on resume changes the run's course from the resumed step on: said in
# the log. Layout, logging and supervision fields are not among them.
REPORTED_CHANGES = (
    "model.",
    "optim.",
    "training.steps",
    "training.global_batch_size",
    "training.seed",
    "training.dtype",
    "data.source",
    "data.mixture",
    "data.streaming",
    "data.text_field",
    "data.tokenizer",
    "data.seq_len",
)


def init_from_path(cfg: JobConfig) -> str | None:
    """checkpoint.init_from with `~` expanded, or None when unset."""
    return str(Path(cfg.checkpoint.init_from).expanduser()) if cfg.checkpoint.init_from else None


def check_before_start(cfg: JobConfig, root: str) -> None:
    """Before any process group starts or any file is written: the newest checkpoint under `root` (when
    the run resumes) or `checkpoint.init_from` (when it starts afresh) fits this config."""
    committed = list_checkpoints(root) if cfg.checkpoint.resume else []
    if committed:
        check_resumable(committed[-1][1], read_manifest(committed[-1][1]), cfg)
    elif (init_from := init_from_path(cfg)) is not None:
        check_model_matches(init_from, read_manifest(init_from), cfg.model)


def check_model_matches(checkpoint: str, descriptor: dict[str, Any], model_cfg: Any) -> None:
    """Refuse a checkpoint written for a model of another shape, naming the first differing field."""
    saved = flatten_keys(descriptor.get("config", {}).get("model", {}))
    current = flatten_keys(dataclasses.asdict(model_cfg))
    learned = current.get("position") == "learned"  # its table has max_seq_len rows
    for key, value in current.items():
        resumable = key in RESUMABLE_MODEL_CHANGES and not (key == "max_seq_len" and learned)
        if resumable or saved.get(key, value) == value:
            continue
        raise CheckpointError(
            f"checkpoint: {checkpoint} was written for model.{key} = {saved[key]!r}, but "
            f"the config has model.{key} = {value!r}; use the same model settings, or a "
            f"new --training.run_dir to start afresh"
        )


def check_resumable(checkpoint: str, descriptor: dict[str, Any], cfg: JobConfig) -> None:
    """Everything that refuses resuming `cfg` from `checkpoint` (its manifest `descriptor`), in one line."""
    check_model_matches(checkpoint, descriptor, cfg.model)
    saved = flatten_keys(descriptor.get("config", {}))
    saved_optimizer = saved.get("optim.name", cfg.optim.name)
    if saved_optimizer != cfg.optim.name:
        raise ConfigError(
            f"config: optim.name = {cfg.optim.name!r}, but the run in {cfg.training.run_dir} was trained "
            f"with {saved_optimizer!r} and its checkpoint holds that optimizer's state; keep "
            f"--optim.name={saved_optimizer}, or start a new --training.run_dir with "
            f"--checkpoint.init_from={checkpoint} (weights only)"
        )
    wanted = cfg.checkpoint.init_from
    started_from = saved.get("checkpoint.init_from")
    if wanted is not None and (started_from is None or _same_path(started_from) != _same_path(wanted)):
        step = descriptor.get("step", "?")
        raise ConfigError(
            f"config: checkpoint.init_from = {wanted!r}, but training.run_dir = {cfg.training.run_dir!r} "
            f"already holds checkpoints (up to step {step}) of a run that did not start from it: they would "
            "be resumed and the import ignored; give this run a new --training.run_dir"
        )


def data_reading_change(descriptor: dict[str, Any], cfg: JobConfig) -> str | None:
    """In words, how the checkpoint's run read its data and how this run reads it, when the two keep
    different data states (`data.streaming` differs); else None."""
    saved = descriptor.get("config", {}).get("data", {})
    if bool(saved.get("streaming", False)) == cfg.data.streaming:
        return None
    return f"the checkpoint's run {_data_reading(saved)}, this run {_data_reading(to_dict(cfg)['data'])}"


def _data_reading(data: dict[str, Any]) -> str:
    source = f"data.mixture {data['mixture']!r}" if data.get("mixture") else repr(data.get("source"))
    return f"streams {source}" if data.get("streaming") else f"reads token shards of {source}"


def changes_since(descriptor: dict[str, Any], cfg: JobConfig) -> list[str]:
    """'key old -> new' for each field that changes the run's course and differs from the checkpoint's."""
    saved = flatten_keys(descriptor.get("config", {}))
    current = flatten_keys(to_dict(cfg))
    return [
        f"{key} {saved[key]!r} -> {value!r}"
        for key, value in current.items()
        if key.startswith(REPORTED_CHANGES) and key in saved and saved[key] != value
    ]


def _same_path(path: str) -> Path:
    return Path(path).expanduser().resolve()
