"""`megascale rehearse --soak DURATION --fault-every S --seed N`: one long job under a stream of faults
done from outside, and its goodput.

The rehearsal's table says what one fault does to a fresh job. A job left alone for weeks meets faults
one after another, each finding the standby, the snapshots and the spare nodes in whatever state the
last one left them. The soak runs one `megascale launch` job (the rehearsal's 2 nodes x 2 processes of a
tiny model, with a warm standby, a snapshot in memory every 2 steps, a Redis control store and one spare
node) for DURATION, and in each window of S seconds does one fault to it at a random moment: the classes
are drawn in shuffled rounds (seeded by N), so each comes up. Then it stops the job (SIGTERM: the ranks
save), trains the same job undisturbed to the same step, and checks every loss and the final weights bit
for bit, and that no process and no byte of staging is left. It writes `soak.json`, `soak.md` (the
per-fault and per-class tables) and `goodput.svg` into the work directory; `megascale report` on the
soak's run directory shows the chart too.

NaN, the failing self-check and the slow rank are written into the job's `@file` fault spec
(resilience/inject.py) for the attempt running and a step to come: nothing outside a process makes its
loss NaN or its self-check fail, and a throttle from outside slows a rank by what the machine's scheduler
allows, not by a set factor.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megascale.checkpoint.manifest import list_checkpoints
from megascale.checkpoint.staging import staging_base
from megascale.observe.events import read_events
from megascale.observe.goodput import ettr, progress_chart
from megascale.observe.metrics import read_metrics
from megascale.resilience.client import attempt_reports
from megascale.resilience.trial import JOB, Job, losses, processes_naming, staged_bytes

SCHEDULE_STEPS = 1_000_000  # the learning-rate schedule's length: the soak ends the job, not its steps
# The rehearsal's job, made to last: every step logged (the goodput is read from the records), a replica
# of the state on each node (so a replaced node's ranks restore from the other's memory), a snapshot in
# memory every 2 steps and one in storage every 50, a warm standby, stopped ranks found in a second.
SOAK_JOB = [
    *(arg for arg in JOB if not arg.startswith(("--training.steps=", "--checkpoint.every="))),
    f"--training.steps={SCHEDULE_STEPS}",
    "--parallel.dp_replicate=2",
    "--parallel.dp_shard=2",
    "--checkpoint.every=50",
    "--checkpoint.snapshot_every=2",
    "--resilience.standby=true",
    "--resilience.heartbeat_interval_s=0.25",
    "--resilience.stopped_timeout_s=1",
    "--resilience.max_restarts=1000",
    # A slow rank is one of the faults: a step-time collapse restarts. A loss spike is not, and the tiny
    # model's loss has heavy tails (z up to 5.2 over 50 readings in 1,500 undisturbed steps): off.
    "--resilience.anomaly_action=restart",
    "--resilience.loss_spike_z=0",
    "--resilience.nan_policy=rollback",
]
WORLD = 4  # the rehearsal's job: 2 nodes x 2 processes
STOP_TIMEOUT_S = 180.0  # for the job to save and end once told to stop
RUNNING_TIMEOUT_S = 180.0  # for the job to train again before the next fault


@dataclass
class Injected:
    """One fault of the soak: what was done, to what, when, at which step of which attempt."""

    fault: str
    how: str
    time: float
    step: int
    attempt: int


class SoakJob:
    """The soak's job and what a fault needs of it: its processes, its attempt and step, its fault file."""

    def __init__(self, work: Path, job_args: list[str], redis_port: int, rng: random.Random):
        self.inject_file = work / "inject.txt"
        self.inject_file.unlink(missing_ok=True)
        self.redis_port = redis_port
        self.job = Job(
            work,
            "soak",
            [
                *job_args,
                f"--resilience.store=redis://127.0.0.1:{redis_port}/0",
                "--resilience.spares=1",
                f"--resilience.inject=@{self.inject_file}",
            ],
        )
        self.rng = rng
        self.redis: subprocess.Popen | None = None

    @property
    def run_dir(self) -> Path:
        return self.job.run_dir

    def attempt(self, events: list[dict[str, Any]] | None = None) -> int:
        """The newest attempt started (read from `events` when given, else from the run's events)."""
        events = read_events(self.run_dir) if events is None else events
        starts = [event for event in events if event["event"] == "start"]
        return starts[-1]["attempt"] if starts else 0

    def nodes(self) -> list[str]:
        starts = [event for event in read_events(self.run_dir) if event["event"] == "start"]
        return starts[-1]["nodes"] if starts else []

    def reports(self) -> dict[int, dict[str, Any]]:
        return attempt_reports(self.run_dir, self.attempt())

    def step(self) -> int:
        return max((report["step"] for report in self.reports().values()), default=0)

    def standby_ready(self, attempt: int | None = None) -> bool:
        """Whether every rank of the next attempt waits, built, as the job's warm standby (True where the
        job's overrides turned the standby off)."""
        if "--resilience.standby=false" in self.job.args:
            return True
        attempt = self.attempt() if attempt is None else attempt
        ready = self.run_dir.glob(f"nodes/*/attempt-{attempt + 1}/standby-*.json")
        return len(list(ready)) >= WORLD

    def wait_training(self, after: float, timeout_s: float = RUNNING_TIMEOUT_S, standby: bool = True) -> None:
        """Until every rank of the newest attempt has reported a step taken after `after` (a restarted
        attempt once it has taken its first step: a standby's report at its activation is not one), and
        (`standby`) the next attempt stands by: a fault is done to a job that has recovered from the one
        before."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            events = read_events(self.run_dir)
            attempt = self.attempt(events)
            reports = attempt_reports(self.run_dir, attempt)
            trains = len(reports) >= WORLD and all(report["time"] > after for report in reports.values())
            if trains and attempt > 0:
                recovered = [event for event in events if event["event"] == "recovered"]
                trains = any(event["attempt"] == attempt for event in recovered)
            if trains and (not standby or self.standby_ready(attempt)):
                return
            if self.job.proc.poll() is not None:
                raise RuntimeError(f"the soak's job ended (exit {self.job.proc.returncode})")
            time.sleep(0.1)
        raise RuntimeError(f"the soak's job did not train again within {timeout_s:.0f} s")

    def wait_noticed(self, fault: FaultClass, since: float, attempt: int) -> None:
        """Until the job has noticed the fault done at `since` (one of its events), and restarted after
        `attempt` if it is to: a slow rank or a NaN sets it off some steps later, and a killed executor is
        replaced some seconds later; the next fault must not land in between."""
        deadline = time.time() + RUNNING_TIMEOUT_S
        while True:
            events = [event for event in read_events(self.run_dir) if event["time"] >= since]
            noticed = any(event["event"] in fault.noticed_by for event in events)
            restarted = any(event["event"] == "start" and event["attempt"] > attempt for event in events)
            if noticed and (restarted or not fault.restarts):
                return
            if time.time() > deadline or self.job.proc.poll() is not None:
                raise RuntimeError(f"the soak's job did not recover from a fault done at {since:.0f}")
            time.sleep(0.1)

    def rank_pid(self, rank: int | None = None) -> tuple[int, int]:
        """(rank, pid) of `rank`, or of a random rank, of the newest attempt."""
        reports = self.reports()
        rank = self.rng.choice(sorted(reports)) if rank is None else rank
        return rank, reports[rank]["pid"]

    def add_fault(self, spec: str) -> None:
        """Append an item to the job's fault file (by rename: a rank never reads half of it)."""
        old = self.inject_file.read_text() if self.inject_file.exists() else ""
        staged = self.inject_file.with_suffix(".tmp")
        staged.write_text(old + spec + "\n")
        os.replace(staged, self.inject_file)


# -- the faults: each does one to the job and says what it did --------------------------------------------
def kill_rank(soak: SoakJob) -> str:
    rank, pid = soak.rank_pid()
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILL rank {rank}"


def stop_rank(soak: SoakJob) -> str:
    rank, pid = soak.rank_pid()
    os.kill(pid, signal.SIGSTOP)
    return f"SIGSTOP rank {rank}"


def kill_executor(soak: SoakJob) -> str:
    node = soak.rng.choice(soak.nodes())
    os.kill(soak.job.executor_pid(node), signal.SIGKILL)
    return f"SIGKILL {node}'s executor"


def restart_store(soak: SoakJob) -> str:
    from megascale.stores.redis_store import start_redis_server

    assert soak.redis is not None
    soak.redis.kill()
    soak.redis.wait()
    time.sleep(3)
    soak.redis = start_redis_server(soak.redis_port)
    return "SIGKILL redis-server; restarted empty 3 s later"


def slow_rank(soak: SoakJob) -> str:
    """A rank that computes 30 times slower from the step after next, as a sick GPU does (in-job hook: its
    compute is stretched by a busy loop; the tiny model's step is mostly Python and waiting, so 30x the
    compute is what reliably takes the step past the detector's 3x median). A throttle from outside
    (SIGSTOP/SIGCONT) is at the mercy of the scheduler: on a busy machine its run slices stretch and the
    rank was only ~3x slower."""
    rank, _ = soak.rank_pid()
    step = soak.step() + 2
    soak.add_fault(f"slow:rank={rank}:factor=30:step={step}:attempt={soak.attempt()}")
    return f"rank {rank} computes 30x slower from step {step} (in-job hook)"


def nan_loss(soak: SoakJob) -> str:
    step = soak.step() + 3
    soak.add_fault(f"nan:step={step}:attempt={soak.attempt()}")
    return f"step {step}'s loss made NaN (in-job hook); nan_policy rollback"


def corrupt_checkpoint(soak: SoakJob) -> str:
    """Truncate a data file of the newest committed checkpoint, then SIGKILL a rank."""
    found = list_checkpoints(str(soak.run_dir / "checkpoints"))
    what = "no checkpoint yet"
    if found:
        shard = sorted(Path(found[-1][1]).glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        what = f"truncated {Path(found[-1][1]).name}/{shard.name}"
    return f"{what}; {kill_rank(soak)}"


def failing_node(soak: SoakJob) -> str:
    """A node that fails its next self-check (in-job hook), and a rank killed so that one runs."""
    node = soak.rng.choice(soak.nodes())
    soak.add_fault(f"diagnose_fail:node={node.rsplit('-', 1)[1]}:attempt={soak.attempt()}")
    return f"{node} fails its self-check (in-job hook); {kill_rank(soak)}"


@dataclass(frozen=True)
class FaultClass:
    act: Callable[[SoakJob], str]  # does one fault to the job; says what it did
    noticed_by: tuple[str, ...]  # the events that say it was noticed
    restarts: bool  # whether the job is to restart after it (the next fault waits for that)


FAULTS = {
    "rank SIGKILL": FaultClass(kill_rank, ("fault",), True),
    "rank SIGSTOP": FaultClass(stop_rank, ("fault",), True),
    "executor kill": FaultClass(kill_executor, ("executor_replaced", "fault"), False),
    "store restart": FaultClass(restart_store, ("store_back",), False),
    "slow rank": FaultClass(slow_rank, ("fault", "slow_steps"), True),
    "NaN": FaultClass(nan_loss, ("nonfinite", "fault"), True),
    "corrupted newest checkpoint": FaultClass(corrupt_checkpoint, ("fault",), True),
    "node failing its self-check": FaultClass(failing_node, ("fault",), True),
}


def schedule(rng: random.Random, count: int) -> list[str]:
    """`count` fault classes: shuffled rounds of every class, so each comes up once in every round."""
    names: list[str] = []
    while len(names) < count:
        round_ = list(FAULTS)
        rng.shuffle(round_)
        names += round_
    return names[:count]


# -- measuring -------------------------------------------------------------------------------------------
def measure_fault(
    injected: Injected, until: float, events: list[dict[str, Any]], records: list[dict[str, Any]]
) -> dict:
    """What one fault cost, from the job's records up to the next fault (`until`): when it was noticed,
    which way the job recovered, the time to the next step trained, and the steps trained again."""
    after = [event for event in events if injected.time - 0.5 <= event["time"] < until]
    detected = next((event for event in after if event["event"] in FAULTS[injected.fault].noticed_by), None)
    fault = next((event for event in after if event["event"] == "fault"), None)
    restart = next((event for event in after if event["event"] == "restart"), None)
    recovered = next((event for event in after if event["event"] == "recovered"), None)
    since, path, redone = injected.time, "none needed", 0
    if restart is not None and recovered is not None:
        since = restart["time"]
        path = "standby" if restart.get("standby") else "full restart"
        redone = max(0, fault["last_step"] - recovered["resumed_from"]) if fault else 0
    # The next step trained: the restarted attempt's first (rank 0's record), else the next one at all.
    next_step = min((record["time"] for record in records if record["time"] > since), default=None)
    # Only where the job stopped: elsewhere the next step came whether the fault was noticed or not.
    to_next_step = None
    if path != "none needed" and next_step is not None and detected is not None:
        to_next_step = round(next_step - detected["time"], 2)
    evicted = [event["node"] for event in after if event["event"] == "evict"]
    return {
        **asdict(injected),
        "detected_after_s": round(detected["time"] - injected.time, 2) if detected else None,
        "detected_as": (detected.get("kind") or detected["event"]) if detected else None,
        "path": path,
        "evicted": evicted,
        "fault_to_next_step_s": round(next_step - injected.time, 2) if next_step else None,
        "detection_to_next_step_s": to_next_step,
        "steps_redone": redone,
    }


def first_differing(losses: dict[int, float], reference: dict[int, float]) -> int | None:
    """The first step whose loss is not the reference's bit for bit (None: all equal)."""
    return next((step for step in sorted(losses) if losses[step] != reference.get(step)), None)


def final_weights(first: Path, second: Path) -> tuple[bool, list[str]]:
    """Whether two runs' newest checkpoints hold bit-identical model weights, and which checkpoints they
    are (a stop whose save was lost leaves an older one newest)."""
    import torch

    from megascale.convert import load_trained

    trained = [load_trained(run) for run in (first, second)]
    weights = [one.model.state_dict() for one in trained]
    equal = weights[0].keys() == weights[1].keys() and all(
        torch.equal(weights[0][name], weights[1][name]) for name in weights[0]
    )
    return equal, [Path(one.checkpoint).name for one in trained]


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def by_class(faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fault class: how many, the median detection and fault-to-next-step times, the steps redone,
    and which recovery path they took."""

    def middle(faults: list[dict[str, Any]], key: str) -> float | None:
        return median([fault[key] for fault in faults if fault[key] is not None])

    rows = []
    for name in FAULTS:
        mine = [fault for fault in faults if fault["fault"] == name]
        if not mine:
            continue
        rows.append(
            {
                "fault": name,
                "count": len(mine),
                "paths": sorted({fault["path"] for fault in mine}),
                "median_detected_after_s": middle(mine, "detected_after_s"),
                "median_fault_to_next_step_s": middle(mine, "fault_to_next_step_s"),
                "median_detection_to_next_step_s": middle(mine, "detection_to_next_step_s"),
                "steps_redone": sum(fault["steps_redone"] for fault in mine),
            }
        )
    return rows


def tables(result: dict[str, Any]) -> str:
    def seconds(value: float | None) -> str:
        return "—" if value is None else f"{value} s"

    def yes(value: bool) -> str:
        return "yes" if value else "**no**"

    same = result["losses_equal"] and result["weights_equal"]
    parted = ""  # where the curves part: the fault just before it parted them
    if not result["losses_equal"]:
        parted += f", losses first differ at step {result['first_loss_differing']}"
    if not result["weights_equal"]:
        parted += ", final weights differ (checkpoints {} and {})".format(*result["final_checkpoints"])
    lines = [
        f"ETTR **{result['ettr']:.1%}** ({result['productive_s']:.0f} s of {result['wall_s']:.0f} s on steps "
        f"that count); {len(result['faults'])} faults, every one recovered by itself: "
        f"{yes(result['recovered'])}; losses and final weights = undisturbed run: {yes(same)} (steps "
        f"1-{result['steps']}{parted}); processes left {result['processes_left']}, /dev/shm bytes left "
        f"{result['shm_bytes_left']}",
        "",
        "| fault class | faults | path | median detected after | median fault → next step | "
        "median detection → next step | steps redone |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["classes"]:
        lines.append(
            f"| {row['fault']} | {row['count']} | {', '.join(row['paths'])} | "
            f"{seconds(row['median_detected_after_s'])} | {seconds(row['median_fault_to_next_step_s'])} | "
            f"{seconds(row['median_detection_to_next_step_s'])} | {row['steps_redone']} |"
        )
    lines += [
        "",
        "| at | fault | done | step | detected after | as | path | fault → next step | steps redone |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fault in result["faults"]:
        lines.append(
            f"| {fault['time'] - result['began']:.0f} s | {fault['fault']} | {fault['how']} | "
            f"{fault['step']} | {seconds(fault['detected_after_s'])} | {fault['detected_as'] or '—'} | "
            f"{fault['path']} | "
            f"{seconds(fault['fault_to_next_step_s'])} | {fault['steps_redone']} |"
        )
    return "\n".join(lines)


# -- the soak ----------------------------------------------------------------------------------------------
def soak(work: Path, duration_s: float, every_s: float, seed: int, job_args: list[str]) -> dict[str, Any]:
    """Run the soak in `work`; returns its result (what `soak.json` holds)."""
    from megascale.host import free_port
    from megascale.stores.redis_store import start_redis_server

    if shutil.which("redis-server") is None:
        raise RuntimeError("the soak restarts a Redis store: it needs redis-server (Debian's redis-server)")
    work.mkdir(parents=True, exist_ok=True)
    shm = set(staging_base().glob("megascale-*"))
    rng = random.Random(seed)
    job_args = [*SOAK_JOB, f"--data.cache_dir={work / 'data'}", *job_args]
    job = SoakJob(work, job_args, free_port("127.0.0.1"), rng)
    job.redis = start_redis_server(job.redis_port)
    injected: list[Injected] = []
    try:
        job.job.launch()
        began = job.job.launches[0]
        job.wait_training(after=0.0, timeout_s=600.0)  # the first start prepares the data
        for index, name in enumerate(schedule(rng, int(duration_s // every_s))):
            at = began + (index + rng.uniform(0.2, 0.8)) * every_s
            time.sleep(max(0.0, at - time.time()))
            job.wait_training(after=injected[-1].time if injected else 0.0)
            step, attempt, now = job.step(), job.attempt(), time.time()
            how = FAULTS[name].act(job)
            injected.append(Injected(name, how, now, step, attempt))
            print(f"soak: {now - began:.0f} s: {name}: {how}", flush=True)
            job.wait_noticed(FAULTS[name], since=now, attempt=attempt)
        time.sleep(max(0.0, began + duration_s - time.time()))
        # Recovered from the last fault; no fault comes that the standby would take over.
        job.wait_training(after=injected[-1].time if injected else 0.0, standby=False)
        job.job.proc.send_signal(signal.SIGTERM)  # the ranks save; the driver ends the job
        code = job.job.wait(STOP_TIMEOUT_S)
        ended = time.time()
    finally:
        if job.job.proc.poll() is None:
            job.job.proc.kill()
            job.job.proc.wait()
        if job.redis is not None:
            job.redis.kill()
            job.redis.wait()
        time.sleep(1.0)  # processes the job just told to exit
        for pid, _ in processes_naming(job.run_dir):  # a failed soak's leftovers: ours, by name
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    processes_left = len(processes_naming(job.run_dir))
    shm_left = staged_bytes(shm)
    events, records = read_events(job.run_dir), read_metrics(job.run_dir)
    steps = max((record["step"] for record in records if "loss" in record), default=0)
    reference = Job(work, "soak-reference", [arg for arg in job_args if "standby" not in arg])
    reference.args.append(f"--training.stop_at_step={steps}")
    reference.launch()
    if reference.wait(duration_s + 600) != 0:
        raise RuntimeError(f"the undisturbed run failed; see {work / 'soak-reference.console.log'}")
    differing = first_differing(losses(job.run_dir), losses(reference.run_dir))
    ends = [one.time for one in injected[1:]] + [ended]
    weights_equal, checkpoints = final_weights(job.run_dir, reference.run_dir)
    faults = [measure_fault(one, until, events, records) for one, until in zip(injected, ends)]
    result = {
        "duration_s": duration_s,
        "fault_every_s": every_s,
        "seed": seed,
        "began": began,
        **ettr(records, events, began, ended),
        "steps": steps,
        "exit_code": code,
        "recovered": code == 0 and not any(event["event"] == "give_up" for event in events),
        "losses_equal": differing is None,
        "first_loss_differing": differing,
        "weights_equal": weights_equal,
        "final_checkpoints": checkpoints,  # the soak's, the undisturbed run's
        "processes_left": processes_left,
        "shm_bytes_left": shm_left,
        "faults": faults,
        "classes": by_class(faults),
    }
    (job.run_dir / "soak.json").write_text(json.dumps(result, indent=2))
    (work / "goodput.svg").write_text(progress_chart(records, faults, began))
    return result


def parse_duration(text: str) -> float:
    """'30m', '90s', '1h', '1h30m' or plain seconds, as seconds."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise ValueError(f"--soak {text!r}: a duration such as 30m, 90s or 1h30m")
    return sum(float(number) * {"h": 3600, "m": 60, "s": 1}[unit] for number, unit in parts)


def run_soak(work: Path, duration: str, every_s: float, seed: int, job_args: list[str]) -> int:
    """The CLI's soak: run it, write soak.json / soak.md / goodput.svg, print the tables; exit 1 if a fault
    was not recovered by itself, a loss or weight differs, or anything was left behind."""
    result = soak(work, parse_duration(duration), every_s, seed, job_args)
    text = tables(result)
    (work / "soak.json").write_text(json.dumps(result, indent=2))
    (work / "soak.md").write_text(text + "\n")
    print(text)
    good = result["recovered"] and result["losses_equal"] and result["weights_equal"]
    return 0 if good and not result["processes_left"] and not result["shm_bytes_left"] else 1
