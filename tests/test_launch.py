"""`megascale train --nproc N`: real worker processes through torchrun's machinery, and its failures."""

import subprocess
import sys

from megascale.checkpoint.checkpointer import list_checkpoints, read_descriptor
from megascale.observe.metrics import read_metrics
from tests.conftest import tiny_args


def megascale(*args, cwd, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "megascale.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def test_nproc_2_trains_data_parallel_and_rank_0_alone_writes(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    result = megascale(
        "train",
        "--nproc",
        "2",
        *tiny_args(tiny_corpus, run_dir, tmp_path / "data", "--parallel.dp_shard=2"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [record["step"] for record in read_metrics(run_dir)] == list(
        range(1, 7)
    )  # once per step, not twice
    assert result.stderr.count("done: step 6/6") == 1
    assert "pp 1 x dp 1x2 x tp 1 = 2 processes" in (run_dir / "train.log").read_text()
    (step, newest), *_ = reversed(list_checkpoints(run_dir / "checkpoints"))
    assert step == 6 and read_descriptor(newest)["layout"] == "pp 1 x dp 1x2 x tp 1 = 2 processes"


def test_a_layout_that_does_not_fit_nproc_fails_before_starting_workers(tiny_corpus, tmp_path):
    result = megascale(
        "train",
        "--nproc",
        "3",
        *tiny_args(tiny_corpus, tmp_path / "run", tmp_path / "data", "--parallel.tp=2"),
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: config: parallel pp x dp_replicate x tp = 2 does not divide the world size 3"
    ]


def test_a_worker_error_is_reported_once_with_its_exit_status(tiny_corpus, tmp_path):
    args = tiny_args(
        tiny_corpus, tmp_path / "run", tmp_path / "data", f"--data.source={tmp_path / 'missing'}"
    )
    result = megascale("train", "--nproc", "2", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert "does not exist" in result.stderr
    assert "error: rank 0 of 2 exited with status 2" in result.stderr
