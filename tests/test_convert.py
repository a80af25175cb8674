"""`megascale convert`: a trained run to Hugging Face and back, and training from imported weights."""

import tomllib

import pytest
import torch

from megascale.checkpoint.checkpointer import list_checkpoints
from megascale.cli import main
from megascale.config import load_config
from megascale.trainer import Trainer
from tests.conftest import tiny_args

transformers = pytest.importorskip("transformers")


def test_export_run_then_import_and_train_from_it(tiny_corpus, tmp_path, capsys):
    args = tiny_args(tiny_corpus, tmp_path / "run", tmp_path / "data", "--training.steps=3")
    assert main(["train", *args]) == 0
    capsys.readouterr()
    assert main(["convert", "--to", "hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    said = capsys.readouterr().out.strip()
    assert said.startswith(
        f"wrote a Hugging Face LlamaForCausalLM checkpoint (safetensors) to {tmp_path / 'hf'}: "
    )
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert f"{name} (" in said, said

    trained = Trainer(load_config(None, args))  # resumes the final checkpoint: the trained weights
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(
            hf_model(tokens).logits, trained.model.parts[0].eval()(tokens), atol=1e-5, rtol=0
        )
    trained.close()

    assert main(["convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    said = capsys.readouterr().out.strip()
    assert said.startswith(
        f"wrote the LlamaForCausalLM of {tmp_path / 'hf'} as a megascale checkpoint (weights only, DCP) to "
        f"{tmp_path / 'imported'}: "
    )
    assert "manifest.json (" in said and "train.toml (" in said
    assert said.endswith(
        f"train from it with megascale train --config {tmp_path / 'imported' / 'train.toml'}"
    )
    # Its own run directory: the default one may hold another run, which would be resumed instead.
    written = tomllib.loads((tmp_path / "imported" / "train.toml").read_text())
    assert written["training"]["run_dir"] == "runs/imported"
    job = load_config(
        tmp_path / "imported" / "train.toml", tiny_args(tiny_corpus, tmp_path / "ft", tmp_path / "data")
    )
    assert job.checkpoint.init_from == str((tmp_path / "imported").resolve())
    fine_tuned = Trainer(job)
    assert fine_tuned.step == 0
    for (name, ours), theirs in zip(
        trained.model.parts[0].state_dict().items(), fine_tuned.model.parts[0].state_dict().values()
    ):
        assert torch.equal(ours, theirs), name
    fine_tuned.train()
    assert list_checkpoints(tmp_path / "ft" / "checkpoints")


def test_convert_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["convert", "--to", "hf", str(tmp_path), str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"


def test_convert_explains_a_source_that_is_not_a_checkpoint(tmp_path, capsys):
    assert main(["convert", "--to", "hf", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err
