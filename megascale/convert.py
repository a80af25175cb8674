"""`megascale convert`: weights between megascale checkpoints and Hugging Face folders (Llama, Mixtral,
Qwen3, Qwen3-MoE).

The tensor mapping lives in models/hf.py; this module moves whole artefacts: it finds the newest
checkpoint of a run, loads only its model entry, and writes the other side's files. An imported model
becomes a weights-only checkpoint plus a `train.toml` that trains from it (`checkpoint.init_from`).
`describe_export` and `describe_import` are the line `megascale convert` prints: what it wrote, where.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from megascale.checkpoint.checkpointer import load_checkpoint, read_manifest, write_checkpoint
from megascale.checkpoint.manifest import verified_checkpoint
from megascale.checkpoint.stateful import ModelState
from megascale.config import DataConfig, JobConfig, from_dict, to_toml
from megascale.data.tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer
from megascale.errors import MegascaleError
from megascale.models.hf import CONFIG_FILE, check_exportable, load_hf, save_hf
from megascale.models.hf_tokenizer import save_hf_tokenizer
from megascale.models.llama import Transformer

log = logging.getLogger(__name__)


def resolve_checkpoint(source: Path) -> str:
    """A checkpoint directory itself, or the newest verified one of a run directory, verified as a resume
    verifies it (`verified_checkpoint`)."""
    return verified_checkpoint(str(source))


@dataclasses.dataclass(frozen=True)
class Trained:
    """A checkpoint's model in one process, the job config it records, and where it is."""

    model: Transformer
    job: JobConfig  # an imported model's records its model only: the rest is the default
    checkpoint: str
    records_data: bool  # whether the job's data section is the run's (its tokenizer can be found)


def load_trained(source: Path, device: torch.device | None = None) -> Trained:
    """The model of a run's newest checkpoint (or of one checkpoint), in one process whatever layout saved
    it (DCP reshards on load), in evaluation mode, on `device` (the CPU by default)."""
    checkpoint = resolve_checkpoint(source)
    recorded = read_manifest(checkpoint)["config"]
    job = from_dict(recorded)
    model = Transformer(job.model)
    load_checkpoint(checkpoint, {"model": ModelState(model)})
    model.eval()
    if device is not None:
        model.to(device)
    return Trained(model, job, checkpoint, records_data="data" in recorded)


def run_tokenizer(data: DataConfig, override: str | None = None) -> Tokenizer:
    """The tokenizer a run trained with: its prepared dataset's (made again from the data config if the
    cache was cleared), or `override` ('byte' or a tokenizer.json path)."""
    if override is not None:
        return load_tokenizer(override)
    from megascale.data.prepare import prepare_dataset

    return load_tokenizer(prepare_dataset(data, progress=False))


def export_hf(source: Path, out_dir: Path) -> Path:
    """Write the model of a run/checkpoint as a Hugging Face folder (models/hf.py says which family),
    with the run's tokenizer (models/hf_tokenizer.py) where it can be found."""
    trained = load_trained(source)
    cfg = trained.model.cfg
    check_exportable(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    token_ids = None
    if trained.records_data:
        try:
            tokenizer = run_tokenizer(trained.job.data)
        except MegascaleError as err:
            log.warning("convert: the export has no tokenizer: %s", err)
        else:
            token_ids = save_hf_tokenizer(tokenizer, out_dir, cfg.max_seq_len)
    save_hf(trained.model.state_dict(), cfg, out_dir, token_ids)
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


def _files(folder: Path) -> str:
    """The files directly in `folder` and their sizes: 'config.json (1 KiB), model.safetensors (2.0 MiB)'."""

    def size(path: Path) -> str:
        n_bytes = path.stat().st_size
        return f"{n_bytes / 2**20:.1f} MiB" if n_bytes >= 2**20 else f"{max(1, round(n_bytes / 2**10))} KiB"

    return ", ".join(f"{path.name} ({size(path)})" for path in sorted(folder.iterdir()) if path.is_file())


def _architecture(hf_dir: Path) -> str:
    return json.loads((hf_dir / CONFIG_FILE).read_text()).get("architectures", ["model"])[0]


def describe_export(out_dir: Path) -> str:
    """What `export_hf` wrote to `out_dir`, in one line."""
    tokenizer = "" if (out_dir / TOKENIZER_FILE).is_file() else "; no tokenizer (see the warning above)"
    return (
        f"wrote a Hugging Face {_architecture(out_dir)} checkpoint (safetensors) to {out_dir}: "
        f"{_files(out_dir)}{tokenizer}; load it with transformers' from_pretrained({str(out_dir)!r})"
    )


def describe_import(hf_dir: Path, out_dir: Path) -> str:
    """What `import_hf` wrote to `out_dir`, in one line."""
    return (
        f"wrote the {_architecture(hf_dir)} of {hf_dir} as a megascale checkpoint (weights only, DCP) to "
        f"{out_dir}: {_files(out_dir)}; train from it with megascale train --config {out_dir / 'train.toml'}"
    )
