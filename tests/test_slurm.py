"""deploy/slurm/megascale.sbatch run by a real Slurm on this machine: munged, slurmctld and two slurmd
(nodes n1 and n2 on one host, each on its own port) started here in a temporary directory on free loopback
ports, then stopped by pid. The job is submitted with sbatch as a user would, with `--gpus-per-node=0`
(no GPUs here) and 2 training processes per node.

Skipped, with the reason, only where Slurm cannot start: its programs missing (.ci/run installs Debian's
slurmctld and slurmd, which bring munge and slurm-client), not root, or a daemon refusing to come up."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascale.checkpoint.staging import BASE, staging_base
from megascale.host import free_port
from megascale.observe.events import read_events
from megascale.observe.metrics import read_metrics
from megascale.resilience.client import attempt_reports
from tests.conftest import tiny_args

pytestmark = pytest.mark.xdist_group("slurm")  # one worker runs them all: one Slurm cluster

SBATCH = Path(__file__).resolve().parents[1] / "deploy" / "slurm" / "megascale.sbatch"
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
NODES = ("n1", "n2")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
NPROC = 2  # training processes per node: 4 ranks
STEPS, EVERY = 60, 4
JOB = [
    f"--training.steps={STEPS}",
    f"--checkpoint.every={EVERY}",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=1",
    "--training.val_every=1000",
]
# The driver's settings for this machine; the sbatch script passes arguments after its name on to it.
DRIVER = ["--resilience.heartbeat_timeout_s=20", "--resilience.diagnose_bandwidth=false"]
INTERVAL = "0.5"


class Slurm:
    """A one-host Slurm cluster under `root`: munged, slurmctld, one slurmd per node name."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.jobs: list[str] = []
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
        self.env["SLURM_CONF"] = str(self.conf)

    # -- the daemons ----------------------------------------------------------------------------------
    def start(self) -> None:
        munge = self.root / "m"
        munge.mkdir(mode=0o700)
        key = munge / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = munge / "sock"
        self._daemon(
            "munged",
            ["munged", "-F", "-f", f"--socket={socket_path}", f"--key-file={key}"]
            + [f"--log-file={munge / 'log'}", f"--pid-file={munge / 'pid'}", f"--seed-file={munge / 'seed'}"],
        )
        self._until(socket_path.exists, 10, "munged made no socket")
        self.conf.write_text(self._config(socket_path))
        for name in ("state", "log", *(f"spool/{node}" for node in NODES)):
            (self.root / name).mkdir(parents=True)
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._until(lambda: self.command("scontrol", "ping").returncode == 0, 20, "slurmctld is not up")
        for node in NODES:
            self._daemon(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
        self._until(self._nodes_idle, 30, "the nodes are not idle")

    def _config(self, munge_socket: Path) -> str:
        host = socket.gethostname().split(".")[0]
        cpus = re.search(
            r"\bCPUs=(\d+)",
            subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout,
        )
        ports = [free_port("127.0.0.1") for _ in range(1 + len(NODES))]
        root = self.root
        lines = [
            "ClusterName=megascale",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # A job's credentials outlive it by cred_expire, and a requeued job waits that long before it
            # starts again (Slurm's default: 120 s).
            f"AuthInfo=socket={munge_socket},cred_expire=5",
            # Schedule every second (a requeued job becomes eligible with no event to wake the scheduler).
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}/%n",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
            # No cgroups here: processes are tracked by their parents, and tasks are not bound to cores.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            # Job ids name the driver's job and its /dev/shm staging: not the same in every session.
            f"FirstJobId={100_000 + os.getpid() % 800_000}",
            *(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={cpus[1] if cpus else os.cpu_count()}"
                for node, port in zip(NODES, ports[1:], strict=True)
            ),
            f"PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
        ]
        return "\n".join(lines) + "\n"

    def _daemon(self, name: str, command: list[str]) -> None:
        with open(self.root / f"{name}.out", "wb") as out:
            self.procs[name] = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def _until(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}: {self._last_line(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} after {timeout_s:.0f} s")
            time.sleep(0.2)

    def _last_line(self, name: str) -> str:
        lines = (self.root / f"{name}.out").read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    def _nodes_idle(self) -> bool:
        states = self.command("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
        return states == [word for node in NODES for word in (node, "idle")]

    def stop(self) -> None:
        """Cancel the jobs still running, wait for them to end, then stop the daemons, last started first."""
        active = [job for job in self.jobs if self.state(job) in ("PENDING", "RUNNING", "COMPLETING")]
        if active:
            self.command("scancel", *active)
            deadline = time.monotonic() + 60
            while any(self.state(job) in ("RUNNING", "COMPLETING") for job in active):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        for proc in reversed(self.procs.values()):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    # -- jobs -----------------------------------------------------------------------------------------
    def command(
        self, *args: str, env: dict | None = None, timeout: float = 30
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            args, capture_output=True, text=True, env={**self.env, **(env or {})}, timeout=timeout
        )

    def sbatch(self, *args: str, env: dict) -> str:
        result = self.command("sbatch", "--parsable", *args, env=env)
        assert result.returncode == 0, result.stderr
        job = result.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def show(self, job: str) -> dict[str, str]:
        """`scontrol show job`'s fields (one word values, enough for the state, exit code and restarts)."""
        result = self.command("scontrol", "show", "job", "-o", job)
        return dict(re.findall(r"(\w+)=(\S*)", result.stdout)) if result.returncode == 0 else {}

    def state(self, job: str) -> str | None:
        return self.show(job).get("JobState")

    def wait(self, job: str, timeout_s: float, **expected: str) -> dict[str, str]:
        """Until the job has ended (with `expected` fields, e.g. Restarts="1"); its fields."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.show(job)
            if fields.get("JobState") in ENDED and expected.items() <= fields.items():
                return fields
            assert time.monotonic() < deadline, f"job {job} has not ended in {timeout_s} s: {fields}"
            time.sleep(0.5)


def _why_no_slurm() -> str | None:
    missing = [name for name in PROGRAMS if shutil.which(name) is None]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)}; apt-get install slurmctld slurmd)"
    if os.geteuid() != 0:
        return "Slurm's daemons need root (slurmd starts every job as its user)"
    return None


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    if reason := _why_no_slurm():
        pytest.skip(reason)
    cluster = Slurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        cluster.stop()
        pytest.skip(f"Slurm's daemons do not start here: {err}")
    yield cluster
    cluster.stop()


def _toml(args: list[str]) -> str:
    """`--section.key=value` overrides as a TOML file's text (the last of a key's values wins)."""
    sections: dict[str, dict[str, str]] = {}
    for arg in args:
        key, value = arg[2:].split("=", 1)
        section, name = key.rsplit(".", 1)
        if value not in ("true", "false") and not re.fullmatch(r"-?[0-9][0-9.e+-]*", value):
            value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        sections.setdefault(section, {})[name] = value
    return "".join(
        f"[{section}]\n" + "".join(f"{name} = {value}\n" for name, value in keys.items()) + "\n"
        for section, keys in sections.items()
    )


def _submission(tmp_path, tiny_corpus, data_dir, name, **env):
    """The run directory, the job's output file and sbatch's environment for a job of the tiny config."""
    run_dir, config = tmp_path / name, tmp_path / f"{name}.toml"
    config.write_text(_toml(tiny_args(tiny_corpus, run_dir, data_dir, *JOB)))
    settings = {
        "RUN_DIR": str(run_dir),
        "CONFIG": str(config),
        "SPARES": "0",
        "GPUS_PER_NODE": str(NPROC),
        "STORE_HOST": "127.0.0.1",  # both nodes are this host
        "STORE_PORT": str(free_port("127.0.0.1")),
        "INTERVAL": INTERVAL,
        BASE: str(staging_base()),  # this test's, where it looks for what the job left (tests/conftest.py)
        **env,
    }
    return run_dir, tmp_path / f"{name}.out", settings


def _sbatch_args(out, *driver_args):
    return [
        f"--nodes={len(NODES)}",
        "--gpus-per-node=0",  # CPU-only nodes: overrides the script's --gpus-per-node=8
        "--open-mode=append",  # a requeued job adds to its output
        f"--output={out}",
        str(SBATCH),
        *driver_args,
    ]


def losses(run_dir):
    """The last logged loss of every step (a restarted attempt logs its recomputed steps again)."""
    return {record["step"]: record["loss"] for record in read_metrics(run_dir) if "loss" in record}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The tiny corpus, prepared once for every run of the module."""
    return tmp_path_factory.mktemp("slurm-data")


@pytest.fixture(scope="module")
def reference(tiny_corpus, data_dir, tmp_path_factory, slurm):
    """An uninterrupted run of the same job, 4 processes with `megascale train` (no Slurm)."""
    tmp_path = tmp_path_factory.mktemp("slurm-reference")
    args = tiny_args(tiny_corpus, tmp_path / "run", data_dir, *JOB, "--parallel.dp_shard=4")
    command = [sys.executable, "-m", "megascale.cli", "train", "--nproc", str(NPROC * len(NODES)), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(tmp_path / "run")


def _processes_naming(path):
    """Live processes whose command line names `path`: the job's driver, executors, torchruns, ranks."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(path).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def _slurmstepds():
    found = set()
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == "slurmstepd":
                found.add(int(comm.parent.name))
        except OSError:
            continue
    return found


def _rank_pid(run_dir, rank):
    """The pid of training rank `rank` (a worker of torchrun: RANK in its environment)."""
    for pid in _processes_naming(run_dir):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"torch.distributed.run" not in cmdline and f"RANK={rank}".encode() in environ:
            return pid
    return None


def _wait_for_step(slurm, job, run_dir, attempt, step, timeout_s=180):
    """Until a rank of `attempt` reports `step` or later, while the job runs; that step."""
    deadline = time.monotonic() + timeout_s
    while True:
        steps = [report["step"] for report in attempt_reports(run_dir, attempt).values()]
        if steps and max(steps) >= step:
            return max(steps)
        assert slurm.state(job) in ("PENDING", "RUNNING"), f"job {job} ended before step {step}"
        assert time.monotonic() < deadline, f"attempt {attempt} did not reach step {step}"
        time.sleep(0.1)


def _wait_for_event(run_dir, name, timeout_s, **fields):
    deadline = time.monotonic() + timeout_s
    while True:
        for event in read_events(run_dir):
            if event["event"] == name and fields.items() <= event.items():
                return event
        assert time.monotonic() < deadline, f"no {name} event {fields} in {timeout_s} s"
        time.sleep(0.2)


def _commits(run_dir):
    """The steps of the run's committed checkpoints, in order."""
    ledger = [json.loads(line) for line in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
    return [record["step"] for record in ledger if record["event"] == "commit"]


def _nothing_left(run_dir, job, stepds_before):
    assert not _processes_naming(run_dir), "processes of the job outlived it"
    deadline = time.monotonic() + 30  # a job is COMPLETED before its slurmstepds have exited
    while left := _slurmstepds() - stepds_before:
        assert time.monotonic() < deadline, f"slurmstepd processes outlived the job: {sorted(left)}"
        time.sleep(0.2)
    assert not (staging_base() / f"megascale-{job}").exists(), "the job's staging outlived it"


@pytest.mark.slow
def test_an_sbatch_job_recovers_a_killed_rank_stops_on_sigterm_and_resumes_when_requeued(
    slurm, reference, tiny_corpus, data_dir, tmp_path
):
    """The whole story under Slurm: a 2 nodes x 2 processes job; rank 3 killed with SIGKILL, which the
    driver inside the job recovers from by itself; then `scancel --batch --signal=TERM` (what
    `--signal=B:TERM@N` does before the time limit), on which the driver stops the nodes gracefully and the
    job ends with status 0; then `scontrol requeue`, which runs the script again as the same job with the
    same RUN_DIR: the run resumes from its newest checkpoint, not from step 0, and ends with the losses of
    an uninterrupted run, leaving no process and no staging behind."""
    stepds_before = _slurmstepds()
    run_dir, out, env = _submission(tmp_path, tiny_corpus, data_dir, "job", CONNECT_TIMEOUT="120")
    submitted = time.monotonic()
    job = slurm.sbatch(*_sbatch_args(out, *DRIVER), env=env)
    try:
        killed_step = _wait_for_step(slurm, job, run_dir, attempt=0, step=6)
        pid = _rank_pid(run_dir, 3)
        assert pid is not None, "rank 3 not found"
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        recovered = _wait_for_event(run_dir, "recovered", 180, attempt=1)
        _wait_for_step(slurm, job, run_dir, attempt=1, step=16)
        result = slurm.command("scancel", "--batch", "--signal=TERM", job)
        assert result.returncode == 0, result.stderr
        first = slurm.wait(job, 120)
        first_s = time.monotonic() - submitted
        stopped_at, committed = max(losses(run_dir)), _commits(run_dir)
        assert first["JobState"] == "COMPLETED" and first["ExitCode"] == "0:0", first
        assert 16 <= stopped_at < STEPS, stopped_at

        result = slurm.command("scontrol", "requeue", job)
        assert result.returncode == 0, result.stderr
        requeued = time.monotonic()
        second = slurm.wait(job, 180, Restarts="1")
        second_s = time.monotonic() - requeued
    finally:
        if slurm.state(job) in ("PENDING", "RUNNING"):
            slurm.command("scancel", job)
    output = out.read_text(errors="replace")
    assert second["JobState"] == "COMPLETED" and second["ExitCode"] == "0:0", output[-4000:]

    events = read_events(run_dir)
    kinds = [event["event"] for event in events]
    fault = next(event for event in events if event["event"] == "fault")
    # The rank's exit seen by itself (rank_exit), or through its torchrun's failure (process_exit).
    assert fault["kind"] in ("rank_exit", "process_exit"), fault
    assert 3 in fault.get("ranks", []) or fault.get("signalled_ranks", {}).get("3") == "SIGKILL", fault
    joined = {event["node"] for event in events if event["event"] == "joined"}
    assert joined == set(NODES)
    # The signal stopped the nodes gracefully: the driver's stop, and the ranks' (a checkpoint first).
    stopped = events[kinds.index("stopped", kinds.index("recovered"))]
    assert stopped.get("reason") == "signal", stopped
    assert "received SIGTERM" in (run_dir / "train.log").read_text()
    # The requeued job is a second driver on the same run directory: it resumed from the newest checkpoint
    # committed when the first one ended, and trained on to the end without a fault.
    assert kinds.count("driver") == 2 and kinds[-1] == "done"
    second_driver = len(kinds) - 1 - kinds[::-1].index("driver")
    resumed = [
        int(step) for step in re.findall(r"resumed from .*?\bstep (\d+)", (run_dir / "train.log").read_text())
    ]
    assert resumed[-1] == committed[-1] >= recovered["resumed_from"] and resumed[-1] > 0, (resumed, committed)
    assert losses(run_dir) == reference  # bit for bit, every step
    faults = [(e["kind"], e["detail"]) for e in events[second_driver:] if e["event"] == "fault"]
    assert not faults, f"the requeued job's driver saw faults: {faults}"
    _nothing_left(run_dir, job, stepds_before)
    after_kill = recovered["time"] - killed_at
    print(
        f"job {job}: rank 3 killed at step {killed_step}; next step {after_kill:.1f} s after the kill "
        f"(resumed from {recovered['resumed_from']}); stopped by SIGTERM after step {stopped_at} "
        f"(newest checkpoint committed: step {committed[-1]}), {first_s:.0f} s after sbatch; requeued, "
        f"resumed from step {resumed[-1]}, ended {second_s:.0f} s after the requeue; {len(reference)} "
        "losses identical to the uninterrupted run"
    )


def test_an_unreachable_store_fails_the_job_loudly_within_the_connect_timeout(
    slurm, tiny_corpus, data_dir, tmp_path
):
    """No store at the rendezvous address (the driver refused its config and never served one): each
    node's executor fails with the address in its error within its --connect-timeout (CONNECT_TIMEOUT),
    and the job ends with the driver's status, not after the 300 s default or never."""
    stepds_before = _slurmstepds()
    timeout_s = 5
    run_dir, out, env = _submission(
        tmp_path, tiny_corpus, data_dir, "unreachable", CONNECT_TIMEOUT=str(timeout_s)
    )
    submitted = time.monotonic()
    job = slurm.sbatch(*_sbatch_args(out, "--training.no_such_key=1"), env=env)
    try:
        fields = slurm.wait(job, 90)
    finally:
        if slurm.state(job) in ("PENDING", "RUNNING"):
            slurm.command("scancel", job)
    elapsed = time.monotonic() - submitted
    output = out.read_text(errors="replace")
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0", output[-3000:]
    assert "error: config: unknown key 'training.no_such_key'" in output
    port = env["STORE_PORT"]
    for label in range(len(NODES)):  # srun --label: the task (node) number
        errors = [line for line in output.splitlines() if line.startswith(f"{label}: error: executor ")]
        assert errors, output[-3000:]
        assert (
            f"timed out after {timeout_s * 1000}ms while trying to connect to (127.0.0.1, {port})"
            in errors[-1]
        )
    print(f"job {job}: failed {elapsed:.0f} s after sbatch; each executor's last line: {errors[-1][3:]}")
    assert elapsed < timeout_s + 40
    _nothing_left(run_dir, job, stepds_before)
