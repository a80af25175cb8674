"""MegaScale's communication overlap on an emulated cluster network: exposed communication and step time
with each overlap off and on, and all on, side by side in one run.

Two "nodes" (network namespaces, bench/netem.py): the links inside a node (loopback) and between the
nodes (a veth pair) are limited with `tc` (bandwidth and delay with netem; bandwidth only where the kernel
lacks netem, as in this project's VM). Seven layouts: dp2 x tp2 (data parallelism across the nodes) and
tp2 x pp2 interleaved (the pipeline across them), two ranks per node with tensor parallelism inside one;
and dp2, tp2, pp2 interleaved, ep2 (an MoE model's 4 experts split over the two nodes: the expert
all-to-all crosses them) and cp2 (every sequence split over the two nodes: the ring's keys and values
cross them), one rank per core. For every layout the job runs with all overlaps off,
with each one alone on, and with all on; the figures are the medians over the steps after warm-up of rank
0's step time and exposed communication (the timeline's `comm_exposed_s`: time the training thread waited
for collectives). Without root the ranks run on plain loopback, and the output says so.

Four ranks share two cores in the 3-D layouts. Left to Linux's scheduler, a rank waiting in a collective
lends its core to another rank, and waits in turn for a peer descheduled for someone else's time slice:
waits that are there on an unlimited network too and that no overlap hides. So by default each rank of a
layout with more ranks than cores gets a fixed share of them, cores/ranks of a core (a CFS bandwidth
cgroup of its own, bench/cpushare.py; `--no-cpu-shares` turns it off): an emulated device per rank, slower
than a core and idle while its rank waits, as a GPU is. The two-rank layouts have a core per rank. With
`--unlimited` every configuration also runs a second time right after, in the same namespaces without
limits, and the difference is what the emulated links cost: `network_exposed_s` (exposed communication)
and `network_step_s` (step time), each all on over all off as well.

Prints one `name value` line per figure and writes them as JSON.

    sudo python bench/overlap.py --out bench/results/overlap.json   # about 25 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.netem, run as a script

from bench import cpushare  # noqa: E402
from bench.netem import EmulatedNodes, Link  # noqa: E402
from bench.record import save_record  # noqa: E402
from megascale.config import OverlapConfig  # noqa: E402
from megascale.observe.cpu_load import CpuSampler  # noqa: E402
from megascale.observe.metrics import read_metrics  # noqa: E402
from megascale.resilience.executor import free_port  # noqa: E402

MODEL = [
    "--model.n_layers=4",
    "--model.attention.n_heads=8",
    "--model.attention.n_kv_heads=4",
    "--model.max_seq_len=256",
    "--data.seq_len=256",
    "--training.val_every=100000",
    "--training.log_every=1",
    "--training.threads=1",
    "--training.device=cpu",
    "--training.peak_tflops=1",
    "--checkpoint.enabled=false",
    "--metrics.progress=false",
    "--metrics.tensorboard=false",
]
LAYOUTS = {  # flags, the overlaps that apply, the node of each rank
    "dp2xtp2": (["--parallel.dp_shard=2", "--parallel.tp=2"], ("tp", "dp"), (0, 0, 1, 1)),
    "tp2xpp2": (
        [
            "--parallel.tp=2",
            "--parallel.pp=2",
            "--parallel.pp_schedule=interleaved_1f1b",
            "--parallel.pp_virtual_stages=2",
        ],
        ("tp", "pp"),
        (0, 0, 1, 1),
    ),
    # One rank per core: each overlap alone, without ranks waiting for a descheduled peer.
    "dp2": (["--parallel.dp_shard=2"], ("dp",), (0, 1)),
    "tp2": (["--parallel.tp=2"], ("tp",), (0, 0)),
    # An MoE model's experts split over the two nodes: half of every dispatch and combine crosses them.
    "ep2": (
        ["--parallel.dp_shard=2", "--parallel.ep=2", "--model.moe.experts=4", "--model.moe.top_k=2"],
        ("ep", "dp"),
        (0, 1),
    ),
    # Every sequence split over the two nodes: each ring step's keys and values cross them.
    "cp2": (["--parallel.dp_shard=2", "--parallel.cp=2"], ("cp", "dp"), (0, 1)),
    "pp2": (
        ["--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2"],
        ("pp",),
        (0, 1),
    ),
}
ALL = ("tp", "pp", "dp", "ep", "cp")


def configurations(switches: tuple[str, ...]) -> dict[str, dict[str, bool]]:
    """off, each relevant overlap alone, all on."""
    configs = {"off": dict.fromkeys(ALL, False)}
    for name in switches if len(switches) > 1 else ():
        configs[f"{name}_only"] = {key: key == name for key in ALL}
    configs["all"] = dict.fromkeys(ALL, True)
    return configs


def run_job(
    nodes: EmulatedNodes | None,
    run_dir: Path,
    args: list[str],
    timeout_s: float,
    node_of_rank: tuple[int, ...] = (0, 0, 1, 1),
    shares: cpushare.CpuShares | None = None,
) -> list[dict]:
    """One process per rank, on the node `node_of_rank` gives it (in its CPU share, if any); rank 0's
    metrics."""
    port = free_port("127.0.0.1")
    master = nodes.addresses[0] if nodes else "127.0.0.1"
    procs = []
    for rank, node in enumerate(node_of_rank):
        local = [other for other, its_node in enumerate(node_of_rank) if its_node == node]
        env = {
            **os.environ,
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(len(node_of_rank)),
            "LOCAL_RANK": str(local.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(local)),
        }
        command = [sys.executable, "-m", "megascale.cli", "train", *args, f"--training.run_dir={run_dir}"]
        if nodes is not None:
            env["GLOO_SOCKET_IFNAME"] = nodes.devices[node]
            procs.append(
                nodes.start(node, command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            )
        else:
            procs.append(
                subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            )
        if shares is not None:
            shares.add(rank, procs[-1].pid)
    try:
        for proc in procs:
            _, stderr = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"a rank exited with {proc.returncode}:\n{stderr.decode()[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return read_metrics(run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="Steps per run; the first 3 are warm-up.")
    parser.add_argument("--inside", default="1gbit:0.2", help="Link inside a node, RATE:DELAY_MS.")
    parser.add_argument("--between", default="200mbit:0.5", help="Link between the nodes, RATE:DELAY_MS.")
    parser.add_argument(
        "--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS), help="Layouts to run."
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=8,
        help="Sequences per micro-batch (the global batch is four of them): more computation against the "
        "same communication, since data-parallel traffic depends on the parameters, not on the tokens.",
    )
    parser.add_argument(
        "--dim",
        type=int,
        default=512,
        help="Model width: a tensor-parallel GEMM does dim/tp FLOP per byte its collectives move, so wider "
        "models leave more computation to hide the transfers behind.",
    )
    parser.add_argument(
        "--tp-chunks",
        type=int,
        default=OverlapConfig().tp_chunks,
        help="parallel.overlap.tp_chunks: sequence chunks a tensor-parallel GEMM is split into when "
        "overlap.tp is on; only the first chunk's all-gather and the last one's reduce-scatter stay exposed.",
    )
    parser.add_argument(
        "--zero-stage",
        type=int,
        default=1,
        choices=(1, 2, 3),
        help="parallel.zero_stage of the data-parallel layout. 1 (the default) is Megatron-LM's distributed "
        "optimizer, which MegaScale's runs use: one all-gather and one reduce-scatter a step; 3 is "
        "megascale's default, which reduce-scatters every micro-batch.",
    )
    parser.add_argument(
        "--unlimited",
        action="store_true",
        help="Run each configuration a second time on the same namespaces without link limits (twice as "
        "long), to tell the links' cost from the rest of the waits.",
    )
    parser.add_argument(
        "--no-cpu-shares",
        dest="cpu_shares",
        action="store_false",
        help="Let the ranks of a layout with more ranks than cores share the cores as Linux schedules them. "
        "By default each is capped at cores/ranks of a core (a cgroup of its own, bench/cpushare.py): a "
        "slower device per rank that idles while its rank waits, as a GPU does, instead of lending its core "
        "to another rank.",
    )
    parser.add_argument("--timeout", type=float, default=900, help="Seconds a run may take before it fails.")
    parser.add_argument("--out", type=Path, default=Path("bench/results/overlap.json"), help="JSON output.")
    args = parser.parse_args()
    inside, between = (
        Link(spec.split(":")[0], float(spec.split(":")[1])) for spec in (args.inside, args.between)
    )
    nodes = EmulatedNodes(str(os.getpid()), inside=inside, between=between)
    free = EmulatedNodes(f"{os.getpid()}u") if args.unlimited else None  # the same topology, no limits
    try:
        nodes.create()
        if free is not None:
            free.create()
        network = nodes.describe()
        print(f"# network: {network}", flush=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as err:
        for emulated in (nodes, free):
            if emulated is not None:
                emulated.remove()
        nodes = free = None
        print(f"# no emulated network (needs root and iproute2: {err}); the ranks run on plain loopback")
        network = "plain loopback (no root)"
    batch = [
        f"--training.micro_batch_size={args.micro_batch_size}",
        f"--training.global_batch_size={4 * args.micro_batch_size}",
        f"--parallel.zero_stage={args.zero_stage}",
        f"--model.dim={args.dim}",
        f"--parallel.overlap.tp_chunks={args.tp_chunks}",
    ]
    figures: dict[str, float] = {}
    cores = len(os.sched_getaffinity(0))
    created: dict[str, cpushare.CpuShares] = {}  # layout -> its ranks' shares
    if args.cpu_shares and (why := cpushare.available()):
        print(f"# no CPU shares ({why}); ranks share the cores as Linux schedules them", flush=True)
        args.cpu_shares = False
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for layout in args.layouts:
                flags, switches, node_of_rank = LAYOUTS[layout]
                shares = None
                if args.cpu_shares and len(node_of_rank) > cores:
                    shares = cpushare.CpuShares(f"{os.getpid()}{layout}", len(node_of_rank), cores)
                    created[layout] = shares
                    shares.create()
                    print(f"# {layout}: {shares.describe()}", flush=True)
                for config, overlaps in configurations(switches).items():
                    job = [*MODEL, *batch, *flags, f"--training.steps={args.steps}"]
                    job += [f"--parallel.overlap.{key}={str(on).lower()}" for key, on in overlaps.items()]
                    runs = {"": nodes, "_unlimited": free} if free is not None else {"": nodes}
                    for suffix, network_nodes in runs.items():
                        run_dir = Path(tmp) / f"{layout}-{config}{suffix}"
                        with CpuSampler() as sampler:
                            records = run_job(
                                network_nodes, run_dir, job, args.timeout, node_of_rank, shares
                            )[3:]
                        # bubble_s: waits for pipeline sends and receives, where the pipeline's traffic shows.
                        for key in ("step_time_s", "comm_exposed_s", "bubble_s"):
                            value = statistics.median(record[key] for record in records)
                            figures[f"{layout}_{config}{suffix}_{key}"] = round(value, 5)
                            print(f"{layout}_{config}{suffix}_{key} {value:.5f}", flush=True)
                        # What the hypervisor gave to other guests over the timed steps: it slows them alike.
                        steal = sampler.steal_over_steps(records)
                        figures[f"{layout}_{config}{suffix}_steal"] = round(steal, 4)
                        print(f"{layout}_{config}{suffix}_steal {steal:.4f}", flush=True)
                    if free is not None:
                        for name, key in (
                            ("network_exposed_s", "comm_exposed_s"),
                            ("network_step_s", "step_time_s"),
                        ):
                            cost = (
                                figures[f"{layout}_{config}_{key}"]
                                - figures[f"{layout}_{config}_unlimited_{key}"]
                            )
                            figures[f"{layout}_{config}_{name}"] = round(cost, 5)
                            print(f"{layout}_{config}_{name} {cost:.5f}", flush=True)
                keys = ["comm_exposed_s", "step_time_s"] + (["bubble_s"] if "pp" in switches else [])
                keys += ["network_exposed_s", "network_step_s"] if free is not None else []
                for key in keys:
                    ratio = figures[f"{layout}_all_{key}"] / figures[f"{layout}_off_{key}"]
                    figures[f"{layout}_all_over_off_{key}"] = round(ratio, 4)
                    print(f"{layout}_all_over_off_{key} {ratio:.4f}", flush=True)
    finally:
        for emulated in (nodes, free):  # first: it kills what is left of the ranks
            if emulated is not None:
                emulated.remove()
        for shares in created.values():
            shares.remove()
    setup = {
        "network": network,
        "unlimited_runs": free is not None,
        "cpu_shares": {layout: shares.describe() for layout, shares in created.items()},
        "model": [*MODEL, *batch],
        "steps": args.steps,
        "layouts": LAYOUTS,
    }
    save_record(args.out, figures, setup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
