"""One executor per node: starts the node's training processes through torchrun and reports a heartbeat.

torchrun (torch.distributed.elastic) runs this node's workers and joins the other nodes through its c10d
rendezvous, whose endpoint the driver hands out per attempt: a free port on the first node's address,
which that node's torchrun serves. An executor registers itself in the store when it starts, so the driver
finds executors started on other hosts (`megascale executor`, by Slurm, Kubernetes or hand) as it finds
the ones it starts on its own machine. The executor adds what MegaScale's executor
does on top (paper §4.1): a heartbeat with the node's process states, each rank's step and loss, and the
log lines that match error keywords; and it obeys the driver's commands (start, stop, diagnose, exit).
Stop kills the whole torchrun session at once: after a fault, the workers' state is not worth saving
(the restart loads the newest verified checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from megascale.checkpoint.persist import NODE, PERSISTER, STAGING_DIR, Persister, pending, persist
from megascale.checkpoint.staging import claim, process_identity, remove_stale, staging_base
from megascale.errors import ConfigError
from megascale.host import children_alive, free_port, interface_of, io_bytes
from megascale.resilience.client import HEARTBEAT_DIR, read_input_errors, read_progress
from megascale.resilience.inject import ATTEMPT
from megascale.stores.control import OutageTolerantStore, StoreLost, open_store

ERROR_KEYWORDS = re.compile(
    r"traceback|error|nccl|gloo|segmentation fault|core dumped|killed|exitcode", re.ASCII | re.IGNORECASE
)
MAX_ERROR_LINES = 20
# torchrun's failure summary (torch.distributed.elastic's ChildFailedError): a worker's global rank, then
# its exit code, negative when a signal ended it.
FAILED_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank")
FAILED_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")

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
        self.proc: subprocess.Popen | None = None
        self.attempt: int | None = None
        self.log_path: Path | None = None
        self.log_offset = 0
        self.errors: list[str] = []
        self.signalled: dict[str, str] = {}  # rank -> the signal that ended it, from torchrun's summary
        self.exited_at: float | None = None  # when this executor first saw torchrun gone
        self._failed_rank: str | None = None
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
        self.register()

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
        self.attempt = int(command["attempt"])
        progress_dir = self.node_dir / f"attempt-{self.attempt}"
        progress_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = progress_dir / "output.log"
        self.log_offset, self.errors = 0, []
        self.signalled, self.exited_at, self._failed_rank = {}, None, None
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
                ATTEMPT: str(self.attempt),
                STAGING_DIR: str(self.staging_dir),
                PERSISTER: "executor",
                NODE: self.node,
            },
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
            OMP_NUM_THREADS=str(threads),
        )
        torchrun = [
            sys.executable, "-m", "torch.distributed.run",
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
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
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
        if self.proc is not None and self.proc.poll() is None:
            # torchrun's session, and each worker's own: torchrun starts workers as session leaders, so a
            # hung worker would outlive its torchrun's group.
            for group in [self.proc.pid, *children_alive(self.proc.pid)]:
                try:
                    os.killpg(group, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()

    def close(self) -> None:
        """Stop the node's processes and stage 2's thread (a snapshot being persisted is finished first)."""
        self.stop()
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
            if state == "exited" and self.exited_at is None:
                self.exited_at = time.time()
        self._scan_log()
        progress = read_progress(self.log_path.parent) if self.log_path else {}
        workers = children_alive(self.proc.pid) if state == "running" and self.proc else []
        beat = {
            "time": time.time(),
            "node": self.node,
            "host": socket.gethostname(),
            "address": self.address,
            "attempt": self.attempt,
            "state": state,
            "exit_code": exit_code,
            "exited_at": self.exited_at,
            "signalled": self.signalled,
            "pid": self.proc.pid if self.proc else None,
            "workers": workers,
            # What the driver kills should this executor die: torchrun's session and each worker's.
            "sessions": [process_identity(pid) for pid in [self.proc.pid, *workers]]
            if state == "running" and self.proc is not None
            else [],
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
        """New log lines matching an error keyword go into the heartbeat, and so do the ranks torchrun's
        failure summary says a signal ended (the driver's best clue to which node a fault began on)."""
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
            if match := FAILED_RANK.match(line):
                self._failed_rank = match[1]
            elif (match := FAILED_EXIT.match(line)) and self._failed_rank is not None:
                if (code := int(match[1])) < 0:
                    try:
                        self.signalled[self._failed_rank] = signal.Signals(-code).name
                    except ValueError:
                        self.signalled[self._failed_rank] = f"signal {-code}"
                self._failed_rank = None

    def run(self) -> None:
        while True:
            command = self.store.fetch(f"cmd/{self.node}")
            if command is not None and command["seq"] > self.seen_command:
                self.seen_command = command["seq"]
                action = command["action"]
                if action == "start":
                    self.start(command)
                elif action == "stop":
                    self.stop()
                elif action == "terminate":
                    self.terminate()
                elif action == "diagnose":
                    self.stop()
                    self.diagnose(command)
                elif action == "link_check":
                    self.check_links(command)
                elif action == "exit":
                    self.stop()
                    self.remove_staging()
                    self.heartbeat(left=True)  # the last word: the driver may close the store after it
                    return
            self.heartbeat()
            time.sleep(self.interval_s)


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
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="megascale executor: runs one node's training processes.")
    add_arguments(parser)
    sys.exit(run_executor(parser.parse_args()))
