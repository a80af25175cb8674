"""`megascale train --nproc N`: real worker processes through torchrun's machinery, and its failures."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascale.checkpoint.checkpointer import list_checkpoints, read_manifest
from megascale.cli import main
from megascale.host import children_alive
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
    (step, newest), *_ = reversed(list_checkpoints(str(run_dir / "checkpoints")))
    assert step == 6 and read_manifest(newest)["layout"] == "pp 1 x dp 1x2 x tp 1 = 2 processes"


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
        "error: config: parallel pp x dp_replicate x tp = 2 does not divide the world size 3; "
        "valid parallel.tp: 1"
    ]


def test_a_worker_error_is_reported_once_with_its_exit_status(tiny_corpus, tmp_path):
    args = tiny_args(
        tiny_corpus, tmp_path / "run", tmp_path / "data", f"--data.source={tmp_path / 'missing'}"
    )
    result = megascale("train", "--nproc", "2", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert "does not exist" in result.stderr
    # Both ranks fail alike; whichever the launcher saw exit first is the one reported, once.
    assert len(re.findall(r"error: rank [01] of 2 exited with status 2", result.stderr)) == 1


def _rank_of(pid: int) -> int | None:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    ranks = [item.split(b"=", 1)[1] for item in environ if item.startswith(b"RANK=")]
    return int(ranks[0]) if ranks else None


def _start_long_job(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(
        tiny_corpus,
        run_dir,
        tmp_path / "data",
        "--parallel.dp_shard=2",
        "--training.steps=100000",
        "--checkpoint.every=100000",
    )
    job = subprocess.Popen(
        [sys.executable, "-m", "megascale.cli", "train", "--nproc", "2", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not ((run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 3):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.2)
    return job, run_dir


@pytest.mark.parametrize("target", ["launcher", "rank 1 only"])
def test_sigterm_saves_a_checkpoint_on_every_rank_at_the_same_step(tiny_corpus, tmp_path, target):
    job, run_dir = _start_long_job(tiny_corpus, tmp_path)
    try:
        if target == "launcher":
            job.send_signal(signal.SIGTERM)
        else:  # the other rank learns of it in the next step's all-reduce
            (worker,) = [pid for pid in children_alive(job.pid) if _rank_of(pid) == 1]
            os.kill(worker, signal.SIGTERM)
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, stderr[-3000:]
    (step, checkpoint), *_ = reversed(list_checkpoints(str(run_dir / "checkpoints")))
    assert step == read_metrics(run_dir)[-1]["step"]
    assert "received SIGTERM: saving a checkpoint" in stderr


def test_a_rank_destroys_its_process_group_when_training_ends(tiny_corpus, tmp_path):
    """A rank of `megascale train` leaves no process group alive at exit (NCCL warns about one). Here
    in-process, as the only rank of a gloo group made beforehand, which the trainer joins as a launched
    rank joins the one it makes."""
    import torch.distributed as dist

    from megascale.cli import main

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        args = tiny_args(tiny_corpus, tmp_path / "run", tmp_path / "data", "--training.steps=2")
        assert main(["train", *args]) == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_failure_reported_is_the_one_that_caused_the_others():
    """CI once saw rank 1 exit with a config error (2) and the agent terminate rank 0 (-15): the launch
    reported rank 0's SIGTERM and exited 1."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from megascale.launch import first_cause

    def failure(rank, exitcode):
        return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="")

    terminated, config_error, killed = failure(0, -signal.SIGTERM), failure(1, 2), failure(2, -signal.SIGKILL)
    assert first_cause({0: terminated, 1: config_error, 2: killed}) == (1, config_error)
    assert first_cause({0: terminated, 2: killed}) == (2, killed)  # the OOM killer's, not the agent's
    assert first_cause({3: failure(3, 1), 1: failure(1, 1)})[0] == 1


def _ended(run_dir: Path, events: list[dict], losses: dict[int, float], val: dict[int, float] | None = None):
    """A run directory as a driver leaves it: its events, and the metrics rank 0 logged."""
    import json

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps({"time": 0, **e}) + "\n" for e in events))
    records = [
        {"step": s, "loss": loss, **({"val_loss": val[s]} if val and s in val else {})}
        for s, loss in losses.items()
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_the_line_a_launch_ends_with_says_how_it_ended_its_last_loss_and_where_it_is(tmp_path):
    from megascale.launch import outcome

    driver, start = {"event": "driver"}, {"event": "start", "attempt": 0}
    done = _ended(tmp_path / "done", [driver, start, {"event": "done"}], {5: 5.5, 6: 5.25}, val={6: 5.375})
    assert outcome(done, 6, 0) == f"done: step 6/6, loss 5.2500, val loss 5.3750; run directory {done}"
    early = _ended(tmp_path / "early", [driver, {"event": "done"}], {3: 5.5})
    assert (
        outcome(early, 6, 0)
        == f"stopped at training.stop_at_step: step 3/6, loss 5.5000; run directory {early}"
    )
    signal_ = _ended(tmp_path / "signal", [driver, {"event": "stopped", "reason": "signal"}], {2: 6.0})
    assert outcome(signal_, 6, 0).startswith("stopped by signal, resumable: step 2/6, loss 6.0000;")
    # A previous launch's end in the same run directory is not this one's.
    gave_up = _ended(
        tmp_path / "gave-up",
        [
            driver,
            {"event": "done"},
            driver,
            {"event": "give_up", "reason": "resilience.max_restarts = 0 reached"},
        ],
        {4: "nan"},
    )
    assert outcome(gave_up, 6, 1) == (
        f"gave up (resilience.max_restarts = 0 reached): step 4/6, loss nan; run directory {gave_up}"
    )
    crashed = _ended(tmp_path / "crashed", [driver, start], {})
    assert outcome(crashed, 6, 1) == f"ended with status 1: no step logged; run directory {crashed}"


def test_launch_ends_with_that_line(tiny_corpus, tmp_path, monkeypatch, capsys):
    from megascale.resilience.driver import Driver

    run_dir = tmp_path / "run"

    def run(driver):
        _ended(run_dir, [{"event": "driver"}, {"event": "done"}], {6: 5.125})
        return 0

    monkeypatch.setattr(Driver, "run", run)
    assert main(["launch", *tiny_args(tiny_corpus, run_dir, tmp_path / "data")]) == 0
    said = f"done: step 6/6, loss 5.1250; run directory {run_dir}"
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(said)
    assert (run_dir / "driver.log").read_text().strip().endswith(said)
