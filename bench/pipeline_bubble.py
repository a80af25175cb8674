"""The pipeline bubble of interleaved 1F1B against the zero-bubble V schedules, ZB-V and DualPipeV, at the
same pipeline degree and micro-batch count, measured from the ranks' timelines.

For each pipeline degree (`--pp`, 2 and 4) the three schedules train the same model (4 layers a rank, two
a stage: every schedule runs two stages a rank, looped for interleaved 1F1B, V-shaped for the others)
with 8 micro-batches a step, one process per rank. Each rank's timeline trace gives, per step after
warm-up, the compute actions it ran in the order it ran them (forward, backward and, for the V schedules,
backward_weight spans, with their stage and micro-batch) and their durations. A backward followed by a
weight-gradient action for the same stage and micro-batch computed only the input gradient; one without
(interleaved 1F1B's, DualPipeV's overlapped and last ones) was the full backward. Three bubble figures,
each 1 - (compute summed over the ranks) / (pp x makespan):

- counted: the executed orders replayed with unit costs (forward 1, full backward 2, input gradient 1,
  weight gradient 1): the schedule's own bubble, whatever machine ran it.
- replayed: the executed orders replayed with measured costs (each rank's median per kind and stage over
  the measured steps), each rank running its actions in order, one at a time, each as soon as its
  inputs are there (a forward after the previous stage's forward of its micro-batch, a backward after its
  own forward and the next stage's backward, a weight gradient after its input gradient), communication
  free. The machine is 2 cores shared by up to 4 ranks (and other work): the live waits also count the
  time a rank's peer was descheduled, which no schedule removes; the replay keeps the schedule and the
  real costs of its actions (a stage's embedding or loss, a split backward's overhead) without that. The
  medians still differ by stage by 10-20% from run to run, and the slowest stages set the makespan:
  interleaved 1F1B's replayed bubble moved between 0.18 and 0.22 over repeated pp4 runs, the V
  schedules' between 0.08 and 0.11.
- waited: what the timeline itself measured, the median over steps of the rank-mean share of the step
  spent waiting for pipeline sends and receives (the training thread's p2p waits, as `bubble_s` sums
  them). metrics.jsonl holds rank 0's `bubble_s` only, so every rank's is summed from its trace here
  (rank 0's equals its metrics.jsonl value). Noisy on 2 shared cores; reported for completeness.

With more ranks than cores each rank runs in a fixed CPU share, cores/ranks of a core (bench/cpushare.py,
as bench/overlap.py does; needs root, else or with `--no-cpu-shares` Linux shares the cores): a rank's
actions then take as long whichever peers are running, instead of speeding up while they wait.

`replayed_step_s` is the replay's makespan: with the split backward's overhead a schedule can have the
smaller bubble and still take longer. Ratios of each figure to interleaved 1F1B's are printed as
`pp4_zbv_over_interleaved_replayed`. Prints one `name value` line per figure and writes them as JSON.

    python bench/pipeline_bubble.py --out bench/results/pipeline_bubble.json   # about 70 s on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.overlap, run as a script

from bench import cpushare  # noqa: E402
from bench.overlap import run_job  # noqa: E402
from bench.record import save_record  # noqa: E402

SCHEDULES = {"interleaved": "interleaved_1f1b", "zbv": "zbv", "dualpipev": "dualpipev"}
MICRO_BATCHES = 8
WARMUP_STEPS = 2
TIMEOUT_S = 600.0
MODEL = [
    "--model.dim=128",
    "--model.attention.n_heads=4",
    "--model.attention.n_kv_heads=4",
    "--model.max_seq_len=128",
    "--data.seq_len=128",
    f"--training.global_batch_size={MICRO_BATCHES}",
    "--training.micro_batch_size=1",
    "--training.threads=1",
    "--training.device=cpu",
    "--training.peak_tflops=1",
    "--training.log_every=1",
    "--training.val_every=100000",
    "--checkpoint.enabled=false",
    "--metrics.timeline=true",
    "--metrics.progress=false",
    "--metrics.tensorboard=false",
    "--parallel.pp_virtual_stages=2",
]
SPAN_KINDS = {"forward": "F", "backward": "B", "backward_weight": "W"}
UNIT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class Action(NamedTuple):
    kind: str  # F forward, B full backward, I input-gradient backward, W weight-gradient backward
    stage: int
    micro_batch: int


class RankStep(NamedTuple):
    actions: list[Action]  # in the order the rank ran them
    durations_s: list[float]
    step_s: float
    p2p_wait_s: float  # the training thread's waits for pipeline sends and receives


def read_rank_steps(trace: Path) -> dict[int, RankStep]:
    """One rank's steps by number, from its timeline trace (a finished run's: the JSON array is closed)."""
    events = json.loads(trace.read_text())
    wait_tracks = {
        event["tid"]
        for event in events
        if event.get("ph") == "M" and event["name"] == "thread_name" and event["args"]["name"] == "wait"
    }
    spans = sorted((event for event in events if event.get("ph") == "X"), key=lambda event: event["ts"])
    steps = {}
    for step in (span for span in spans if span["name"] == "step"):
        inside = [span for span in spans if step["ts"] <= span["ts"] < step["ts"] + step["dur"]]
        compute = [span for span in inside if span["cat"] == "main" and span["name"] in SPAN_KINDS]
        split = {
            (span["args"]["chunk"], span["args"]["micro_batch"])
            for span in compute
            if span["name"] == "backward_weight"
        }
        actions = []
        for span in compute:
            where = (span["args"]["chunk"], span["args"]["micro_batch"])
            kind = SPAN_KINDS[span["name"]]
            actions.append(Action("I" if kind == "B" and where in split else kind, *where))
        p2p_wait_us = sum(
            span["dur"] for span in inside if span["tid"] in wait_tracks and span["args"].get("p2p")
        )
        steps[step["args"]["step"]] = RankStep(
            actions, [span["dur"] / 1e6 for span in compute], step["dur"] / 1e6, p2p_wait_us / 1e6
        )
    return steps


def _done_key(action: Action) -> tuple[str, int, int]:
    """What an action makes: an input gradient is the backward the previous stage waits for."""
    return ("B" if action.kind == "I" else action.kind, action.stage, action.micro_batch)


def _inputs(action: Action, stages: int) -> list[tuple[str, int, int]]:
    stage, micro_batch = action.stage, action.micro_batch
    if action.kind == "F":
        return [("F", stage - 1, micro_batch)] if stage > 0 else []
    if action.kind == "W":
        return [("B", stage, micro_batch)]
    later = [("B", stage + 1, micro_batch)] if stage < stages - 1 else []
    return [("F", stage, micro_batch), *later]


def replay(
    orders: list[list[Action]], cost_s: Callable[[int, Action], float], stages: int
) -> tuple[float, float]:
    """Makespan and compute summed over the ranks when rank r runs `orders[r]` in that order, one action
    at a time, each as soon as its inputs are made; communication is free."""
    finish_s: dict[tuple[str, int, int], float] = {}
    free_at_s = [0.0] * len(orders)
    position = [0] * len(orders)
    busy_s = 0.0
    while any(position[rank] < len(order) for rank, order in enumerate(orders)):
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                action = order[position[rank]]
                needs = _inputs(action, stages)
                if any(need not in finish_s for need in needs):
                    break
                start_s = max([free_at_s[rank], *(finish_s[need] for need in needs)])
                duration_s = cost_s(rank, action)
                free_at_s[rank] = finish_s[_done_key(action)] = start_s + duration_s
                busy_s += duration_s
                position[rank] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the executed orders deadlock when replayed at positions {position}")
    return max(free_at_s), busy_s


def bubble(makespan_s: float, busy_s: float, ranks: int) -> float:
    return 1.0 - busy_s / (ranks * makespan_s)


def measure(rank_steps: list[dict[int, RankStep]], pp: int) -> dict[str, float]:
    """The counted, replayed and waited bubbles (medians over the steps after warm-up) of one run."""
    measured = sorted(rank_steps[0])[WARMUP_STEPS:]
    durations_s: dict[tuple[int, str, int], list[float]] = defaultdict(list)
    for rank, steps in enumerate(rank_steps):
        for step in measured:
            for action, duration_s in zip(steps[step].actions, steps[step].durations_s):
                durations_s[(rank, action.kind, action.stage)].append(duration_s)
    median_s = {key: statistics.median(values) for key, values in durations_s.items()}

    def unit_cost(rank: int, action: Action) -> float:
        return UNIT_COSTS[action.kind]

    def measured_cost_s(rank: int, action: Action) -> float:
        return median_s[(rank, action.kind, action.stage)]

    counted, replayed, replayed_step_s, waited = [], [], [], []
    for step in measured:
        orders = [steps[step].actions for steps in rank_steps]
        counted.append(bubble(*replay(orders, unit_cost, 2 * pp), pp))
        makespan_s, busy_s = replay(orders, measured_cost_s, 2 * pp)
        replayed.append(bubble(makespan_s, busy_s, pp))
        replayed_step_s.append(makespan_s)
        waited.append(statistics.mean(steps[step].p2p_wait_s / steps[step].step_s for steps in rank_steps))
    return {
        "counted": round(statistics.median(counted), 4),
        "replayed": round(statistics.median(replayed), 4),
        "waited": round(statistics.median(waited), 4),
        "replayed_step_s": round(statistics.median(replayed_step_s), 5),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="Pipeline degrees to run.")
    parser.add_argument(
        "--steps", type=int, default=12, help=f"Steps per run; the first {WARMUP_STEPS} are warm-up."
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench/results/pipeline_bubble.json"), help="JSON output."
    )
    parser.add_argument(
        "--no-cpu-shares",
        dest="cpu_shares",
        action="store_false",
        help="Let ranks outnumbering the cores share them as Linux schedules them. By default each gets a "
        "fixed share, cores/ranks of a core (bench/cpushare.py, needs root): its actions then take as long "
        "whichever other ranks are running, instead of speeding up while its peers wait.",
    )
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be above the {WARMUP_STEPS} warm-up steps")
    started = time.perf_counter()
    figures: dict[str, float] = {}
    failed: dict[str, str] = {}
    cores = len(os.sched_getaffinity(0))
    no_shares = cpushare.available() if args.cpu_shares else "--no-cpu-shares"
    shares_used: dict[int, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pp in args.pp:
            shares = None
            if pp > cores and no_shares is None:
                shares = cpushare.CpuShares(f"{os.getpid()}pp{pp}", pp, cores)
                shares.create()
                shares_used[pp] = shares.describe()
                print(f"# pp{pp}: {shares.describe()}", flush=True)
            try:
                for name, schedule in SCHEDULES.items():
                    run_dir = Path(tmp) / f"pp{pp}-{name}"
                    job = [
                        *MODEL,
                        f"--model.n_layers={4 * pp}",
                        f"--parallel.pp={pp}",
                        f"--parallel.pp_schedule={schedule}",
                        f"--training.steps={args.steps}",
                    ]
                    try:
                        run_job(None, run_dir, job, TIMEOUT_S, node_of_rank=(0,) * pp, shares=shares)
                    except RuntimeError as err:
                        failed[f"pp{pp}_{name}"] = str(err)
                        print(f"# pp{pp} {name} failed: {err}", file=sys.stderr, flush=True)
                        continue
                    traces = sorted(run_dir.glob("traces/*/rank-*.json"))
                    for key, value in measure([read_rank_steps(trace) for trace in traces], pp).items():
                        figures[f"pp{pp}_{name}_{key}"] = value
                        print(f"pp{pp}_{name}_{key} {value}", flush=True)
            finally:
                if shares is not None:
                    shares.remove()
            for name in ("zbv", "dualpipev"):
                for key in ("counted", "replayed", "waited", "replayed_step_s"):
                    ours, theirs = f"pp{pp}_{name}_{key}", f"pp{pp}_interleaved_{key}"
                    if ours in figures and figures.get(theirs):
                        ratio = round(figures[ours] / figures[theirs], 4)
                        figures[f"pp{pp}_{name}_over_interleaved_{key}"] = ratio
                        print(f"pp{pp}_{name}_over_interleaved_{key} {ratio}", flush=True)
    setup = {
        "schedules": SCHEDULES,
        "micro_batches": MICRO_BATCHES,
        "model": [*MODEL, "--model.n_layers=<4 * pp>"],
        "steps": args.steps,
        "warmup_steps": WARMUP_STEPS,
        "unit_costs": UNIT_COSTS,
        "cpu_shares": shares_used or f"none ({no_shares or 'one core or more per rank'})",
        "failed": failed,
        "runtime_s": round(time.perf_counter() - started, 1),
    }
    save_record(args.out, figures, setup)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
