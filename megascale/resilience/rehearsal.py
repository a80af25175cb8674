"""`megascale rehearse`: every fault the job must survive, done to a real launched job from outside, and a
table of what happened.

The tests inject faults through hooks inside the job (resilience/inject.py); an operator's faults come
from outside: a signal to a rank, an executor or the driver, a store restarted, a checkpoint deleted, a
token shard overwritten, a disk filled. The rehearsal runs a small `megascale launch` job (2 nodes x 2
processes, a tiny model) once undisturbed, the reference, and once per fault, doing the fault as it
happens in production, and reads what happened from the job's own records (events.jsonl, metrics.jsonl,
the ranks' progress files): when the fault was detected, what the diagnosis said, whether the job
recovered by itself (or ended, resumable, and what the operator then runs), the steps trained twice,
whether the final losses equal the reference's bit for bit, the job's processes and host-memory staging
left behind, and the time from the fault to the next step trained. Only NaN and the failing self-check,
which nothing outside a process can cause, use the in-job hooks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascale.checkpoint.staging import staging_base
from megascale.observe.events import read_events
from megascale.observe.metrics import read_metrics
from megascale.resilience.trial import EVERY, JOB, Job, losses, processes_naming, staged_bytes


# -- the faults ---------------------------------------------------------------------------------------
def kill_rank(job: Job) -> float:
    os.kill(job.report(3, rank=1)["pid"], signal.SIGKILL)
    return time.time()


def stop_rank(job: Job) -> float:
    os.kill(job.report(3, rank=2)["pid"], signal.SIGSTOP)
    return time.time()


def kill_executor(job: Job) -> float:
    job.report(3)
    os.kill(job.executor_pid("node-1"), signal.SIGKILL)
    return time.time()


def kill_driver(job: Job) -> float:
    """SIGKILL the driver, and start it again at once on the same run directory (a supervisor's job)."""
    job.report(3)
    job.proc.kill()
    job.exit_codes.append(job.proc.wait())
    killed = time.time()
    job.launch()
    return killed


def two_nodes_at_once(job: Job) -> float:
    first, second = job.report(3, rank=1)["pid"], job.report(3, rank=3)["pid"]
    os.kill(first, signal.SIGKILL)
    time.sleep(0.5)
    os.kill(second, signal.SIGKILL)
    return time.time() - 0.5


def corrupt_newest_checkpoint(job: Job) -> float:
    """Truncate a data file of the newest checkpoint (one past the first, so there is one to fall back
    to), then SIGKILL a rank: the restart must skip the damaged one."""
    newest = Path(job.newest_checkpoint(after=EVERY))
    shard = sorted(newest.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    os.kill(job.report(0, rank=1)["pid"], signal.SIGKILL)
    return time.time()


def delete_checkpoints(job: Job) -> float:
    job.newest_checkpoint(after=EVERY)
    shutil.rmtree(job.checkpoint_root)
    os.kill(job.report(0, rank=1)["pid"], signal.SIGKILL)
    return time.time()


def start_over(job: Job) -> None:
    """`megascale launch --checkpoint.resume=false`: the run is trained again from step 0."""
    job.launch("--checkpoint.resume=false")


@dataclass
class ShardDamage:
    path: Path | None = None
    original: bytes = b""


def overwrite_shard(job: Job, damage: ShardDamage) -> float:
    """Overwrite 256 bytes in the middle of the dataset's largest token shard, in place."""
    job.newest_checkpoint(after=0)
    shards = [path for path in (job.work / "data").rglob("shard-*.tokens")]
    damage.path = path = max(shards, key=lambda path: path.stat().st_size)
    middle = path.stat().st_size // 2
    with open(path, "r+b") as file:
        file.seek(middle)
        damage.original = file.read(256)
        file.seek(middle)
        file.write(bytes(range(256)))
    return time.time()


def restore_shard(job: Job, damage: ShardDamage) -> None:
    """shard restored, `megascale launch`: the prepared bytes back (`megascale prepare` would do)."""
    assert damage.path is not None  # overwrite_shard ran
    with open(damage.path, "r+b") as file:
        file.seek(damage.path.stat().st_size // 2)
        file.write(damage.original)
    job.launch()


def slow_rank(job: Job) -> float:
    """From step 6, rank 1 runs a tenth of the time (SIGSTOP/SIGCONT), as a throttled or sick GPU does."""
    pid = job.report(6, rank=1)["pid"]

    def throttle() -> None:
        try:
            while True:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.45)
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.05)
        except ProcessLookupError:
            return

    threading.Thread(target=throttle, daemon=True, name="rehearsal-throttle").start()
    return time.time()


def nan_in_job(job: Job) -> float:
    return job.report(5)["time"]  # the hook makes step 6's loss NaN


# -- the table ----------------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    how: str  # what is done, for the table
    act: Callable[..., float]
    extra: tuple[str, ...] = ()
    detected_by: tuple[str, ...] = ("fault",)
    follow_up: Callable[..., None] | None = None  # what the operator runs once the job has ended
    world_changes: bool = False  # a different world size trains other numerics: losses not compared
    state: Any = None  # passed to act and follow_up when set


def rows(work: Path) -> list[Row]:
    damage = ShardDamage()
    return [
        Row("rank SIGKILL", "SIGKILL rank 1 at step 3", kill_rank),
        Row("rank SIGSTOP", "SIGSTOP rank 2 at step 3", stop_rank),
        Row(
            "executor kill",
            "SIGKILL node-1's executor at step 3",
            kill_executor,
            detected_by=("executor_replaced",),
        ),
        Row(
            "driver kill",
            "SIGKILL the driver at step 3; `megascale launch` again at once",
            kill_driver,
            detected_by=("adopted",),
        ),
        Row(
            "store kill and restart",
            "SIGKILL redis-server at step 3; restart it empty 3 s later",
            restart_store,
            detected_by=("store_back",),
        ),
        Row("two nodes at once", "SIGKILL rank 1 (node-0), rank 3 (node-1) 0.5 s apart", two_nodes_at_once),
        Row(
            "corrupted checkpoint",
            "truncate a file of the newest checkpoint, then SIGKILL rank 1",
            corrupt_newest_checkpoint,
        ),
        Row(
            "deleted checkpoints",
            "delete the checkpoint directory, then SIGKILL rank 1",
            delete_checkpoints,
            follow_up=start_over,
        ),
        Row(
            "token shard overwritten",
            "overwrite 256 bytes of a token shard mid-run",
            overwrite_shard,
            follow_up=restore_shard,
            state=damage,
        ),
        Row(
            "disk full during persist",
            "fill the checkpoints' file system after step 4; free it at step 13",
            fill_disk,
            extra=(f"--checkpoint.location={work / 'small-disk' / 'checkpoints'}",),
            detected_by=("persist_failed",),
        ),
        Row(
            "NaN (in-job hook)",
            "step 6's loss made NaN; nan_policy rollback",
            nan_in_job,
            extra=("--resilience.inject=nan:step=6", "--resilience.nan_policy=rollback"),
            detected_by=("nonfinite", "fault"),  # a rollback is a rank's exit with status 3
        ),
        Row(
            "slow rank",
            "rank 1 throttled to a tenth of its time from step 6",
            slow_rank,
            extra=("--resilience.anomaly_window=4", "--resilience.anomaly_action=restart"),
            detected_by=("slow_steps",),
        ),
        Row(
            "node failing diagnostics",
            "SIGKILL rank 1 at step 3; node-0 fails its self-check (in-job hook); one spare node",
            kill_rank,
            extra=("--resilience.spares=1", "--resilience.inject=diagnose_fail:node=0"),
        ),
    ]


@dataclass
class Store:
    """The Redis server of the store row, started and restarted by the rehearsal."""

    port: int = 0
    server: subprocess.Popen | None = None
    extra: list[str] = field(default_factory=list)


def restart_store(job: Job, store: Store) -> float:
    from megascale.stores.redis_store import start_redis_server

    job.report(3)
    assert store.server is not None  # started for this row
    store.server.kill()
    store.server.wait()
    killed = time.time()
    time.sleep(3)
    store.server = start_redis_server(store.port)
    return killed


def fill_disk(job: Job) -> float:
    """Fill the checkpoints' file system once step 4's checkpoint is in, free it at step 13: the saves
    in between fail and training goes on; the next one after commits."""
    disk = job.work / "small-disk"
    job.newest_checkpoint(after=0)
    filler = disk / "filler"
    with open(filler, "wb") as file:
        try:
            while True:
                file.write(b"\0" * (1 << 20))
                file.flush()
        except OSError:
            pass
    filled = time.time()
    job.report(13)
    filler.unlink()
    return filled


def mount_small_disk(disk: Path) -> str | None:
    """A 64 MB tmpfs for the disk-full row; the reason when none can be mounted here."""
    disk.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "needs root to mount a small file system"
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True)
    return None if made.returncode == 0 else made.stderr.decode().strip()


def steps_redone(job: Job, events: list[dict[str, Any]]) -> int:
    """Steps trained again: from each fault's last step back to where the next attempt resumed (the
    metrics log keeps only the final curve, so the events say it)."""
    redone, last_step = 0, None
    for event in events:
        if event["event"] == "fault":  # a failed restart's fault has an earlier (or no) last step
            last_step = max(last_step if last_step is not None else -1, event["last_step"])
        elif event["event"] == "recovered" and last_step is not None:
            redone, last_step = redone + max(0, last_step - event["resumed_from"]), None
    if last_step is not None:  # the job ended and the operator launched it again: its first attempt
        starts = [event for event in events if event["event"] == "start"]
        reports = job.run_dir.glob(f"nodes/*/attempt-{starts[-1]['attempt']}/rank-*.json") if starts else []
        resumed = [json.loads(path.read_text()).get("resumed_from", 0) for path in reports]
        redone += max(0, last_step - min(resumed, default=0))
    return redone


def cause(reason: str) -> str:
    """The gist of a give-up's reason: 'checkpoint: every checkpoint of this run is gone'."""
    message = re.sub(r"^an error in the job's input: rank \d+: ", "", reason)
    return ": ".join(message.split(": ")[:2]).split(",")[0].split(";")[0]


def measure(row: Row, job: Job, fault_at: float, reference: dict[int, float], shm: set[Path]) -> dict:
    """One row of the table, from the job's records once it (and the operator's follow-up) ended."""
    events = read_events(job.run_dir)
    after = [event for event in events if event["time"] >= fault_at - 1.0]
    detected = next((event for event in after if event["event"] in row.detected_by), None)
    gave_up = next((event for event in after if event["event"] == "give_up"), None)
    diagnosis = []
    for event in after:
        if event["event"] == "blame":
            diagnosis.append(f"blamed rank {event['suspect_ranks']} on {event['nodes']}")
        elif event["event"] == "diagnosis" and not event["passed"]:
            diagnosis.append(f"{event['node']} failed: {event['reason']}")
        elif event["event"] == "evict":
            diagnosis.append(f"{event['node']} evicted")
    passed = sum(1 for event in after if event["event"] == "diagnosis" and event["passed"])
    if passed:
        diagnosis.append(f"{passed} node(s) passed")
    records = read_metrics(job.run_dir)
    recovered_event = next((event for event in reversed(events) if event["event"] == "recovered"), None)
    # The next step trained after the fault: the restarted attempt's first, the first of the operator's
    # launch after the job ended, or (where nothing stopped) the next one at all.
    since = job.launches[-1] if row.follow_up and len(job.launches) > 1 else fault_at
    later = [record["time"] for record in records if record["time"] > since]
    if recovered_event is not None and recovered_event["time"] > fault_at:
        first_step = recovered_event["time"]
    else:
        first_step = min(later, default=None)
    time.sleep(1.0)  # processes the job just told to exit
    done = bool(events) and events[-1]["event"] == "done" and job.exit_codes[-1] == 0
    return {
        "fault": row.name,
        "how": row.how,
        "detected_after_s": round(detected["time"] - fault_at, 1) if detected else None,
        "detected_as": (detected.get("kind") or detected["event"]) if detected else None,
        "diagnosis": "; ".join(diagnosis) or "none needed",
        "recovered": done and gave_up is None,
        "ended": gave_up["reason"] if gave_up else None,
        "exit_codes": job.exit_codes,
        "operator": (row.follow_up.__doc__ or "").split(":", 1)[0].strip() if row.follow_up else None,
        "cause": cause(gave_up["reason"]) if gave_up else None,
        "done": done,
        "steps_redone": steps_redone(job, after),
        "losses_equal": None if row.world_changes else losses(job.run_dir) == reference,
        "processes_left": len(processes_naming(job.run_dir)),
        "shm_bytes_left": staged_bytes(shm),
        "fault_to_next_step_s": round(first_step - fault_at, 1) if first_step else None,
    }


def run_row(row: Row, work: Path, job_args: list[str], reference: dict[int, float], store: Store) -> dict:
    shm = set(staging_base().glob("megascale-*"))
    extra = list(row.extra)
    state = row.state
    if row.act is restart_store:
        extra += store.extra
        state = store
    job = Job(work, row.name.replace(" ", "-").replace("(", "").replace(")", ""), [*job_args, *extra])
    job.launch()
    try:
        fault_at = row.act(job, state) if state is not None else row.act(job)
        code = job.wait()
        if code != 0 and row.follow_up is not None:
            if state is not None:
                row.follow_up(job, state)
            else:
                row.follow_up(job)
            job.wait()
        return measure(row, job, fault_at, reference, shm)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()
        for pid, _ in processes_naming(job.run_dir):  # a failed row's leftovers: ours, by name
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def table(results: list[dict]) -> str:
    def yes(value: Any) -> str:
        return "—" if value is None else ("yes" if value else "**no**")

    def seconds(value: float | None) -> str:
        return "—" if value is None else f"{value} s"

    lines = [
        "| fault | done from outside | detected after | as | diagnosis | recovered | steps redone | "
        "losses = reference | processes left | /dev/shm bytes left | fault → next step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        if "error" in result:
            lines.append(f"| {result['fault']} | {result['how']} | rehearsal failed: {result['error']} |")
            continue
        if result["recovered"]:
            recovered = "yes, by itself"
        elif result["done"]:
            recovered = (
                f"ended (exit {result['exit_codes'][0]}: {result['cause']}), then {result['operator']}: done"
            )
        else:
            recovered = f"**no** (exit {result['exit_codes'][-1]})"
        lines.append(
            f"| {result['fault']} | {result['how']} | {seconds(result['detected_after_s'])} | "
            f"{result['detected_as'] or '—'} | {result['diagnosis']} | {recovered} | "
            f"{result['steps_redone']} | {yes(result['losses_equal'])} | {result['processes_left']} | "
            f"{result['shm_bytes_left']} | {seconds(result['fault_to_next_step_s'])} |"
        )
    return "\n".join(lines)


def rehearse(work: Path, only: list[str] | None, job_args: list[str]) -> list[dict]:
    from megascale.host import free_port
    from megascale.stores.redis_store import start_redis_server

    work.mkdir(parents=True, exist_ok=True)
    job_args = [*JOB, f"--data.cache_dir={work / 'data'}", *job_args]
    reference_job = Job(work, "reference", job_args)
    reference_job.launch()
    if reference_job.wait() != 0:
        raise RuntimeError(f"the reference run failed; see {work / 'reference.console.log'}")
    reference = losses(reference_job.run_dir)
    store = Store()
    results = []
    disk_problem = None
    for row in rows(work):
        if only and not any(name in row.name for name in only):
            continue
        print(f"rehearsal: {row.name} ...", flush=True)
        try:
            if row.act is restart_store:
                if shutil.which("redis-server") is None:
                    raise RuntimeError("redis-server is not installed")
                store.port = free_port("127.0.0.1")
                store.server = start_redis_server(store.port)
                store.extra = [f"--resilience.store=redis://127.0.0.1:{store.port}/0"]
            if row.act is fill_disk and (disk_problem := mount_small_disk(work / "small-disk")):
                raise RuntimeError(disk_problem)
            results.append(run_row(row, work, job_args, reference, store))
        except Exception as err:  # noqa: BLE001 (the row says so; the others still run)
            results.append({"fault": row.name, "how": row.how, "error": f"{type(err).__name__}: {err}"})
        finally:
            if row.act is restart_store and store.server is not None:
                store.server.kill()
                store.server.wait()
            if row.act is fill_disk and disk_problem is None:
                subprocess.run(["umount", str(work / "small-disk")], capture_output=True)
        print(table(results[-1:]).splitlines()[-1], flush=True)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("runs/rehearsal"),
        help="Directory for the rehearsal's runs, dataset and table (default runs/rehearsal).",
    )
    parser.add_argument(
        "--faults",
        help="Comma-separated parts of the fault names to run (e.g. 'rank SIGKILL,driver'); default all.",
    )
    parser.add_argument(
        "--soak",
        metavar="DURATION",
        help="Instead of the table: one job for DURATION (e.g. 30m) under a fault every --fault-every "
        "seconds, its goodput (ETTR) and what each fault cost (resilience/soak.py).",
    )
    parser.add_argument(
        "--fault-every",
        type=float,
        default=180.0,
        metavar="SECONDS",
        help="With --soak: one fault in every window of this many seconds, at a random moment (default 180).",
    )
    parser.add_argument(
        "--seed", type=int, default=1, help="With --soak: the seed of the faults' order and times (default 1)"
    )


def run_rehearsal(args: argparse.Namespace, job_args: list[str]) -> int:
    work = args.work.expanduser().resolve()
    only = [name.strip() for name in args.faults.split(",")] if args.faults else None
    results = rehearse(work, only, job_args)
    (work / "rehearsal.json").write_text(json.dumps(results, indent=2))
    text = table(results)
    (work / "rehearsal.md").write_text(text + "\n")
    print(text)
    bad = [
        result
        for result in results
        if "error" in result
        or not result["done"]
        or result["losses_equal"] is False
        or result["processes_left"]
        or result["shm_bytes_left"]
    ]
    return 1 if bad else 0
