"""How much a slower network between nodes slows megascale's layout and pure ZeRO-3: step times at two
inter-node bandwidths 8x apart, measured and as the planner predicts them.

The claim checked (veGiantModel's, issue 26): with tensor parallelism inside a node and pipeline
parallelism across, throughput changed by under 10% between RDMA-class and TCP-class networks, where
DeepSpeed ZeRO's changed up to ~5x. The reason is what crosses the nodes: ZeRO-3 all-gathers every weight
twice a micro-batch (forward and backward) and reduce-scatters every gradient, all across the nodes, in
bursts that wait on the network; a pipeline sends only a micro-batch's activations at a stage boundary,
which the decoupled sends and receives of `parallel.overlap.pp` hide behind the other micro-batches.

Two "nodes" as network namespaces (bench/netem.py), 2 ranks each; the link between them is limited with
`tc` to `--fast` and then `--slow` (token buckets where the kernel has no netem; the links inside a node
are plain loopback, the emulated NVLink). Each of the 4 ranks runs in a CPU share of its own, half a core
(bench/cpushare.py): an emulated device that idles while its rank waits. The model is bench/overlap.py's
(dim 512, 4 layers, 256-token sequences, 32 a step in micro-batches of 8). Layouts, all overlaps on:

- `megascale` (the layout the claim is about): tp2 x pp2, 1F1B, tp ranks on one node, the two pipeline
  stages on the two nodes. Per micro-batch one activation crosses forward and one gradient backward
  (4 MB each, split over the tp ranks' sequence shards): 16 MB each way a step, behind the other micro-
  batches' compute. The interleaved schedule's 2 chunks a rank cross the nodes three times each way per
  micro-batch (48 MB), and dp2 x tp2 with ZeRO-1 moves each tp rank's half of the weights and gradients
  over the nodes once a step (48 MB each way, at the step's end and start, behind only the last
  micro-batch's backward and the first one's forward); both run as well, for comparison.
- `zero3`: `--parallel.dp_shard=4 --parallel.zero_stage=3`, FSDP over all 4 ranks, one micro-batch
  each; its rings cross the nodes with 3/4 of 48 MB per collective, three collectives a step: 108 MB.

A layout's fast and slow runs follow each other, so that the machine's drift over minutes falls on both.
The figure is rank 0's median step time over the steps after the 3 of warm-up, and the ratio slow/fast.

The prediction: the CPU profile from `megascale calibrate` (measured here first, in a cache of the bench's
own, `--calibration-rounds` rounds), made into this emulation's cluster as `megascale plan --hardware cpu
--gpus-per-node 2 --nic-gbps RATE --config-layout` would: 2 devices a node, and a NIC per device of half
the inter-node link (the planner gives a group 1 NIC per rank a node holds, and the node's 2 ranks share
the one link), its latency gloo's plus the link's delay where netem emulates one; inside a node, the
measured gloo rate. What the CLI cannot express is set here: each device computes at half a core (the
profile's FLOP/s, memory rate and intra-node rate halved, its host times doubled, no core sharing), as
the CPU shares make it. The step is predicted for the trainer (`--system trainer`, the CLI's default on
CPU, which models no overlap: `predicted`), for the trainer with its pipeline and data-parallel overlaps
modelled (`predicted_overlap`), and on whole-core devices as the CLI alone has them
(`predicted_whole_core`).

Prints one `name value` line per figure and writes them as JSON.

    sudo python bench/bandwidth.py --out bench/results/bandwidth.json   # about 15 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.*, run as a script

from bench import cpushare  # noqa: E402
from bench.netem import EmulatedNodes, Link  # noqa: E402
from bench.overlap import MODEL, run_job  # noqa: E402
from bench.plan_accuracy import calibration  # noqa: E402
from bench.record import save_record  # noqa: E402
from megascale.config import load_config  # noqa: E402
from megascale.observe.cpu_load import CpuSampler  # noqa: E402
from megascale.plan import profiles as plan_profiles  # noqa: E402
from megascale.plan.hardware import HardwareProfile  # noqa: E402
from megascale.plan.job import Cluster, job_from_config, layout_from_config  # noqa: E402
from megascale.plan.step import estimate_step  # noqa: E402
from megascale.plan.systems import TRAINER  # noqa: E402

WARM_UP_STEPS = 3
NODE_OF_RANK = (0, 0, 1, 1)  # ranks fill nodes in order; tp is innermost, so a tp group is on one node
RANKS_PER_NODE = 2
LAYOUTS = {
    "megascale": ["--parallel.tp=2", "--parallel.pp=2", "--parallel.pp_schedule=1f1b"],
    "megascale_interleaved": [
        "--parallel.tp=2",
        "--parallel.pp=2",
        "--parallel.pp_schedule=interleaved_1f1b",
        "--parallel.pp_virtual_stages=2",
    ],
    "megascale_dp2xtp2_zero1": ["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.zero_stage=1"],
    "zero3": ["--parallel.dp_shard=4", "--parallel.zero_stage=3"],
}
ALL_OVERLAPS_ON = [f"--parallel.overlap.{name}=true" for name in ("tp", "pp", "dp", "ep", "cp")]
# The trainer as `megascale plan --system trainer` models it, and with the overlaps these runs have on.
TRAINER_WITH_OVERLAPS = dataclasses.replace(TRAINER, tp_overlap=True, pp_overlap=True, dp_overlap=True)


def rate_bits_per_s(rate: str) -> float:
    """tc's rate notation ("800mbit", "1gbit") in bits/s."""
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if rate.endswith(suffix):
            return float(rate.removesuffix(suffix)) * scale
    raise ValueError(f"unknown rate {rate!r}: use kbit, mbit or gbit")


def emulated_profile(
    measured: HardwareProfile, link: Link, delay_emulated: bool, core_share: float
) -> HardwareProfile:
    """`measured` (this CPU, a core per process) as the emulation's devices and network: `core_share` of a
    core per device, RANKS_PER_NODE devices a node, and each device's NIC an equal share of `link`."""
    slower = 1 / core_share
    host_times = {
        field.name: getattr(measured, field.name) * slower
        for field in dataclasses.fields(measured)
        if field.name.endswith("_overhead_s") or field.name == "tp_layer_overhead_s_per_byte"
    }
    return dataclasses.replace(
        measured,
        peak_tflops={dtype: tflops * core_share for dtype, tflops in measured.peak_tflops.items()},
        hbm_bytes_per_s=measured.hbm_bytes_per_s * core_share,
        intra_node_bytes_per_s=measured.intra_node_bytes_per_s * core_share,  # gloo's copies take the core
        inter_node_bytes_per_s=rate_bits_per_s(link.rate) / 8 / RANKS_PER_NODE,
        inter_node_latency_s=measured.inter_node_latency_s + (link.delay_ms / 1e3 if delay_emulated else 0),
        devices_per_node=RANKS_PER_NODE,
        host_cores=0,  # each device computes alone, at its share
        **host_times,
    )


def measure(
    jobs: dict[str, list[str]], links: dict[str, Link], timeout_s: float, work: Path
) -> tuple[dict[str, float], dict[str, str], bool]:
    """Run every layout's job (its training arguments) on each link, back to back. Returns rank 0's median
    step time after warm-up and the hypervisor's steal over the timed steps, by `{layout}_{speed}_...`;
    how each network and the CPU shares were set up; whether netem emulated the links' delay."""
    networks = {
        speed: EmulatedNodes(f"{os.getpid()}{speed[0]}", between=link) for speed, link in links.items()
    }
    shares = cpushare.CpuShares(f"{os.getpid()}bw", len(NODE_OF_RANK), len(os.sched_getaffinity(0)))
    figures: dict[str, float] = {}
    try:
        for nodes in networks.values():
            nodes.create()
        if why := cpushare.available():
            raise RuntimeError(f"the emulated devices need CPU shares: {why}")
        shares.create()
        setup = {speed: nodes.describe() for speed, nodes in networks.items()} | {
            "cpu_shares": shares.describe()
        }
        for line in setup.values():
            print(f"# {line}", flush=True)
        for layout, job in jobs.items():
            for speed, nodes in networks.items():
                with CpuSampler() as sampler:
                    records = run_job(nodes, work / f"{layout}-{speed}", job, timeout_s, NODE_OF_RANK, shares)
                timed = [record for record in records if "step_time_s" in record][WARM_UP_STEPS:]
                figures[f"{layout}_{speed}_step_s"] = statistics.median(r["step_time_s"] for r in timed)
                figures[f"{layout}_{speed}_steal"] = sampler.steal_over_steps(timed)
                for key in (f"{layout}_{speed}_step_s", f"{layout}_{speed}_steal"):
                    print(f"{key} {figures[key]:.4g}", flush=True)
    finally:
        for nodes in networks.values():  # first: it kills what is left of the ranks
            nodes.remove()
        shares.remove()
    return figures, setup, all(nodes.delay_emulated for nodes in networks.values())


def predict(
    jobs: dict[str, list[str]], cpu: HardwareProfile, links: dict[str, Link], delay_emulated: bool
) -> dict[str, float]:
    """The planner's step time for every layout's job on each link, by `{layout}_{speed}_...`: for the
    trainer as `megascale plan` models it on devices of half a core ("predicted"), the same with its
    overlaps modelled ("predicted_overlap"), and on devices of a whole core, as the CLI's profile has them
    ("predicted_whole_core")."""
    core_share = len(os.sched_getaffinity(0)) / len(NODE_OF_RANK)
    variants = {
        "predicted": (core_share, TRAINER),
        "predicted_overlap": (core_share, TRAINER_WITH_OVERLAPS),
        "predicted_whole_core": (1.0, TRAINER),
    }
    figures = {}
    for layout, job in jobs.items():
        cfg = load_config(None, job)
        for speed, link in links.items():
            for name, (share, features) in variants.items():
                estimate = estimate_step(
                    job_from_config(cfg),
                    layout_from_config(cfg, len(NODE_OF_RANK)),
                    features,
                    emulated_profile(cpu, link, delay_emulated, share),
                    Cluster(len(NODE_OF_RANK)),
                )
                figures[f"{layout}_{speed}_{name}_step_s"] = estimate.step_s
    return figures


def add_ratios_and_print(figures: dict[str, float], layouts: Iterable[str]) -> None:
    """Each layout's slow/fast ratio of its measured and predicted steps into `figures`; then every figure,
    one `name value` line each."""
    for layout in layouts:
        for name in ("step", "predicted_step", "predicted_overlap_step", "predicted_whole_core_step"):
            ratio = figures[f"{layout}_slow_{name}_s"] / figures[f"{layout}_fast_{name}_s"]
            figures[f"{layout}_{name}_ratio_slow_over_fast"] = ratio
    for name, value in figures.items():
        print(f"{name} {value:.4g}")


def replan(saved: Path, out: Path) -> int:
    """The predictions of a saved run, made again by today's planner; its measurements kept."""
    record = json.loads(saved.read_text())
    setup, figures = record["setup"], record["figures"]
    links = {speed: Link(**link) for speed, link in setup["links"].items()}
    delay_emulated = "no delay" not in setup["fast"]
    cpu = plan_profiles.measured_profile(
        setup["calibration"], 1, setup["calibrated_peak_tflops"], "this bench's calibration"
    )
    figures |= predict(setup["jobs"], cpu, links, delay_emulated)
    add_ratios_and_print(figures, setup["jobs"])
    record["figures"] = figures
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", default="800mbit", help="The fast link between the nodes (tc's rate).")
    parser.add_argument("--slow", default="100mbit", help="The slow link between the nodes (tc's rate).")
    parser.add_argument(
        "--delay-ms", type=float, default=0.5, help="One-way delay of both, where netem runs."
    )
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument(
        "--steps", type=int, default=8, help=f"Steps per run; the first {WARM_UP_STEPS} are warm-up."
    )
    parser.add_argument("--dim", type=int, default=512, help="Model width (bench/overlap.py's).")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="Sequences a micro-batch; 4 a step.")
    parser.add_argument("--calibration-rounds", type=int, default=2, help="Rounds of `megascale calibrate`.")
    parser.add_argument("--timeout", type=float, default=600, help="Seconds a run may take before it fails.")
    parser.add_argument("--out", type=Path, default=Path("bench/results/bandwidth.json"), help="JSON output.")
    parser.add_argument(
        "--replan",
        type=Path,
        metavar="JSON",
        help="Measure nothing: recompute the predictions of a run saved in JSON with today's planner, from "
        "the calibration it measured, and write the run back with them to --out.",
    )
    args = parser.parse_args()
    if args.replan:
        return replan(args.replan, args.out)
    links = {"fast": Link(args.fast, args.delay_ms), "slow": Link(args.slow, args.delay_ms)}
    shape = [
        f"--model.dim={args.dim}",
        f"--training.micro_batch_size={args.micro_batch_size}",
        f"--training.global_batch_size={4 * args.micro_batch_size}",
        f"--training.steps={args.steps}",
    ]
    jobs = {layout: [*MODEL, *shape, *LAYOUTS[layout], *ALL_OVERLAPS_ON] for layout in args.layouts}
    with tempfile.TemporaryDirectory(prefix="bandwidth-") as tmp:
        work = Path(tmp)
        os.environ["MEGASCALE_CACHE"] = str(work / "cache")  # this bench's calibration only
        measured, peak_tflops = calibration(args.calibration_rounds)
        figures = {"calibration_steal_fraction": measured["steal_fraction"]}
        print(f"calibration_steal_fraction {measured['steal_fraction']:.4g}", flush=True)
        figures_measured, setup, delay_emulated = measure(jobs, links, args.timeout, work)
    figures |= figures_measured
    cpu = plan_profiles.measured_profile(measured, 1, peak_tflops, "this bench's calibration")
    figures |= predict(jobs, cpu, links, delay_emulated)
    add_ratios_and_print(figures, jobs)
    setup |= {
        "links": {speed: dataclasses.asdict(link) for speed, link in links.items()},
        "jobs": jobs,
        "node_of_rank": NODE_OF_RANK,
        "warm_up_steps": WARM_UP_STEPS,
        "calibration": measured,
        "calibrated_peak_tflops": peak_tflops,
    }
    save_record(args.out, figures, setup)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
