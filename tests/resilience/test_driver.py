"""`megascale launch` end to end: real executors, torchrun and workers; faults injected, detected from
heartbeats, diagnosed, evicted and recovered from, with the events log as the record."""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascale.checkpoint.checkpointer import list_checkpoints
from megascale.checkpoint.staging import BASE
from megascale.errors import ConfigError
from megascale.host import free_port
from megascale.observe.events import read_events
from megascale.observe.metrics import read_metrics
from megascale.resilience.client import attempt_reports
from megascale.resilience.records import read_blocklist
from megascale.resilience.takeover import read_record
from megascale.stores.redis_store import start_redis_server
from tests.conftest import tiny_args

pytestmark = pytest.mark.xdist_group("driver")  # one worker runs them all: the module's reference run once

STEPS, EVERY = 12, 4
JOB = [
    f"--training.steps={STEPS}",
    f"--checkpoint.every={EVERY}",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=1",
    "--training.val_every=1000",
    "--resilience.heartbeat_interval_s=0.5",
    "--resilience.heartbeat_timeout_s=20",
]
# Where diagnosis is not under test: the node's own checks only. The link checks start fresh processes
# (an all-to-all on each node, an all-reduce between neighbours), about 10 s of each test.
NODE_CHECKS_ONLY = "--resilience.diagnose_bandwidth=false"


def run(command, tiny_corpus, tmp_path, name, *extra, nproc=None, timeout=400):
    run_dir = tmp_path / name
    args = tiny_args(tiny_corpus, run_dir, tmp_path / "data", *JOB, *extra)
    head = [sys.executable, "-m", "megascale.cli", command] + (["--nproc", str(nproc)] if nproc else [])
    result = subprocess.run([*head, *args], capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir


def losses(run_dir):
    """The last logged loss of every step (a restarted attempt logs its recomputed steps again)."""
    return {record["step"]: record["loss"] for record in read_metrics(run_dir)}


def kinds(events):
    return [event["event"] for event in events]


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory):
    """An uninterrupted run of the same 4-process job."""
    tmp_path = tmp_path_factory.mktemp("reference")
    return losses(run("train", tiny_corpus, tmp_path, "reference", "--parallel.dp_shard=4", nproc=4))


def test_sigkill_of_a_random_rank_is_recovered_with_identical_losses(reference, tiny_corpus, tmp_path):
    choice = random.Random()
    # KILL_STEP=S replays a printed choice (S = EVERY + 1 kills just after a snapshot: stage 2 runs on).
    rank, step = choice.randrange(4), int(os.environ.get("KILL_STEP", choice.randrange(2, STEPS)))
    print(f"killing rank {rank} at step {step}")
    run_dir = run(
        "launch",
        tiny_corpus,
        tmp_path,
        "killed",
        "--resilience.nodes=2",
        "--resilience.nproc_per_node=2",
        f"--resilience.inject=kill:rank={rank}:step={step}",
    )
    events = read_events(run_dir)
    assert kinds(events)[:4] == ["driver", "joined", "joined", "start"] and kinds(events)[-1] == "done"
    assert sorted(event["node"] for event in events[1:3]) == ["node-0", "node-1"]
    fault = next(event for event in events if event["event"] == "fault")
    restart = next(event for event in events if event["event"] == "restart")
    # The rank's end seen by its executor in /proc (rank_exit), or through torchrun's exit (process_exit).
    assert fault["kind"] in ("rank_exit", "process_exit") and restart["attempt"] == 1
    assert fault["kind"] == "process_exit" or rank in fault["ranks"]
    assert losses(run_dir) == reference  # bit for bit, every step
    said = (run_dir / "driver.log").read_text()  # the job's pace on the driver's console and in its log
    assert f"attempt 1 | step {STEPS}/{STEPS} | loss" in said
    # Attempt 0's pace once every rank reported a step at a heartbeat poll; a kill at step 2-6 may beat it.
    assert "attempt 0 | step " in said or step <= 6
    # Every rank restarted on the node it ran on, where its snapshot buffer is.
    for node in ("node-0", "node-1"):
        ranks = [
            sorted(p.name for p in run_dir.glob(f"nodes/{node}/attempt-{a}/rank-*.json")) for a in (0, 1)
        ]
        assert ranks[0] == ranks[1] and len(ranks[0]) == 2, (node, ranks)
    start = next(e for e in events if e["event"] == "start" and e["attempt"] == 1)
    recovered = next(e for e in events if e["event"] == "recovered")
    recomputed = (step - 1) - recovered["resumed_from"]
    print(
        f"fault detected {fault['time'] - events[3]['time']:.1f} s after the start; restarted "
        f"{start['time'] - fault['time']:.1f} s after detection; first new step after "
        f"{recovered['time'] - fault['time']:.1f} s; {recomputed} steps recomputed"
    )
    assert 0 <= recomputed < EVERY


@pytest.mark.slow
def test_two_hosts_train_as_one_job_and_recover_two_ranks_killed_at_once(
    reference, two_hosts, tiny_corpus, tmp_path
):
    """Executors on two hosts with their own addresses (network namespaces joined by a veth pair), started
    by hand as Slurm or Kubernetes would; the driver on the first host; ranks 1 and 3, one on each host,
    killed at the same step: two faults, both on record."""
    run_dir, store = tmp_path / "two-hosts", f"tcp://{two_hosts.addresses[0]}:29500"
    args = tiny_args(tiny_corpus, run_dir, tmp_path / "data", *JOB)
    launch = two_hosts.start(
        0,
        [
            sys.executable, "-m", "megascale.cli", "launch", *args,
            "--resilience.executors=external", "--resilience.job_id=twohosts", f"--resilience.store={store}",
            "--resilience.nodes=2", "--resilience.nproc_per_node=2",
            "--resilience.inject=kill:rank=1:step=6,kill:rank=3:step=6",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    for host, name in enumerate(("host-a", "host-b")):
        two_hosts.start(
            host,
            [
                sys.executable, "-m", "megascale.cli", "executor", "--store", store, "--job", "twohosts",
                "--node", name, "--address", two_hosts.addresses[host], "--run-dir", str(run_dir),
                "--interval", "0.5",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
    output, _ = launch.communicate(timeout=400)
    assert launch.returncode == 0, output[-4000:]
    events = read_events(run_dir)
    joined = {event["node"]: event["address"] for event in events if event["event"] == "joined"}
    assert joined == {"host-a": "10.77.0.1", "host-b": "10.77.0.2"}
    (fault,) = [event for event in events if event["event"] == "fault"]
    if fault["kind"] == "rank_exit":  # seen by the executors in /proc, gathered for a heartbeat interval
        assert {1, 3} <= set(fault["ranks"]) and fault["nodes"]["1"] == "host-a"
        assert fault["nodes"]["3"] == "host-b"
    else:  # torchrun exited first on both hosts: its failure summaries name the signals
        assert fault["kind"] == "process_exit"
        assert {fault["node"], *fault["also_struck"]} == {"host-a", "host-b"}
        struck = {rank: name for rank, name in fault["signalled_ranks"].items() if name == "SIGKILL"}
        assert struck == {"1": "SIGKILL", "3": "SIGKILL"}  # their peers got torchrun's SIGTERM
    assert kinds(events)[-1] == "done" and losses(run_dir) == reference
    # Ranks follow the addresses: 0-1 on the first host, 2-3 on the second, in both attempts.
    for host, ranks in (
        ("host-a", ["rank-0.json", "rank-1.json"]),
        ("host-b", ["rank-2.json", "rank-3.json"]),
    ):
        for attempt in (0, 1):
            assert sorted(p.name for p in run_dir.glob(f"nodes/{host}/attempt-{attempt}/rank-*")) == ranks
    for proc in two_hosts.procs:  # the executors left when the driver said exit
        assert proc.wait(timeout=60) == 0


def test_a_killed_driver_started_again_takes_the_job_over_without_losing_a_step(
    reference, tiny_corpus, tmp_path, monkeypatch
):
    """SIGKILL of the driver mid-run, from outside: its executors and their ranks train on (they ride out
    the loss of its store); `megascale launch` again on the same run directory serves the store again,
    adopts the executors and the attempt they run, and the job ends in that one attempt with the
    reference's losses and nothing left behind. A second launch while a driver runs is refused."""
    run_dir, args, base = two_node_job(tiny_corpus, tmp_path, monkeypatch, "driver-killed")
    launch = start_launch(args, tmp_path)
    try:
        wait_for_step(launch, run_dir, attempt=0, step=2)
        # What a second `megascale launch` checks first (in-process: the job must still run when killed).
        with pytest.raises(ConfigError, match=f"a driver \\(pid {launch.pid}\\) already runs"):
            read_record(run_dir)
        launch.kill()
        launch.wait()
        killed_at = time.time()
        launch = start_launch(args, tmp_path)
        _, err = launch.communicate(timeout=300)
    finally:
        stop(launch)
    assert launch.returncode == 0, err[-4000:]
    events = read_events(run_dir)
    assert "takeover" in kinds(events) and kinds(events)[-1] == "done"
    adopted = next(event for event in events if event["event"] == "adopted")
    assert adopted["attempt"] == 0 and "fault" not in kinds(events) and kinds(events).count("start") == 1
    print(f"job adopted {adopted['time'] - killed_at:.1f} s after the driver was killed")
    assert losses(run_dir) == reference
    ledger = [json.loads(line) for line in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
    assert [record["step"] for record in ledger if record["event"] == "commit"] == [4, 8, 12]
    assert not (run_dir / "driver.json").exists()
    assert not _processes_of(run_dir), "processes of the job outlived it"
    assert not list(base.glob("megascale-*")), "the job's staging outlived it"


def two_node_job(tiny_corpus, tmp_path, monkeypatch, name):
    """The run directory and arguments of a 2 nodes x 2 processes job, and its own staging base."""
    base = tmp_path / "shm"
    monkeypatch.setenv(BASE, str(base))
    run_dir = tmp_path / name
    args = tiny_args(
        tiny_corpus, run_dir, tmp_path / "data", *JOB, NODE_CHECKS_ONLY,
        "--resilience.nodes=2", "--resilience.nproc_per_node=2",
    )  # fmt: skip
    return run_dir, args, base


def stop(job):
    """Kill a launch still running (a failed test's), and reap it."""
    if job.poll() is None:
        job.kill()
        job.wait()


def start_launch(args, cwd):
    """`megascale launch` with `args` in the background; its stderr kept for the failure message."""
    command = [sys.executable, "-m", "megascale.cli", "launch", *args]
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_step(job, run_dir, attempt, step, rank=None, timeout_s=120):
    """Until a rank of `attempt` (`rank`, else any) reports `step` or later, while `job` runs; the report."""
    deadline = time.time() + timeout_s
    while True:
        for number, report in attempt_reports(run_dir, attempt).items():
            if rank in (None, number) and report["step"] >= step:
                return report
        assert time.time() < deadline and job.poll() is None, f"attempt {attempt} did not reach step {step}"
        time.sleep(0.05)


def test_an_error_in_the_jobs_input_ends_the_job_at_once_with_its_cause(tiny_corpus, tmp_path):
    """A restart would meet bad input again: the job ends after the first attempt, exit status 2, and the
    cause is in the fault, the give-up and the driver's console, not only in a per-attempt output.log."""
    run_dir = tmp_path / "bad-input"
    missing = tmp_path / "no-such-texts"
    args = tiny_args(
        tiny_corpus, run_dir, tmp_path / "data", *JOB, NODE_CHECKS_ONLY, f"--data.source={missing}"
    )
    result = subprocess.run(
        [sys.executable, "-m", "megascale.cli", "launch", *args, "--resilience.max_restarts=1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    events = read_events(run_dir)
    assert kinds(events).count("start") == 1 and kinds(events)[-1] == "give_up"
    fault, give_up = [event for event in events if event["event"] in ("fault", "give_up")]
    cause = f"data.source = '{missing}' does not exist"
    assert fault["kind"] == "input_error" and cause in fault["detail"] and cause in give_up["reason"]
    assert "diagnosis" not in kinds(events)
    assert cause in result.stdout + result.stderr and cause in (run_dir / "driver.log").read_text()


@pytest.mark.slow
def test_a_redis_restart_is_ridden_out_and_an_outage_past_the_grace_ends_the_job_resumable(
    reference, tiny_corpus, tmp_path, monkeypatch
):
    """redis-server killed mid-run, from outside. Back empty 3 s later: the driver re-seeds it and the job
    ends with the reference's losses. Not back within resilience.store_grace_s: the job ends (give_up,
    exit 1) naming the store and the checkpoint to resume from, leaves no process and no staging behind
    (the executors persist what their nodes left), and a new launch on the same run directory finishes
    the reference's curve."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    base = tmp_path / "shm"
    monkeypatch.setenv(BASE, str(base))
    port = free_port("127.0.0.1")
    store = f"--resilience.store=redis://127.0.0.1:{port}/0"

    def launch(name, *extra):
        args = tiny_args(
            tiny_corpus, tmp_path / name, tmp_path / "data", *JOB, NODE_CHECKS_ONLY, store, *extra
        )
        return start_launch([*args, "--resilience.nodes=2", "--resilience.nproc_per_node=2"], tmp_path)

    def kill_at_step_3(redis, job, run_dir):
        wait_for_step(job, run_dir, attempt=0, step=3)
        redis.kill()
        redis.wait()

    redis = start_redis_server(port)
    try:
        job = launch("restarted")
        kill_at_step_3(redis, job, tmp_path / "restarted")
        time.sleep(3)
        redis = start_redis_server(port)
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-4000:]
        events = read_events(tmp_path / "restarted")
        back = next(event for event in events if event["event"] == "store_back")
        assert back["reseeded"] and back["outage_s"] >= 3 and kinds(events)[-1] == "done"
        assert losses(tmp_path / "restarted") == reference

        job = launch("lost", "--resilience.store_grace_s=5")
        kill_at_step_3(redis, job, tmp_path / "lost")
        _, err = job.communicate(timeout=120)
        events = read_events(tmp_path / "lost")
        assert job.returncode == 1 and kinds(events)[-1] == "give_up", err[-4000:]
        reason = events[-1]["reason"]
        assert f"the control store redis://127.0.0.1:{port}/0 has been unreachable" in reason
        assert "resumable from the checkpoint of step" in reason
        assert not _processes_of(tmp_path / "lost"), "processes of the job outlived it"
        assert not list(base.glob("megascale-*")), "the job's staging outlived it"
        redis = start_redis_server(port)
        job = launch("lost")
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-4000:]
        assert losses(tmp_path / "lost") == reference
    finally:
        stop(job)
        redis.kill()
        redis.wait()


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_its_node_evicted_when_it_hangs_again(reference, tiny_corpus, tmp_path):
    """SIGSTOP of rank 2 (node-1), from outside, in two attempts running: each hang is blamed on that rank
    and node from the state the other ranks wrote (the stopped one writes none), and the second time the
    node, though it passes its self-check, is evicted; the spare takes its place and the job finishes the
    reference's curve."""
    run_dir = tmp_path / "stopped"
    args = tiny_args(
        tiny_corpus, run_dir, tmp_path / "data", *JOB, NODE_CHECKS_ONLY,
        "--resilience.nodes=2", "--resilience.nproc_per_node=2", "--resilience.spares=1",
        "--resilience.comm_flat_timeout_s=5", "--resilience.hang_timeout_s=300", "--metrics.hang_dump_s=2",
        "--parallel.timeout_s=300", "--resilience.stopped_timeout_s=0",  # found as a hang, not by its state
    )  # fmt: skip
    job = start_launch(args, tmp_path)
    try:
        for attempt in (0, 1):
            report = wait_for_step(job, run_dir, attempt, step=3, rank=2, timeout_s=180)
            os.kill(report["pid"], signal.SIGSTOP)
        _, err = job.communicate(timeout=400)
    finally:
        stop(job)
    assert job.returncode == 0, err[-4000:]
    events = read_events(run_dir)
    assert [event["kind"] for event in events if event["event"] == "fault"] == ["comm_flat"] * 2
    blames = [event for event in events if event["event"] == "blame"]
    assert [(blame["suspect_ranks"], blame["nodes"]) for blame in blames] == [([2], ["node-1"])] * 2
    assert "wrote no state" in blames[0]["reasons"]["2"]
    assert {"event": "evict", "node": "node-1"} in [
        {k: e[k] for k in ("event", "node")} for e in events if e["event"] == "evict"
    ]
    assert next(e for e in events if e["event"] == "start" and e["attempt"] == 2)["nodes"] == [
        "node-0",
        "node-2",
    ]
    assert kinds(events)[-1] == "done" and losses(run_dir) == reference
    assert not _processes_of(run_dir), "processes of the job outlived it"


@pytest.mark.alone  # a detection delay against the clock
def test_a_hung_rank_is_detected_within_the_timeout_and_recovered_via_redis(tiny_corpus, tmp_path, redis_url):
    hang_timeout, interval = 6.0, 0.5
    run_dir = run(
        "launch",
        tiny_corpus,
        tmp_path,
        "hung",
        "--resilience.nodes=1",
        "--resilience.nproc_per_node=2",
        "--resilience.inject=hang:rank=1:step=5",
        f"--resilience.hang_timeout_s={hang_timeout}",
        f"--resilience.store={redis_url}",
        "--parallel.timeout_s=300",
        "--metrics.hang_dump_s=2",
        NODE_CHECKS_ONLY,
    )
    events = read_events(run_dir)
    fault = next(event for event in events if event["event"] == "fault")
    assert fault["kind"] == "hang" and fault["last_step"] == 4
    last_progress = max(
        record["time"] for record in attempt_reports(run_dir, 0).values() if record["step"] == 4
    )
    delay = fault["time"] - last_progress
    print(
        f"hang detected {delay:.1f} s after the last step (timeout {hang_timeout} s, heartbeat {interval} s)"
    )
    assert delay <= hang_timeout + interval + 1.0  # + one reading of the progress files
    assert kinds(events)[-1] == "done" and max(losses(run_dir)) == STEPS
    assert not _processes_of(run_dir), "the hung worker outlived the job"
    # Every rank wrote where it stood before the restart; the analysis names the hung rank, and only it.
    analysis = subprocess.run(
        [sys.executable, "-m", "megascale.cli", "trace", "hang", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    print(analysis.stdout)
    suspects = analysis.stdout.split("suspects:")[1].strip().splitlines()
    assert analysis.returncode == 0 and len(suspects) == 1 and suspects[0].startswith("rank 1: not in any")


@pytest.mark.alone  # a detection delay against the clock
def test_silent_communication_is_a_hang_before_the_step_timeout(tiny_corpus, tmp_path):
    flat_timeout, interval = 5.0, 0.5
    run_dir = run(
        "launch",
        tiny_corpus,
        tmp_path,
        "silent",
        "--resilience.nodes=1",
        "--resilience.nproc_per_node=2",
        "--resilience.inject=hang:rank=0:step=5",
        "--resilience.hang_timeout_s=300",
        f"--resilience.comm_flat_timeout_s={flat_timeout}",
        "--parallel.timeout_s=300",
        "--metrics.hang_dump_s=2",
        NODE_CHECKS_ONLY,
    )
    events = read_events(run_dir)
    blame = next(event for event in events if event["event"] == "blame")
    assert blame["suspect_ranks"] == [0] and blame["nodes"] == ["node-0"]  # the hung rank, by its own state
    fault = next(event for event in events if event["event"] == "fault")
    assert fault["kind"] == "comm_flat" and fault["last_step"] == 4
    last_progress = max(
        record["time"] for record in attempt_reports(run_dir, 0).values() if record["step"] == 4
    )
    delay = fault["time"] - last_progress
    print(f"silent communication detected {delay:.1f} s after the last step (timeout {flat_timeout} s)")
    # The detector fires within two readings of the timeout, counted from the last byte the ranks moved.
    silent_s = float(re.search(r"no byte moved for ([\d.]+) s", fault["detail"])[1])
    assert flat_timeout <= silent_s <= flat_timeout + 2 * interval + 1.0
    # Bytes still move after the last step: the timeline's last flush (once a second) and the stall states
    # the ranks write metrics.hang_dump_s (2 s) after it; far inside hang_timeout_s (300 s) all the same.
    assert delay <= flat_timeout + 2.0 + 2.0 + 2 * interval
    assert kinds(events)[-1] == "done" and max(losses(run_dir)) == STEPS


@pytest.mark.slow
@pytest.mark.alone  # another test's load would be a step-time collapse of its own
def test_a_rank_turning_slow_is_a_step_time_collapse_and_restarted(tiny_corpus, tmp_path):
    run_dir = run(
        "launch",
        tiny_corpus,
        tmp_path,
        "slowed",
        "--resilience.nodes=1",
        "--resilience.nproc_per_node=2",
        "--training.steps=30",
        # 30x the compute's CPU time (the stretch is on the compute clock): with the tiny model's steps
        # mostly waiting and Python, 10x gave some runs a step time under the detector's 3x median.
        "--resilience.inject=slow:rank=1:factor=30:step=16",
        "--resilience.heartbeat_interval_s=0.2",
        "--resilience.anomaly_window=10",
        "--resilience.anomaly_action=restart",
        NODE_CHECKS_ONLY,
    )
    events = read_events(run_dir)
    (collapse,) = [event for event in events if event["event"] == "slow_steps"]
    print(
        f"step time {collapse['step_time_s']:.2f} s against a median of {collapse['median_s']:.2f} s, "
        f"reported at step {collapse['step']}"
    )
    assert collapse["step"] >= 16 and collapse["step_time_s"] > 3 * collapse["median_s"]
    assert collapse["action"] == "restart"
    fault = next(event for event in events if event["event"] == "fault")
    assert fault["kind"] == "slow_steps" and fault["step"] == collapse["step"]
    # The injected slowness is in the first attempt only: the restart runs at full speed to the end.
    assert 12 <= next(e for e in events if e["event"] == "restart")["checkpoint_step"] <= fault["step"]
    assert kinds(events).count("slow_steps") == 1 and kinds(events)[-1] == "done"
    assert max(losses(run_dir)) == 30


def _processes_of(run_dir):
    """Live processes whose command line names `run_dir` (ours: the test started them)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(run_dir).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def test_nan_is_seen_by_every_rank_at_its_step_and_skipped(tiny_corpus, tmp_path):
    run_dir = run(
        "launch",
        tiny_corpus,
        tmp_path,
        "nan",
        "--resilience.nodes=1",
        "--resilience.nproc_per_node=2",
        "--resilience.inject=nan:step=3",
        "--resilience.nan_policy=skip",
    )
    events = read_events(run_dir)
    (nonfinite,) = [event for event in events if event["event"] == "nonfinite"]
    assert nonfinite["step"] == 3 and nonfinite["ranks"] == [0, 1]
    assert "fault" not in kinds(events) and kinds(events)[-1] == "done"
    log = (run_dir / "train.log").read_text()
    assert "step 3: non-finite gradient norm (nan); update skipped" in log


@pytest.mark.slow
def test_a_node_failing_diagnostics_is_evicted_and_replaced_by_a_spare(tiny_corpus, tmp_path):
    # Three nodes, so the all-reduce between neighbours can tell which one damages the data.
    run_dir = run(
        "launch",
        tiny_corpus,
        tmp_path,
        "evict",
        "--resilience.nodes=3",
        "--resilience.nproc_per_node=1",
        "--resilience.spares=1",
        "--resilience.inject=kill:rank=0:step=3,link_fail:node=1",
        "--parallel.dp_shard=3",
        "--training.global_batch_size=6",
    )
    events = read_events(run_dir)
    bad_links = [event for event in events if event["event"] == "bad_link"]
    assert sorted(map(tuple, (e["nodes"] for e in bad_links))) == [("node-0", "node-1"), ("node-1", "node-2")]
    assert all(event["blamed"] == ["node-1"] for event in bad_links)
    diagnosis = {e["node"]: e for e in events if e["event"] == "diagnosis"}
    assert diagnosis["node-0"]["checks"]["links"]["node-2"]["ok"] and diagnosis["node-0"]["passed"]
    assert not diagnosis["node-1"]["passed"] and "every neighbour" in diagnosis["node-1"]["reason"]
    assert [e["node"] for e in events if e["event"] == "evict"] == ["node-1"]
    starts = [e for e in events if e["event"] == "start"]
    assert starts[0]["nodes"] == ["node-0", "node-1", "node-2"]
    assert starts[1]["nodes"] == ["node-0", "node-2", "node-3"]
    assert read_blocklist(run_dir) == ["node-1"] and kinds(events)[-1] == "done"


@pytest.mark.slow
def test_a_corrupted_newest_checkpoint_falls_back_and_still_matches(reference, tiny_corpus, tmp_path):
    run_dir = run(
        "launch",
        tiny_corpus,
        tmp_path,
        "corrupt",
        "--resilience.nodes=2",
        "--resilience.nproc_per_node=2",
        # Rank 0 truncates the newest checkpoint (step 8's) as step 9 begins; rank 2 dies at step 10.
        "--resilience.inject=corrupt_checkpoint:step=9,kill:rank=2:step=10",
        "--checkpoint.async_save=false",
        NODE_CHECKS_ONLY,
    )
    log = (run_dir / "train.log").read_text()
    assert re.search(r"inject: truncated \S+\.distcp of the checkpoint at \S+step-00000008", log), log
    assert "step 8 at" in log and "failed verification" in log and "resumed from" in log
    assert losses(run_dir) == reference
    assert [step for step, _ in list_checkpoints(run_dir / "checkpoints")][-1] == STEPS
