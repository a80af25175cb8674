"""`megascale convert`: weights between megascale checkpoints and Hugging Face folders (Llama, Mixtral,
Qwen3, Qwen3-MoE).

The tensor mapping lives in models/hf.py; this module moves whole artefacts: it finds the newest
checkpoint of a run, loads only its model entry, and writes the other side's files. An imported model
becomes a weights-only checkpoint plus a `train.toml` that trains from it (`checkpoint.init_from`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megascale.checkpoint.checkpointer import (
    MANIFEST,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    write_checkpoint,
)
from megascale.checkpoint.stateful import ModelState
from megascale.config import JobConfig, from_dict, to_toml
from megascale.errors import CheckpointError
from megascale.models.hf import load_hf, save_hf
from megascale.models.llama import Transformer


def resolve_checkpoint(source: Path) -> str:
    """A checkpoint directory itself, or the newest committed one of a run directory."""
    if (source / MANIFEST).is_file():
        return str(source)
    checkpoints = list_checkpoints(str(source / "checkpoints"))
    if not checkpoints:
        raise CheckpointError(
            f"convert: {source} is neither a checkpoint (no {MANIFEST}) nor a run "
            f"directory with committed checkpoints"
        )
    return checkpoints[-1][1]


def export_hf(source: Path, out_dir: Path) -> Path:
    """Write the model of a run/checkpoint as a Hugging Face folder (models/hf.py says which family)."""
    checkpoint = resolve_checkpoint(source)
    model_cfg = from_dict({"model": read_manifest(checkpoint)["config"]["model"]}).model
    model = Transformer(model_cfg)
    load_checkpoint(checkpoint, {"model": ModelState(model)})
    save_hf(model.state_dict(), model_cfg, out_dir)
    return out_dir


def import_hf(hf_dir: Path, out_dir: Path) -> Path:
    """A Hugging Face Llama, Mixtral, Qwen3 or Qwen3-MoE folder as a weights-only checkpoint and a
    train.toml using it."""
    model_cfg, state_dict = load_hf(hf_dir)
    model = Transformer(model_cfg)
    model.load_state_dict(state_dict)
    job = JobConfig(model=model_cfg)
    job.checkpoint.init_from = str(out_dir.resolve())
    job.training.run_dir = f"runs/{out_dir.resolve().name}"  # its own: runs/default may hold another run
    write_checkpoint(
        str(out_dir),
        {"model": ModelState(model)},
        {"step": 0, "source": str(hf_dir), "config": {"model": dataclasses.asdict(model_cfg)}},
    )
    (out_dir / "train.toml").write_text(to_toml(job))
    return out_dir
