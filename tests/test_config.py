"""Config loading, overrides, validation messages, and the generated reference."""

from pathlib import Path

import pytest

from megascale.config import JobConfig, all_keys, from_dict, load_config, render_reference, to_dict, to_toml
from megascale.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_default_toml_is_the_embedded_default():
    assert load_config(ROOT / "configs" / "default.toml") == load_config()


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    load_config(path)


def test_docs_config_md_is_current():
    assert (ROOT / "docs" / "config.md").read_text() == render_reference(), (
        "docs/config.md is stale: run `python -m megascale.config > docs/config.md`"
    )


def test_reference_lists_every_key():
    reference = render_reference()
    for key in all_keys():
        assert f"`{key.rsplit('.', 1)[-1]}`" in reference


def test_overrides_are_typed_and_later_wins(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[optim]\nlr = 0.5\n[model.attention]\nwindow = 32\n")
    cfg = load_config(
        path,
        [
            "--optim.lr=0.25",
            "--model.tie_embeddings=true",
            "--model.ffn_dim=96",
            "--model.attention.window=none",
        ],
    )
    assert cfg.optim.lr == 0.25 and cfg.model.tie_embeddings is True and cfg.model.ffn_dim == 96
    assert cfg.model.attention.window is None


def test_toml_round_trip():
    cfg = load_config(None, ["--model.attention.window=64", "--optim.name=lamb"])
    assert from_dict(to_dict(cfg)) == cfg
    assert "window = 64" in to_toml(cfg)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--model.dimm=3"], "unknown key 'model.dimm'; did you mean 'model.dim'?"),
        (["--lr=3"], "did you mean 'optim.lr'?"),
        (["--optim.lr=-1"], "optim.lr = -1.0 is out of range: must be > 0"),
        (["--model.attention.window=0"], "model.attention.window = 0 is out of range: must be >= 1"),
        (["--model.attention.n_heads=7"], "model.attention.n_heads = 7 must divide model.dim = 256"),
        (["--model.attention.n_kv_heads=3"], "must divide model.attention.n_heads = 8"),
        (["--model.block=diagonal"], "model.block = 'diagonal' is not one of 'serial', 'parallel'"),
        (["--training.steps=ten"], "training.steps = 'ten' is not a valid int"),
        (["--data.seq_len=512"], "data.seq_len = 512 exceeds model.max_seq_len = 256"),
        (["--training.global_batch_size=10", "--training.micro_batch_size=4"], "multiple of"),
        (["--model=3"], "'model' is a section"),
    ],
)
def test_bad_values_name_field_value_and_fix(overrides, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_unknown_key_in_file_is_rejected(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[training]\nstepz = 3\n")
    with pytest.raises(ConfigError, match="did you mean 'training.steps'"):
        load_config(path)


def test_wrong_type_in_file_is_rejected(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\ndim = "big"\n')
    with pytest.raises(ConfigError, match="model.dim = 'big' must be of type int"):
        load_config(path)


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_defaults_validate():
    JobConfig().validate()
