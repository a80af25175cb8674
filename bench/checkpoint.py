"""Checkpoint figures, side by side in one run: training stall, recovery read, and time to recover.

1. Stall. One process holds a model of `--gib` GiB of float32 weights. Rounds alternate (sync,
   two-stage, sync, ...) so machine noise hits both alike:
   - sync: `torch.distributed.checkpoint.save` straight to the run's disk directory (fsync'd, as many
     writer threads as the background write uses), then the manifest commit; training would wait for all
     of it (`checkpoint.async_save = false`);
   - two-stage: megascale's `Checkpointer.save`. The training stall is stage 1, a copy into the node's
     memory; serialising and persisting (stage 2) run in the background and are timed apart.
   Then verifying and loading the newest checkpoint.
2. Recovery read. `--ranks` processes holding identical state (DP replicas) load a `--read-gib` GiB
   checkpoint, each from storage, then one reading and broadcasting to the rest; bytes read from storage
   (summed over ranks) and time for each.
3. Recovery. `megascale launch` of a small 2-node x 2-process job; a rank is SIGKILLed at a step; from the
   events log: failure to detection, to restart, to the first step after recovery, and steps recomputed.

With `--device cuda` the stall's state lives on the GPU (stage 1 is then a device-to-host copy) and the
recovery run trains on it (`--layout 1x1`: NCCL puts one rank on one GPU).
Prints one `name value` line per figure and writes them, with the machine, as JSON.

    python bench/checkpoint.py --gib 1 --rounds 3 --out bench/results/checkpoint.json
    python bench/checkpoint.py --device cuda --layout 1x1 --parts stall,recovery --out gpu-checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from megascale.checkpoint.checkpointer import Checkpointer, load_checkpoint, write_checkpoint, write_threads
from megascale.checkpoint.manifest import commit, verify
from megascale.checkpoint.stateful import ModelState


def big_model(gib: float) -> nn.Module:
    """Square float32 linears, 4096 x 4096 (64 MiB) each, adding up to `gib` GiB."""
    layers = max(1, round(gib * 1024 / 64))
    return nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(layers)))


# -- 1. stall ---------------------------------------------------------------------------------------------
def stall(gib: float, rounds: int, directory: Path | None, device: torch.device) -> tuple[dict, dict]:
    model = big_model(gib).to(device)
    state = {"model": ModelState(model)}
    with tempfile.TemporaryDirectory(dir=directory) as root:
        sync_root, staged_root = Path(root) / "sync", Path(root) / "two-stage"
        saver = Checkpointer(str(staged_root), keep=2, async_save=True)
        saver.prepare(state)  # as the trainer does at start: the snapshot memory is allocated once
        sync_s, stall_s, stage2_s = [], [], []
        for round_index in range(rounds):
            location = sync_root / f"step-{round_index:08d}"
            started = time.perf_counter()
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(str(location), thread_count=write_threads()),
                no_dist=True,
            )
            commit(str(location), {"step": round_index})
            sync_s.append(time.perf_counter() - started)

            started = time.perf_counter()
            newest = saver.save(round_index, state, {})
            stall_s.append(time.perf_counter() - started)
            saver.wait()
            stage2_s.append(time.perf_counter() - started - stall_s[-1])
        saver.close()
        started = time.perf_counter()
        problem = verify(newest)
        verify_s = time.perf_counter() - started
        assert problem is None, problem
        started = time.perf_counter()
        load_checkpoint(newest, {"model": ModelState(big_model(gib))})
        load_s = time.perf_counter() - started
    figures = {
        "state_gib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30,
        "sync_save_s": statistics.median(sync_s),
        "stage1_stall_s": statistics.median(stall_s),
        "stall_ratio": statistics.median(stall_s) / statistics.median(sync_s),
        "stage2_background_s": statistics.median(stage2_s),
        "verify_s": verify_s,
        "load_s": load_s,
    }
    return figures, {"sync_save_s": sync_s, "stage1_stall_s": stall_s, "stage2_background_s": stage2_s}


# -- 2. recovery read -------------------------------------------------------------------------------------
def _replica(rank: int, world: int, init_file: str, location: str, gib: float, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    try:
        model = big_model(gib)
        figures = {}
        for name, replicas in (("each_rank", None), ("broadcast", dist.group.WORLD)):
            with torch.no_grad():
                for param in model.parameters():
                    param.zero_()
            loader = Checkpointer(os.path.dirname(location), keep=1)
            dist.barrier()
            started = time.perf_counter()
            loader.load(location, {"model": ModelState(model)}, replicas=replicas)
            dist.barrier()
            checksum = sum(float(param.detach().double().sum()) for param in model.parameters())
            figures[name] = (loader.bytes_read, time.perf_counter() - started, checksum)
        results.put((rank, figures))
    finally:
        dist.destroy_process_group()


def recovery_read(gib: float, ranks: int, directory: Path | None) -> dict:
    with tempfile.TemporaryDirectory(dir=directory) as root:
        torch.manual_seed(0)
        location = write_checkpoint(
            str(Path(root) / "step-00000001"), {"model": ModelState(big_model(gib))}, {}
        )
        context = multiprocessing.get_context("fork")
        results = context.Queue()
        procs = [
            context.Process(target=_replica, args=(rank, ranks, f"{root}/init", location, gib, results))
            for rank in range(ranks)
        ]
        for proc in procs:
            proc.start()
        try:
            outcome = dict(results.get(timeout=1200) for _ in procs)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    figures = {"read_state_gib": gib, "read_replicas": ranks}
    for name in ("each_rank", "broadcast"):
        checksums = {round(outcome[rank][name][2], 3) for rank in outcome}
        assert len(checksums) == 1, f"{name}: ranks loaded different states {checksums}"
        figures[f"read_bytes_{name}_gib"] = sum(outcome[rank][name][0] for rank in outcome) / 2**30
        figures[f"read_time_{name}_s"] = max(outcome[rank][name][1] for rank in outcome)
    figures["read_bytes_ratio"] = figures["read_bytes_broadcast_gib"] / figures["read_bytes_each_rank_gib"]
    return figures


# -- 3. time to recover -----------------------------------------------------------------------------------
SMALL_JOB = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.attention.n_heads=4",
    "--model.max_seq_len=64",
    "--data.seq_len=64",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=2",
    "--training.val_every=1000",
    "--metrics.progress=false",
    "--metrics.tensorboard=false",
    "--resilience.heartbeat_interval_s=0.5",
]


def _corpus(root: Path) -> Path:
    rng = random.Random(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "value", "data", "x"]
    for index in range(60):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(40)]
        (root / f"doc{index:03d}.txt").write_text("\n".join(lines) + "\n")
    return root


def recovery(
    steps: int, every: int, kill_step: int, directory: Path | None, device: str, nodes: int, per_node: int
) -> dict:
    """`megascale launch` of `nodes` x `per_node` ranks (FSDP over all), the last rank SIGKILLed at a step."""
    ranks = nodes * per_node
    last = ranks - 1
    with tempfile.TemporaryDirectory(dir=directory) as root:
        corpus = _corpus(Path(root))
        run_dir = Path(root) / "run"
        command = [
            sys.executable, "-m", "megascale.cli", "launch", *SMALL_JOB,
            f"--data.source={corpus}", f"--data.cache_dir={root}/data", f"--training.run_dir={run_dir}",
            f"--training.steps={steps}", f"--checkpoint.every={every}", f"--training.device={device}",
            f"--parallel.dp_shard={ranks}", f"--resilience.nodes={nodes}",
            f"--resilience.nproc_per_node={per_node}",
            f"--resilience.inject=kill:rank={last}:step={kill_step}",
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=root)
        assert result.returncode == 0, result.stderr[-3000:]
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        first = {}
        for event in events:
            first.setdefault(event["event"], event)
        # The kill comes as step `kill_step` begins, right after the killed rank reported the step before.
        restarted = next(e["time"] for e in events if e["event"] == "start" and e["attempt"] == 1)
        reports = run_dir.glob(f"nodes/*/attempt-0/rank-{last}.json")
        killed = max(json.loads(path.read_text())["time"] for path in reports)
    return {
        "kill_step": kill_step,
        "checkpoint_every": every,
        "failure_to_detection_s": first["fault"]["time"] - killed,
        "failure_to_restart_s": restarted - killed,
        "failure_to_first_step_s": first["recovered"]["time"] - killed,
        "steps_recomputed": (kill_step - 1) - first["recovered"]["resumed_from"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="State size for the stall, in GiB (float32).")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of each kind, alternating.")
    parser.add_argument("--read-gib", type=float, default=0.5, help="State size for the recovery read.")
    parser.add_argument("--ranks", type=int, default=4, help="Replicas in the recovery read.")
    parser.add_argument("--kill-step", type=int, default=6, help="Step at which the recovery run is killed.")
    parser.add_argument(
        "--dir", type=Path, default=None, help="Disk directory for checkpoints (default: temp)."
    )
    parser.add_argument("--device", default="cpu", help="Where the stall's state and the recovery run live.")
    parser.add_argument(
        "--layout", default="2x2", help="Nodes x processes per node of the recovery run (1x1 on one GPU)."
    )
    parser.add_argument("--parts", default="stall,read,recovery", help="Which of the three to run.")
    parser.add_argument("--out", type=Path, default=Path("bench/results/checkpoint.json"))
    args = parser.parse_args()
    parts = args.parts.split(",")
    nodes, per_node = (int(count) for count in args.layout.split("x"))

    figures: dict = {}
    rounds: dict = {}

    def report(part_figures: dict) -> None:  # each part's lines as soon as it is done
        figures.update(part_figures)
        for name, value in part_figures.items():
            print(f"{name} {value:.3f}" if isinstance(value, float) else f"{name} {value}", flush=True)

    if "stall" in parts:
        stalled, rounds = stall(args.gib, args.rounds, args.dir, torch.device(args.device))
        report(stalled)
    if "read" in parts:
        report(recovery_read(args.read_gib, args.ranks, args.dir))
    if "recovery" in parts:
        report(recovery(12, 4, args.kill_step, args.dir, args.device, nodes, per_node))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": args.device,
        },
        "rounds": rounds,
        **figures,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
