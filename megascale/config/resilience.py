"""The resilience section: `megascale launch`'s driver, executors, fault detection and recovery."""

from __future__ import annotations

from dataclasses import dataclass

from megascale.options import option


@dataclass
class ResilienceConfig:
    """`megascale launch`: the driver, its executors, fault detection and recovery (docs/resilience.md)."""

    nodes: int = option(
        1, "Nodes the job runs on; on one machine each is an executor with its own processes.", ge=1
    )
    nproc_per_node: int = option(1, "Training processes per node.", ge=1)
    executors: str = option(
        "local",
        "'local': the driver starts one executor per node on its own machine. 'external': executors are "
        "started on each host (`megascale executor`, e.g. by srun or a Kubernetes pod; see deploy/) and "
        "join through the store, which must then be an address they reach (resilience.store).",
        choices=("local", "external"),
    )
    job_id: str | None = option(
        None,
        "The job's id, shared by the driver and its executors (`megascale executor --job`); unset: a random "
        "one. Set it when executors are started elsewhere, e.g. to $SLURM_JOB_ID.",
    )
    spares: int = option(0, "Extra nodes kept idle to replace evicted ones.", ge=0)
    store: str = option(
        "tcp://127.0.0.1:0",
        "Where heartbeats and commands go: tcp://HOST:PORT (a TCPStore the driver hosts; port 0 picks a free "
        "one; with external executors, an address and port they reach) or redis://HOST:PORT/DB (a Redis "
        "server).",
    )
    heartbeat_interval_s: float = option(1.0, "Seconds between an executor's heartbeats.", gt=0)
    heartbeat_timeout_s: float = option(15.0, "A node whose heartbeat is older than this is lost.", gt=0)
    store_grace_s: float = option(
        60.0,
        "How long the driver and the executors wait for the control store to answer again (a Redis "
        "restart) before the job ends resumable; training goes on meanwhile.",
        gt=0,
    )
    hang_timeout_s: float = option(
        120.0, "No step completed for this long, while the processes live, is a hang.", gt=0
    )
    startup_timeout_s: float = option(
        600.0,
        "The first step of an attempt may take this long (start-up, data preparation, compilation, loading "
        "the checkpoint) before it counts as a hang; the driver also waits this long for its executors to "
        "join.",
        gt=0,
    )
    comm_flat_timeout_s: float = option(
        60.0,
        "No step completed and no byte through the workers' sockets or files for this long is a hang, "
        "found before hang_timeout_s (a long step whose communication still flows waits for that); "
        "0 turns it off.",
        ge=0,
    )
    loss_spike_z: float = option(
        6.0,
        "A step's loss more than this many standard deviations above the mean of the last "
        "anomaly_window readings is a loss spike; 0 turns it off.",
        ge=0,
    )
    step_time_factor: float = option(
        3.0,
        "Three heartbeat readings in a row with a step time above this factor x the median of the last "
        "anomaly_window are a collapse of the step time (a degraded node); 0 turns it off.",
        ge=0,
    )
    anomaly_window: int = option(
        50, "Readings (one per new step seen) the loss and step-time detectors keep.", ge=4
    )
    anomaly_action: str = option(
        "warn",
        "On a loss spike or a step-time collapse: 'warn' (an event, the job goes on) or 'restart' (stop, "
        "diagnose, evict nodes that fail, and restart from the newest checkpoint).",
        choices=("warn", "restart"),
    )
    evict_stragglers: bool = option(
        False,
        "When the training processes name a straggler (metrics.straggler_ratio) and a spare node is free: "
        "stop, evict the straggler's node and restart on the spare. Without a free spare it is only logged.",
    )
    standby: bool = option(
        False,
        "Keep a warm standby of the job: once an attempt trains, the next one is started on the same nodes "
        "(processes, process groups, data and model built) and waits. After a fault that leaves every "
        "node healthy (a rank that died, stopped or hung, a rollback, a slow step), the attempt is stopped, "
        "the nodes self-checked and the standby takes over from the newest snapshot in the nodes' memory "
        "(checkpoint.snapshot_every) in about a second; other faults restart in full. Costs a second set "
        "of idle processes and their memory on every node.",
    )
    stopped_timeout_s: float = option(
        5.0,
        "A training process stopped (SIGSTOP, a debugger) this long without a step is a fault, found from "
        "its state in /proc before any hang timeout; 0 turns it off.",
        ge=0,
    )
    diagnose: bool = option(True, "Run the self-check on every node after a fault and evict those that fail.")
    diagnose_bandwidth: bool = option(
        True,
        "Include the communication checks in the self-check: an all-to-all among nproc_per_node fresh local "
        "processes, and an all-reduce between neighbouring nodes (a few seconds of process start-up each).",
    )
    expected_gflops: float | None = option(
        None,
        "The float32 matmul rate (GFLOP/s) a healthy node reaches in the self-check; unset: compared with "
        "the median of the nodes diagnosed together (three or more).",
    )
    expected_alltoall_gbps: float | None = option(
        None,
        "The all-to-all rate (GB/s sent per process) a healthy node reaches in the self-check; unset: "
        "compared with the median of the nodes diagnosed together.",
    )
    expected_allreduce_gbps: float | None = option(
        None,
        "The rate (GB/s) of a healthy two-node all-reduce in the self-check; unset: compared with the median "
        "of the links measured together (three or more).",
    )
    min_speed_ratio: float = option(
        0.5, "A node whose self-check rate is below this fraction of the expected one fails.", gt=0, le=1
    )
    diagnose_timeout_s: float = option(
        120.0, "A node that has not reported its self-check by then fails it.", gt=0
    )
    max_restarts: int = option(5, "Restarts before the driver gives up.", ge=0)
    nan_policy: str = option(
        "skip",
        "On a non-finite loss or gradient norm (agreed by all ranks): 'skip' the update and go on; "
        "'rollback': exit, and the driver restarts from the newest checkpoint.",
        choices=("skip", "rollback"),
    )
    inject: str | None = option(
        None,
        "Faults to inject, for tests and rehearsals (also MEGASCALE_INJECT), e.g. 'kill:rank=1:step=7'; see "
        "docs/resilience.md.",
    )
