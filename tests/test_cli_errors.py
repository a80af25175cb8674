"""Bad input: one clear line on stderr, exit status 2, no traceback (unless --debug), nothing overwritten."""

import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from megascale.cli import main
from megascale.config import load_config
from megascale.data.prepare import prepare_dataset
from megascale.errors import ConfigError
from tests.conftest import tiny_args


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with the hash of its bytes."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def run_cli(capsys, argv):
    capsys.readouterr()  # drop what fixtures printed
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.err.strip().splitlines()


def assert_one_line_error(status, err_lines, *needles):
    assert status == 2
    assert len(err_lines) == 1, err_lines
    assert err_lines[0].startswith("error: ")
    for needle in needles:
        assert needle in err_lines[0], err_lines[0]


@pytest.fixture
def trained_run(tiny_corpus, tmp_path):
    """A run directory holding a committed checkpoint of the tiny model."""
    args = tiny_args(tiny_corpus, tmp_path / "run", tmp_path / "data", "--training.steps=3")
    assert main(["train", *args]) == 0
    return args, tmp_path / "run"


@pytest.mark.parametrize(
    "override, needles",
    [
        ("--model.dimm=64", ["unknown key 'model.dimm'", "did you mean 'model.dim'"]),
        ("--optim.lr=-0.1", ["optim.lr = -0.1", "must be > 0"]),
        ("--model.attention.window=0", ["model.attention.window = 0", "must be >= 1"]),
        ("--model.attention.n_heads=5", ["model.attention.n_heads = 5", "must divide model.dim = 32"]),
    ],
)
def test_bad_config_values(capsys, trained_run, override, needles):
    args, run_dir = trained_run
    before = snapshot(run_dir)
    status, err = run_cli(capsys, ["train", *args, override])
    assert_one_line_error(status, err, *needles)
    assert snapshot(run_dir) == before


def test_missing_data_path(capsys, tiny_corpus, tmp_path):
    args = tiny_args(tiny_corpus, tmp_path / "run", tmp_path / "data", "--data.source=/no/such/corpus")
    status, err = run_cli(capsys, ["train", *args])
    assert_one_line_error(status, err, "/no/such/corpus", "does not exist")


@pytest.fixture
def prepared(tiny_corpus, tmp_path):
    cfg = load_config(None, [f"--data.source={tiny_corpus}", f"--data.cache_dir={tmp_path / 'cache'}"])
    return prepare_dataset(cfg.data, out_dir=tmp_path / "dataset", progress=False)


def _shard(dataset: Path) -> Path:
    return sorted(dataset.glob("*.tokens"))[0]


def test_truncated_shard(capsys, prepared, tiny_corpus, tmp_path):
    shard = _shard(prepared)
    shard.write_bytes(shard.read_bytes()[:-100])
    before = snapshot(prepared)
    args = tiny_args(tiny_corpus, tmp_path / "run", tmp_path / "data", f"--data.source={prepared}")
    status, err = run_cli(capsys, ["train", *args])
    assert_one_line_error(status, err, shard.name, "truncated")
    assert snapshot(prepared) == before


def test_corrupt_shard(capsys, prepared, tiny_corpus, tmp_path):
    shard = _shard(prepared)
    data = bytearray(shard.read_bytes())
    data[10] ^= 0x01
    shard.write_bytes(bytes(data))
    before = snapshot(prepared)
    args = tiny_args(tiny_corpus, tmp_path / "run", tmp_path / "data", f"--data.source={prepared}")
    status, err = run_cli(capsys, ["train", *args])
    assert_one_line_error(status, err, shard.name)
    assert snapshot(prepared) == before


def test_tokenizer_larger_than_model_vocab(capsys, prepared, tiny_corpus, tmp_path):
    args = tiny_args(
        tiny_corpus,
        tmp_path / "run",
        tmp_path / "data",
        f"--data.source={prepared}",
        "--model.vocab_size=200",
    )
    status, err = run_cli(capsys, ["train", *args])
    assert_one_line_error(status, err, "257", "model.vocab_size = 200")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_checkpoint_of_another_model_shape(capsys, trained_run):
    args, run_dir = trained_run
    before = snapshot(run_dir)
    status, err = run_cli(capsys, ["train", *args, "--model.dim=64", "--model.attention.n_heads=4"])
    assert_one_line_error(status, err, "model.dim = 32", "model.dim = 64", "step-00000003")
    assert snapshot(run_dir) == before


def test_run_dir_not_writable(capsys, tiny_corpus, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    args = tiny_args(tiny_corpus, blocker / "run", tmp_path / "data")
    status, err = run_cli(capsys, ["train", *args])
    assert_one_line_error(status, err, "training.run_dir", "not writable")
    assert blocker.read_text() == "not a directory"


def test_debug_shows_the_traceback():
    with pytest.raises(ConfigError):
        main(["--debug", "train", "--model.dimm=3"])
    with pytest.raises(ConfigError):
        main(["train", "--model.dimm=3", "--debug"])


def test_console_script_exits_2_without_traceback(tmp_path):
    executable = shutil.which("megascale") or pytest.fail("the megascale console script is not installed")
    result = subprocess.run(
        [executable, "train", "--optim.lr=-1"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: config: optim.lr = -1.0 is out of range: must be > 0"
    assert not (tmp_path / "runs").exists()


def test_print_config_and_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--print-config", "--model.attention.window=16"])
    assert exit_info.value.code == 0
    assert "window = 16" in capsys.readouterr().out
    for verb in ("train", "prepare", "convert", "calibrate"):
        with pytest.raises(SystemExit) as exit_info:
            main([verb, "--help"])
        assert exit_info.value.code == 0
        assert "usage: megascale " + verb in capsys.readouterr().out


def test_prepare_verb_writes_a_dataset(capsys, tiny_corpus, tmp_path):
    assert (
        main(
            [
                "prepare",
                f"--data.source={tiny_corpus}",
                "--out",
                str(tmp_path / "ds"),
                "--data.tokenizer=byte",
            ]
        )
        == 0
    )
    assert (tmp_path / "ds" / "meta.json").is_file()
    assert "tokens" in capsys.readouterr().out
    np.testing.assert_array_less(0, len(list((tmp_path / "ds").glob("*.tokens"))))


def test_a_run_that_fails_on_bad_input_says_so_in_its_train_log(capsys, tiny_corpus, tmp_path):
    run_dir, missing = tmp_path / "run", tmp_path / "no-such-texts"
    args = tiny_args(tiny_corpus, run_dir, tmp_path / "data", f"--data.source={missing}")
    assert main(["train", *args]) == 2
    said = f"error: data.source = '{missing}' does not exist"
    assert said in capsys.readouterr().err
    assert said in (run_dir / "train.log").read_text()
