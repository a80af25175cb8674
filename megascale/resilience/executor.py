"""One executor per node: starts the node's training processes through torchrun and reports a heartbeat.

torchrun (torch.distributed.elastic, through agent.py) runs this node's workers and joins the other
nodes through its c10d rendezvous, whose endpoint the driver hands out per attempt: a free port on the
first node's address, which that node's torchrun serves. An executor registers itself in the store when
it starts, so the driver finds executors started on other hosts (`megascale executor`, by Slurm,
Kubernetes or hand) as it finds the ones it starts on its own machine. The executor adds what
MegaScale's executor does on top (paper §4.1): a heartbeat with the node's process states (which ranks a
signal ended, from torchrun's own account of them), each rank's step and loss, and the log lines that
match error keywords; and it obeys the driver's commands (start, stop, diagnose, exit).
Stop kills the whole torchrun session at once: after a fault, the workers' state is not worth saving
(the restart loads the newest snapshot or verified checkpoint).

A warm standby (`resilience.standby`) is the next attempt started ahead of a fault: a second torchrun
whose workers build everything and wait (resilience/client.py). `recover` stops the attempt and runs the
self-check; `activate` then lets the standby take over, which resumes from the snapshot its ranks find
in this node's memory: a restart without process start-up, rendezvous or storage. The heartbeat also
names the ranks whose process died or stopped while their torchrun runs, so a fault is seen at the next
heartbeat rather than when torchrun notices and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from megascale.checkpoint.persist import NODE, PERSISTER, STAGING_DIR, Persister, pending, persist
from megascale.checkpoint.staging import claim, is_alive, process_identity, remove_stale, staging_base
from megascale.errors import ConfigError
from megascale.host import children_alive, free_port, interface_of, io_bytes
from megascale.resilience.agent import FAILURES, signalled_ranks
from megascale.resilience.client import (
    EXECUTOR_GRACE,
    EXECUTOR_RECORD,
    HEARTBEAT_DIR,
    STANDBY,
    read_input_errors,
    read_progress,
    standby_ranks_ready,
)
from megascale.resilience.inject import ATTEMPT
from megascale.resilience.processes import AdoptedProcess, AdoptedTorchrun, RankWatch, kill_session
from megascale.stores.control import OutageTolerantStore, StoreLost, open_store

ERROR_KEYWORDS = re.compile(
    r"traceback|error|nccl|gloo|segmentation fault|core dumped|killed|exitcode", re.ASCII | re.IGNORECASE
)
MAX_ERROR_LINES = 20
COMMAND_POLL_S = 0.05  # how often the executor looks for a command (heartbeats go every interval)

log = logging.getLogger("megascale.executor")


class Executor:
    def __init__(
        self,
        store_url: str,
        job: str,
        node: str,
        run_dir: Path,
        interval_s: float,
        address: str | None = None,
        connect_timeout_s: float = 30.0,
        store_grace_s: float = 60.0,
    ):
        # A store outage (a Redis restart, a driver restarted on its TCPStore's port) is ridden out for
        # store_grace_s: the node trains on meanwhile.
        self.store = OutageTolerantStore(
            open_store(store_url, job=job, timeout_s=connect_timeout_s),
            store_grace_s,
            reopen=lambda: open_store(store_url, job=job, timeout_s=min(5.0, store_grace_s)),
        )
        self.store_url, self.job = store_url, job
        self._check_driver(connect_timeout_s)
        self.node = node
        # torchrun's c10d rendezvous numbers the nodes by their address (then by the agent's pid): a stable
        # address keeps each rank on the same node across restarts, where its snapshot buffer is.
        self.address = address
        self.run_dir = run_dir
        self.interval_s = interval_s
        self.node_dir = run_dir / "nodes" / node
        self.node_dir.mkdir(parents=True, exist_ok=True)
        self.record_path = self.node_dir / "executor.json"  # the processes a successor adopts
        self.proc: subprocess.Popen | AdoptedProcess | None = None
        self.attempt: int | None = None
        self.log_path: Path | None = None
        self.log_offset = 0
        self.errors: list[str] = []
        self.exited_at: float | None = None  # when this executor first saw torchrun gone
        self.activation_failed = False  # the attempt was to be a standby's, and there was none
        self.rank_watch = RankWatch()
        self.standby: subprocess.Popen | AdoptedProcess | None = (
            None  # the next attempt, started ahead (warm standby)
        )
        self.standby_attempt: int | None = None
        self.diagnosis: dict[str, Any] | None = None
        # Stage 2 of this node's checkpoints runs here, so it outlives the training processes. A directory
        # this node's earlier executor left is adopted (its snapshots are persisted below); those of jobs
        # whose processes are all gone are removed.
        self.staging_dir = staging_base() / f"megascale-{job}" / node
        for path, size in remove_stale(keep=self.staging_dir):
            log.warning(
                "executor %s: removed %s (%.1f MB), left by processes no longer alive", node, path, size / 1e6
            )
        claim(self.staging_dir, "executor")
        self.persister = Persister(self.staging_dir)
        self.persister.start()
        # A command already in the store was for this node's previous executor (it died): not for us.
        previous = self.store.fetch(f"cmd/{node}")
        self.seen_command = previous["seq"] if previous else -1
        self.adopt()
        self.register()

    # -- the node's processes, across executors ---------------------------------------------------------
    def adopt(self) -> None:
        """Take over what a killed predecessor on this node left running (`executor.json`): the attempt
        trains on, the standby stays ready; an attempt whose torchrun is gone is reported as failed."""
        try:
            record = json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return
        if record.get("job") != self.job:  # an earlier job's, in the same run directory
            return
        if record.get("attempt") is not None:
            attempt = int(record["attempt"])
            self._begin_attempt(attempt)
            if record.get("proc") and is_alive(record["proc"]):
                self.proc = AdoptedTorchrun(record["proc"], self._attempt_dir(attempt))
            else:
                self.activation_failed = True  # reported as exited with status 1
        if record.get("standby") and is_alive(record["standby"]):
            self.standby = AdoptedTorchrun(record["standby"], self._attempt_dir(record["standby_attempt"]))
            self.standby_attempt = int(record["standby_attempt"])
        running, standby = "running" if self.proc else "gone", self.standby_attempt if self.standby else None
        log.warning(
            "executor %s: adopted attempt %s (%s) and standby %s from the node's previous executor",
            *(self.node, self.attempt, running, standby),
        )
        self._write_record()  # now naming this executor: the adopted standby waits on for it

    def _write_record(self) -> None:
        """What a successor needs to adopt this node's processes, should this executor die."""
        record = {
            "job": self.job,
            "executor": process_identity(),  # the standby follows whoever wrote this last
            "attempt": self.attempt,
            "proc": process_identity(self.proc.pid) if self.proc is not None else None,
            "standby": process_identity(self.standby.pid) if self.standby is not None else None,
            "standby_attempt": self.standby_attempt,
        }
        staged = self.record_path.with_suffix(".tmp")
        staged.write_text(json.dumps(record))
        os.replace(staged, self.record_path)

    def _check_driver(self, timeout_s: float) -> None:
        """Wait for the driver's mark in the store; refuse another job's driver (a TCPStore is not
        divided by job, so a wrong --job would otherwise go unnoticed)."""
        deadline = time.monotonic() + timeout_s
        while (driver := self.store.fetch("driver")) is None:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"executor: no driver of job {self.job!r} came up on {self.store_url} in "
                    f"{timeout_s:.0f} s (--job must be the driver's resilience.job_id)"
                )
            time.sleep(0.2)
        if driver["job"] != self.job:
            raise ConfigError(
                f"executor: the driver on {self.store_url} runs job {driver['job']!r}, not --job {self.job!r}"
            )

    def register(self) -> None:
        """Tell the driver this node exists: a ticket from the store's counter, then the node's name under
        it (the driver reads `node/0` .. `node/<count-1>`)."""
        ticket = self.store.add("registered", 1) - 1
        self.store.put(
            f"node/{ticket}", {"node": self.node, "host": socket.gethostname(), "address": self.address}
        )

    # -- commands -------------------------------------------------------------------------------------
    def start(self, command: dict[str, Any]) -> None:
        self.stop()
        self.drop_standby()  # a fresh start means the nodes or the plan changed: the standby is not it
        self._begin_attempt(int(command["attempt"]))
        self._clear_reports(int(command["attempt"]))
        self.proc = self._torchrun(command)
        self._write_record()

    def prepare_standby(self, command: dict[str, Any]) -> None:
        """Start the next attempt's processes as a warm standby: they build everything and wait."""
        self.drop_standby()
        if "torch" not in sys.modules:  # the self-check before an activation needs it: import it now
            threading.Thread(target=importlib.import_module, args=("torch",), daemon=True).start()
        attempt = int(command["attempt"])
        directory = self._attempt_dir(attempt)
        self._clear_reports(attempt)
        self.standby = self._torchrun(command, standby=directory / "go")
        self.standby_attempt = attempt
        self._write_record()

    def activate(self, command: dict[str, Any]) -> None:
        """Stop the attempt (if still running) and let the standby of `attempt` take over. Without a live
        standby of that attempt the new attempt fails at once, and the driver restarts in full."""
        attempt = int(command["attempt"])
        standby, self.standby = self.standby, None
        self.stop()
        self._begin_attempt(attempt)
        if standby is None or self.standby_attempt != attempt or standby.poll() is not None:
            if standby is not None:
                kill_session(standby)
            self.errors.append(f"executor {self.node}: error: no standby of attempt {attempt} to activate")
            self.activation_failed = True
            self._write_record()
            return
        (self._attempt_dir(attempt) / "go").touch()
        self.proc = standby
        self._write_record()

    def drop_standby(self) -> None:
        if self.standby is not None:
            kill_session(self.standby)
            self.standby = None
            self._write_record()

    def _attempt_dir(self, attempt: int) -> Path:
        return self.node_dir / f"attempt-{attempt}"

    def _clear_reports(self, attempt: int) -> None:
        """Remove what processes of an earlier attempt numbered alike left in its directory (an earlier
        job's in the same run directory, an earlier standby's): their reports are not this attempt's."""
        directory = self._attempt_dir(attempt)
        directory.mkdir(parents=True, exist_ok=True)
        for pattern in ("rank-*.json", "input-error-*.json", "standby-*.json", FAILURES, "go"):
            for leftover in directory.glob(pattern):
                leftover.unlink(missing_ok=True)

    def _begin_attempt(self, attempt: int) -> None:
        """What the heartbeat says of an attempt starts afresh: its directory, log and failures."""
        self.attempt = attempt
        progress_dir = self._attempt_dir(attempt)
        progress_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = progress_dir / "output.log"
        self.log_offset, self.errors = 0, []
        self.exited_at = None
        self.activation_failed = False
        self.rank_watch = RankWatch()

    def _standby_env(self, go: Path, command: dict[str, Any]) -> dict[str, str]:
        grace, record = str(command.get("executor_grace_s", 0.0)), str(self.record_path)
        return {STANDBY: str(go), EXECUTOR_RECORD: record, EXECUTOR_GRACE: grace}

    def _torchrun(self, command: dict[str, Any], standby: Path | None = None) -> subprocess.Popen:
        """torchrun for the command's attempt, in a session of its own, its output in the attempt's log;
        as a warm standby waiting for `standby` to appear, when given."""
        attempt = int(command["attempt"])
        progress_dir = self._attempt_dir(attempt)
        network = {}
        interface = interface_of(self.address) if self.address else None
        if interface and "GLOO_SOCKET_IFNAME" not in os.environ:
            # gloo otherwise binds to the address its host name resolves to, often not the one the other
            # nodes reach this one at.
            network["GLOO_SOCKET_IFNAME"] = interface
        threads = command.get("threads") or max(1, (os.cpu_count() or 1) // int(command["nproc_per_node"]))
        env = dict(
            os.environ,
            **network,
            **{
                HEARTBEAT_DIR: str(progress_dir),
                ATTEMPT: str(attempt),
                STAGING_DIR: str(self.staging_dir),
                PERSISTER: "executor",
                NODE: self.node,
            },
            **(self._standby_env(standby, command) if standby else {}),
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
            OMP_NUM_THREADS=str(threads),
        )
        torchrun = [
            sys.executable, "-m", "megascale.resilience.agent", str(progress_dir / FAILURES),
            f"--nnodes={command['nnodes']}",
            f"--nproc-per-node={command['nproc_per_node']}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={command['rdzv_endpoint']}",
            # Which node serves the rendezvous is the driver's choice: torchrun's own guess compares the
            # endpoint with the host name's address, which on a multi-homed host is not the one used.
            f"--rdzv-conf=is_host={int(command['rdzv_host'])}",
            f"--rdzv-id={command['rdzv_id']}",
            *([f"--local-addr={self.address}"] if self.address else []),
            "--max-restarts=0",
            "--monitor-interval=0.5",
            "-m", "megascale.cli", "train", *command["train_args"],
        ]  # fmt: skip
        with open(progress_dir / "output.log", "ab") as log:
            return subprocess.Popen(
                torchrun, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def terminate(self, grace_s: float = 60.0) -> None:
        """Ask torchrun to stop: it passes SIGTERM to the workers, which checkpoint and exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.stop()

    def stop(self) -> None:
        if self.proc is not None:
            kill_session(self.proc)
            self._write_record()

    def close(self) -> None:
        """Stop the node's processes and stage 2's thread (a snapshot being persisted is finished first)."""
        self.stop()
        self.drop_standby()
        self.persister.stop()

    def abandon_node(self, marker_timeout_s: float = 10.0) -> None:
        """The driver is gone for good (its store never came back, or SIGTERM): stop the node's processes,
        persist the snapshots they left (the job ends resumable from the newest), free the node's memory."""
        self.close()
        for staged in pending(self.staging_dir):
            try:
                persist(staged, marker_timeout_s)
            except Exception as err:  # noqa: BLE001 (an older checkpoint still resumes the job)
                log.error("executor %s: persisting %s failed: %s", self.node, staged.name, err)
        self.remove_staging()

    def remove_staging(self) -> None:
        """The node is done with the job: its memory, and the record a successor would adopt from."""
        self.record_path.unlink(missing_ok=True)
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # the job's directory, once its last node is gone
            self.staging_dir.parent.rmdir()

    def diagnose(self, command: dict[str, Any]) -> None:
        from megascale.resilience.diagnostics import run_self_check

        self.diagnosis = run_self_check(self.node, command)
        self.store.put(f"diag/{self.node}", {"seq": command["seq"], **self.diagnosis})

    def check_links(self, command: dict[str, Any]) -> None:
        from megascale.resilience.links import run_link_checks

        links = run_link_checks(self.node, command, self.store_url, self.job, self.address)
        self.store.put(f"links/{self.node}", {"seq": command["seq"], "links": links})

    # -- heartbeat ------------------------------------------------------------------------------------
    def heartbeat(self, left: bool = False) -> dict[str, Any]:
        state, exit_code = "idle", None
        if left:
            state = "left"
        elif self.proc is not None:
            exit_code = self.proc.poll()
            state = "running" if exit_code is None else "exited"
        elif self.activation_failed:
            state, exit_code = "exited", 1
        if state == "exited" and self.exited_at is None:
            self.exited_at = time.time()
        self._scan_log()
        progress = read_progress(self.log_path.parent) if self.log_path else {}
        workers = children_alive(self.proc.pid) if state == "running" and self.proc else []
        lost, stopped = self.rank_watch.read(progress, time.time()) if state == "running" else ([], {})
        standby = self.standby if self.standby is not None and self.standby.poll() is None else None
        ours = [self.proc.pid, *workers] if state == "running" and self.proc is not None else []
        ours += [standby.pid, *children_alive(standby.pid)] if standby is not None else []
        beat = {
            "time": time.time(),
            "node": self.node,
            "host": socket.gethostname(),
            "address": self.address,
            "attempt": self.attempt,
            "state": state,
            "exit_code": exit_code,
            "exited_at": self.exited_at,
            # The ranks a signal ended, from torchrun's own account of its failed workers (agent.py).
            "signalled": signalled_ranks(self.log_path.parent / FAILURES)
            if state == "exited" and self.log_path
            else {},
            "pid": self.proc.pid if self.proc else None,
            "workers": workers,
            # What the driver kills should this executor die: torchrun's session and each worker's, the
            # standby's too.
            "sessions": [process_identity(pid) for pid in ours],
            "lost_ranks": lost,
            "stopped_ranks": stopped,
            "standby": {
                "attempt": self.standby_attempt,
                "alive": standby is not None,
                "ready": standby_ranks_ready(self._attempt_dir(self.standby_attempt)),
            }
            if self.standby is not None and self.standby_attempt is not None
            else None,
            "io_bytes": io_bytes(workers),
            "free_port": free_port(self.address),
            "progress": {str(rank): report for rank, report in progress.items()},
            "input_errors": read_input_errors(self.log_path.parent) if self.log_path else [],
            "errors": (self.errors + self.persister.errors)[-MAX_ERROR_LINES:],
            "persist_failures": len(self.persister.errors),  # stage 2 failures of this executor, ever
            "persist_error": self.persister.errors[-1] if self.persister.errors else None,
            "snapshots_pending": self.persister.busy(),
            "snapshot_waiting": self.persister.waiting,
        }
        self.store.put(f"hb/{self.node}", beat)
        return beat

    def _scan_log(self) -> None:
        """New log lines matching an error keyword go into the heartbeat."""
        if self.log_path is None or not self.log_path.exists():
            return
        with open(self.log_path, "rb") as log:
            log.seek(self.log_offset)
            chunk = log.read()
        complete = chunk.rfind(b"\n") + 1
        self.log_offset += complete
        for line in chunk[:complete].decode(errors="replace").splitlines():
            if ERROR_KEYWORDS.search(line):
                self.errors.append(line[:300])

    def run(self) -> None:
        """Obey commands as they come (looked for every COMMAND_POLL_S) and beat every interval, at once
        after a command, so the driver sees its effect without waiting a whole interval."""
        next_beat = 0.0
        while True:
            command = self.store.fetch(f"cmd/{self.node}")
            if command is not None and command["seq"] > self.seen_command:
                self.seen_command = command["seq"]
                if not self.obey(command):
                    self.heartbeat(left=True)  # the last word: the driver may close the store after it
                    return
                next_beat = 0.0
            if time.monotonic() >= next_beat:
                self.heartbeat()
                next_beat = time.monotonic() + self.interval_s
            time.sleep(min(COMMAND_POLL_S, self.interval_s))

    def obey(self, command: dict[str, Any]) -> bool:
        """Carry out one command of the driver's; False once told to exit."""
        action = command["action"]
        if action == "start":
            self.start(command)
        elif action == "standby":
            self.prepare_standby(command)
        elif action == "activate":
            self.activate(command)
        elif action == "stop":
            self.stop()
        elif action == "terminate":
            self.terminate()
            self.drop_standby()
        elif action in ("diagnose", "recover"):  # recover: the standby stays, to be activated after
            self.stop()
            if action == "diagnose":
                self.drop_standby()
            self.diagnose(command)
        elif action == "link_check":
            self.check_links(command)
        elif action == "exit":
            self.stop()
            self.drop_standby()
            self.remove_staging()
            return False
        return True


def executor_command(
    store: str, job: str, node: str, run_dir: Path, interval_s: float, address: str | None
) -> list[str]:
    """The command line that starts node `node`'s executor on this host."""
    command = [sys.executable, "-m", "megascale.resilience.executor", "--store", store, "--job", job]
    command += ["--node", node, "--run-dir", str(run_dir), "--interval", str(interval_s)]
    return command + (["--address", address] if address else [])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The executor's flags (`megascale executor` and `python -m megascale.resilience.executor`)."""
    parser.add_argument("--store", required=True, help="The driver's store URL (tcp://... or redis://...).")
    parser.add_argument(
        "--job", required=True, help="The job id: the driver's resilience.job_id (events.jsonl shows it)."
    )
    parser.add_argument(
        "--node",
        default=socket.gethostname(),
        help="This node's name, unique in the job (default: host name).",
    )
    parser.add_argument(
        "--run-dir",
        required=True,
        type=Path,
        help="The job's run directory (training.run_dir), on a file system every node shares.",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="Heartbeat interval, seconds (resilience.heartbeat_interval_s).",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=300.0,
        help="Seconds to wait for the driver's store to come up (executors may start before the driver).",
    )
    parser.add_argument(
        "--store-grace",
        type=float,
        default=60.0,
        help="Seconds to wait for the store to answer again after an outage before stopping this node's "
        "processes (resilience.store_grace_s).",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="This node's address in torchrun's rendezvous (its --local-addr). Ranks are numbered in the "
        "order of these addresses, so a stable one keeps each rank on its node across restarts. Default: "
        "the host's name. Its network interface carries the gloo traffic (GLOO_SOCKET_IFNAME) unless set.",
    )


def run_executor(args: argparse.Namespace) -> int:
    """Serve the driver until it says exit (or SIGTERM)."""
    try:
        executor = Executor(
            args.store,
            args.job,
            args.node,
            args.run_dir,
            args.interval,
            args.address,
            args.connect_timeout,
            args.store_grace,
        )
    except ConfigError:
        raise  # one line already (the CLI prints it)
    except Exception as err:  # noqa: BLE001 (a store that never answered, a run directory not writable)
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(
            f"executor {args.node}: cannot join the driver's store {args.store} as job {args.job!r}: "
            f"{type(err).__name__}: {first_line}"
        ) from None

    def stop_on_sigterm(*_: Any) -> None:
        executor.abandon_node()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        executor.run()
    except StoreLost as err:
        log.error("executor %s stops its node's processes: %s", args.node, err)
        executor.abandon_node()
        return 1
    except Exception as err:  # noqa: BLE001
        log.error(
            "executor %s stops its node's processes after %s: %s (the driver's store is %s)",
            args.node,
            type(err).__name__,
            err,
            args.store,
        )
        return 1
    finally:
        executor.stop()
        executor.drop_standby()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="megascale executor: runs one node's training processes.")
    add_arguments(parser)
    try:
        sys.exit(run_executor(parser.parse_args()))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
