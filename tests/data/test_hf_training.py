"""Training on `datasets` sources end to end: Parquet files and JSON Lines, prepared and streamed, killed with
SIGKILL after a checkpoint and restarted, reproduce an uninterrupted run's losses bit for bit (fp32)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from data_helpers import make_documents, write_jsonl, write_parquet_parts

from megascale.config import load_config
from megascale.observe.metrics import read_metrics
from megascale.trainer import Trainer
from tests.conftest import TINY

pytest.importorskip("datasets")
STEPS = ["--training.steps=6", "--checkpoint.every=2", "--checkpoint.async_save=false"]


def write_source(kind: str, directory) -> str:
    documents = make_documents(120)
    if kind == "parquet":
        write_parquet_parts(directory / "pq", documents, parts=3)
        return f"parquet:{directory / 'pq'}/*.parquet"
    return f"json:{write_jsonl(directory / 'docs.jsonl', documents)}"


def train_args(source: str, run_dir, cache_dir, streaming: bool) -> list[str]:
    return [
        *TINY,
        *STEPS,
        f"--data.source={source}",
        f"--data.streaming={str(streaming).lower()}",
        f"--data.cache_dir={cache_dir}",
        f"--training.run_dir={run_dir}",
    ]


def train(args: list[str], *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megascale.cli", "train", *args, *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=os.environ.copy())


def losses_by_step(run_dir) -> dict[int, float]:
    """The last logged loss of every step (a resumed run logs the steps after its checkpoint again)."""
    return {record["step"]: record["loss"] for record in read_metrics(run_dir)}


@pytest.mark.parametrize(
    ("kind", "streaming"),
    # Each format and each way of reading once (the two axes are independent: streaming reads the files
    # as they are, the other path tokenises them into shards first).
    [("parquet", True), pytest.param("json", False, marks=pytest.mark.slow)],
)
def test_sigkill_then_restart_reproduces_an_uninterrupted_run(tmp_path, kind, streaming):
    source = write_source(kind, tmp_path)
    cache = tmp_path / "cache"
    straight = train(train_args(source, tmp_path / "straight", cache, streaming))
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed_args = train_args(source, tmp_path / "killed", cache, streaming)
    killed = train(killed_args, "--resilience.inject=kill:rank=0:step=5")  # SIGKILL as step 5 begins
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert max(losses_by_step(tmp_path / "killed")) == 4
    resumed = train(killed_args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in (tmp_path / "killed" / "train.log").read_text()
    reference = losses_by_step(tmp_path / "straight")
    assert len(reference) == 6
    assert losses_by_step(tmp_path / "killed") == reference
    val_losses = [r["val_loss"] for r in read_metrics(tmp_path / "straight") if "val_loss" in r]
    assert len(val_losses) == 2  # validation on the held-out documents, at steps 3 and 6


def test_a_streamed_run_resumed_in_process_matches_an_uninterrupted_one(tmp_path):
    source = write_source("parquet", tmp_path)

    def config(run_dir):
        return load_config(None, train_args(source, run_dir, tmp_path / "cache", streaming=True))

    straight = Trainer(config(tmp_path / "straight"))
    straight.train()
    first = Trainer(config(tmp_path / "split"))
    for _ in range(3):  # what the loop does, stopping after step 3
        first.train_step()
        first.step += 1
    first.save_checkpoint(blocking=True)
    first.close()
    second = Trainer(config(tmp_path / "split"))
    assert second.step == 3
    second.train()
    reference = losses_by_step(tmp_path / "straight")
    assert losses_by_step(tmp_path / "split") == {step: reference[step] for step in (4, 5, 6)}


@pytest.mark.slow
def test_a_streamed_run_on_two_data_parallel_ranks_trains_as_one_rank_does(tmp_path):
    """Every rank walks the one global stream and takes its slice: the same samples per step as one rank,
    so the same losses (within float32 reduction order)."""
    source = write_source("json", tmp_path)
    for name, extra in (("one", []), ("two", ["--nproc", "2"])):
        result = train(train_args(source, tmp_path / name, tmp_path / "cache", streaming=True), *extra)
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = losses_by_step(tmp_path / "one"), losses_by_step(tmp_path / "two")
    assert one.keys() == two.keys() and len(one) == 6
    assert all(abs(one[step] - two[step]) <= 1e-5 * abs(one[step]) for step in one), (one, two)
