"""Typed job configuration: one dataclass per section, loaded from TOML, overridden as --section.key=value.

Every field carries its help text, allowed values and range in its metadata (`megascale.options`), so that
validation, the error messages and the reference in docs/config.md (``python -m megascale.config``) all come
from one place. Each section's dataclass is in the module named after it (`config/model.py`, `run.py`,
`parallel.py`, `resilience.py`); this module joins them into the `JobConfig`.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megascale import options
from megascale.config.model import AttentionConfig, ModelConfig, MoEConfig, RopeScalingConfig, head_dim_of
from megascale.config.parallel import OverlapConfig, ParallelConfig
from megascale.config.resilience import ResilienceConfig
from megascale.config.run import CheckpointConfig, DataConfig, MetricsConfig, OptimConfig, TrainingConfig
from megascale.errors import ConfigError
from megascale.options import (
    check_fields,
    fail,
    flatten_keys,
    leaf_keys,
    section,
    set_key,
    to_toml,
)

__all__ = [
    "AttentionConfig",
    "CheckpointConfig",
    "DataConfig",
    "JobConfig",
    "MetricsConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimConfig",
    "OverlapConfig",
    "ParallelConfig",
    "ResilienceConfig",
    "RopeScalingConfig",
    "TrainingConfig",
    "all_keys",
    "apply_overrides",
    "fail",
    "flatten_keys",
    "from_dict",
    "head_dim_of",
    "load_config",
    "to_dict",
    "to_toml",
]


@dataclass
class JobConfig:
    """A whole training job."""

    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    optim: OptimConfig = section(OptimConfig)
    training: TrainingConfig = section(TrainingConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    metrics: MetricsConfig = section(MetricsConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    resilience: ResilienceConfig = section(ResilienceConfig)

    def validate(self) -> None:
        """Check every field's range and the rules between fields; raise ConfigError on the first."""
        check_fields(self)
        self.check_rules()

    def check_rules(self) -> None:
        """The rules between fields (each field's own range is `check_fields`'); ConfigError on the first."""
        m, a, t = self.model, self.model.attention, self.training
        if m.dim % a.n_heads and a.head_dim is None:
            fail(
                "model.attention.n_heads",
                a.n_heads,
                f"must divide model.dim = {m.dim} (or set model.attention.head_dim)",
            )
        if a.n_heads % a.n_kv_heads:
            fail(
                "model.attention.n_kv_heads",
                a.n_kv_heads,
                f"must divide model.attention.n_heads = {a.n_heads}",
            )
        if head_dim_of(m) % 2 and m.position == "rope":
            fail(
                "model.attention.head_dim" if a.head_dim else "model.attention.n_heads",
                a.head_dim or a.n_heads,
                f"gives an odd head size {head_dim_of(m)}; RoPE needs an even one",
            )
        if t.fp8_all_gather and t.fp8 != "tensorwise":
            fail(
                "training.fp8_all_gather",
                True,
                f"needs training.fp8 = 'tensorwise' (one scale a tensor, which FSDP can gather with it), not "
                f"{t.fp8!r}",
            )
        if self.parallel.activation_offload and self.parallel.activation_checkpoint == "selective":
            fail(
                "parallel.activation_offload",
                True,
                "cannot be used with parallel.activation_checkpoint = 'selective': torch's selective "
                "checkpoint holds the matmul outputs it keeps outside the saved-tensor hooks, so nothing but "
                "each block's input would leave the device; use 'full' or 'none'",
            )
        scaling = a.rope_scaling
        if scaling.type in ("yarn", "llama3") and scaling.original_max_seq_len is None:
            fail(
                "model.attention.rope_scaling.original_max_seq_len",
                None,
                f"must be set for rope_scaling.type = {scaling.type!r} (the pre-training context length)",
            )
        if scaling.type == "llama3" and scaling.high_freq_factor <= scaling.low_freq_factor:
            fail(
                "model.attention.rope_scaling.high_freq_factor",
                scaling.high_freq_factor,
                f"must exceed rope_scaling.low_freq_factor = {scaling.low_freq_factor}",
            )
        if scaling.type != "none" and m.position != "rope":
            fail("model.attention.rope_scaling.type", scaling.type, "needs model.position = 'rope'")
        moe = m.moe
        if moe.experts and moe.top_k > moe.experts:
            fail("model.moe.top_k", moe.top_k, f"exceeds model.moe.experts = {moe.experts}")
        if moe.experts and moe.dense_layers >= m.n_layers:
            fail(
                "model.moe.dense_layers",
                moe.dense_layers,
                f"leaves no MoE layer of model.n_layers = {m.n_layers}; lower it, or set model.moe.experts=0",
            )
        if self.data.seq_len > m.max_seq_len:
            fail("data.seq_len", self.data.seq_len, f"exceeds model.max_seq_len = {m.max_seq_len}")
        if self.parallel.dp_shard == 0:
            fail("parallel.dp_shard", 0, "must be >= 1, or -1 for the rest of the world size")
        store = self.parallel.store
        if store != "env" and not re.fullmatch(r"redis://[^/:@]+:\d+(/\d+)?", store):
            fail("parallel.store", store, "must be 'env' or redis://HOST:PORT/DB (redis://10.0.0.1:6379/0)")
        if t.stop_at_step is not None and t.stop_at_step > t.steps:
            fail(
                "training.stop_at_step",
                t.stop_at_step,
                f"is past training.steps = {t.steps}, where training ends anyway; lower it or unset it",
            )
        if t.global_batch_size % t.micro_batch_size:
            fail(
                "training.global_batch_size",
                t.global_batch_size,
                f"must be a multiple of training.micro_batch_size = {t.micro_batch_size}",
            )


def all_keys() -> list[str]:
    """Every dotted leaf key of a job config, e.g. 'model.attention.window'."""
    return leaf_keys(JobConfig)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Defaults, then the TOML file at `path`, then `--section.key=value` overrides; validated."""
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config: file {str(path)!r} does not exist")
        try:
            table = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config: {path} is not valid TOML: {err}") from None
        for key, value in flatten_keys(table).items():
            set_key(cfg, key, value, from_text=False)
    return apply_overrides(cfg, overrides)


def apply_overrides(cfg: JobConfig, overrides: Sequence[str]) -> JobConfig:
    """`cfg` with `--section.key=value` overrides set, validated."""
    for item in overrides:
        key, sep, value = item.removeprefix("--").partition("=")
        if not sep:
            raise ConfigError(f"config: override {item!r} must look like --section.key=value")
        set_key(cfg, key, value, from_text=True)
    cfg.validate()
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(table: dict) -> JobConfig:
    """Rebuild a JobConfig from `to_dict` output (as stored in checkpoints)."""
    cfg = JobConfig()
    for key, value in flatten_keys(table).items():
        set_key(cfg, key, value, from_text=False)
    return cfg


def render_reference() -> str:
    """docs/config.md: every field with its type, default and meaning."""
    preamble = [
        "# Configuration reference",
        "",
        "Generated by `python -m megascale.config > docs/config.md`; a test checks it is current.",
        "",
        "Set fields in a TOML file (`megascale train --config configs/default.toml`) or on the "
        "command line as `--section.key=value` (later wins). `--print-config` shows the result.",
        "",
    ]
    return options.render_reference(JobConfig, preamble)
