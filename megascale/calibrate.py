"""This machine's profile for the cost model, measured by `megascale calibrate` and never guessed.

Beyond the matmul peak (`megascale.observe.peak`), the planner needs what a CPU run is actually bound by at
the small sizes it can train: how fast a small GEMM runs compared with the peak, the memory rate of
element-wise work whose results are fresh memory (`fresh_memory_bytes_per_s`), the host's time to dispatch
one block's forward and backward and the rest of the model's (eager PyTorch waits for every operator), the
same for the step's update (gradient norm, clipping, optimizer step: with DTensor weights it costs as much
as several blocks' forward), what tensor parallelism's DTensor dispatch and FSDP's hooks add to each, what
tensor parallelism adds per byte of activations (its block probe again at the size of the runs a CPU trains:
its transfers and copies take the cores that compute, so they are measured rather than counted as bytes over
a bandwidth), and gloo's latency and bandwidth between two local processes. The figures are written next to
the peak (`profile_cache()`); plan/profiles.py, which the planner reads, makes the CPU profile of them.

Times are medians of repeated calls, as a training loop sees them. Everything is measured in fresh processes,
as the runs it predicts start fresh: in a process that has already allocated and freed much memory, the memory
probe's results reuse memory already faulted in (reading up to 2.5x the machine's rate). On a machine shared
with other work the figures still move with that work, and so do the predictions made from them: one
calibration ran 7-30% slower than the runs after it. So the measurement is made in ROUNDS rounds, one after
the other (each a process for the single-process probes and a pair for the two-process ones, about 30 s), and
every figure is the median over the rounds: a slow spell over one round does not move it. On a virtual machine
the hypervisor also gives time to other guests (steal time, observe/cpu_load.py), so a round that lost more
than 5% of the time to it is made again, up to MAX_ROUNDS rounds in all, and the least disturbed are kept and
their median `steal_fraction` reported.

`megascale calibrate` prints each figure with its unit and what it is (`describe_figures`), then the cache
files the planner and the MFU read them from.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megascale.config import AttentionConfig, ModelConfig, OverlapConfig
from megascale.errors import MeasurementError
from megascale.models.llama import Transformer
from megascale.observe.cpu_load import cpu_times, least_disturbed, steal_fraction
from megascale.optim.clip import clip_by_global_norm
from megascale.plan.profiles import (
    SIZED_SHAPE,
    SMALL_GEMM,
    TINY_SHAPE,
    cache_key,
    profile_cache,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PROBE_LAYERS = (1, 4)  # per-block host time is the slope between these depths (the runs train 2-4)
PROBE_FLOATS = 1 << 20  # gloo bandwidth probe: a 4 MB tensor
MEMORY_FLOATS = 1 << 23  # memory probe: two 32 MB tensors added into a fresh third
PR_SET_THP_DISABLE, PR_GET_THP_DISABLE = 41, 42  # Linux prctl(2) options
ROUNDS = 3  # rounds of measurement, each in fresh processes; every figure is the median over the rounds
# A round during which the hypervisor took more than QUIET_STEAL of the CPU time is made again, up to
# MAX_ROUNDS rounds in all, and the ROUNDS least disturbed kept.
QUIET_STEAL = 0.05
MAX_ROUNDS = 5


def typical_seconds(fn: Callable[[], object], calls: int) -> float:
    """The time of one call as a loop that calls it over and over sees it (`typical_seconds_each`)."""
    return typical_seconds_each([fn], calls)[0]


def typical_seconds_each(fns: list[Callable[[], object]], calls: int) -> list[float]:
    """Each function's typical call: the median of `calls` timed calls, after a warm-up, the functions
    taking turns so that a slow or fast spell of the machine falls on all of them alike (the probes'
    per-block slopes are differences between them). A burst of other work that slows fewer than half of
    the calls does not move a median.

    Not the fastest calls: two processes that wake each other through gloo for every collective spread
    their call times over 2x (tenth to ninetieth percentile) on a quiet machine, and the training loop
    runs at their typical pace: the median of the quietest of three rounds, one function after the other,
    predicts tp2 x pp2 2-22% short where the median of all calls is 0-2% short."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(calls):
        for fn, taken in zip(fns, times):
            started = time.perf_counter()
            fn()
            taken.append(time.perf_counter() - started)
    return [statistics.median(taken) for taken in times]


def _probe_model(layers: int, shape: tuple[int, int, int] = TINY_SHAPE) -> ModelConfig:
    dim, seq, _ = shape
    heads = max(2, dim // 32)
    return ModelConfig(
        dim=dim,
        n_layers=layers,
        vocab_size=64,
        max_seq_len=seq,
        attention=AttentionConfig(n_heads=heads, n_kv_heads=heads),
    )


def _fwd_bwd(model: torch.nn.Module, shape: tuple[int, int, int] = TINY_SHAPE) -> Callable[[], None]:
    _, seq, batch = shape
    tokens = torch.randint(0, 64, (batch, seq))

    def run() -> None:
        logits = model(tokens)
        logits = logits.to_local() if hasattr(logits, "to_local") else logits
        logits.float().mean().backward()

    return run


def _update(model: torch.nn.Module, shape: tuple[int, int, int] = TINY_SHAPE) -> Callable[[], None]:
    """The trainer's per-step update after the gradients exist (`Trainer.clip_gradients`, then the fused
    AdamW step): the global norm (an all-reduce when the gradients are DTensors), clipping, the step."""
    _fwd_bwd(model, shape)()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-9, fused=True)

    def run() -> None:
        clip_by_global_norm(params, 1.0)
        optimizer.step()

    return run


def host_seconds(
    wrap: Callable[[torch.nn.Module], None] = lambda model: None, calls: int = 15, sized: bool = False
) -> dict[str, float]:
    """Host seconds of a tiny model, after `wrap` (TP, FSDP) is applied, as a slope per block and what the
    rest of the model (embedding, final norm, output layer) adds: of a forward + backward ("block",
    "model") and of the step's update ("update_block", "update_model"); with `sized`, also a forward +
    backward's slope per block at SIZED_SHAPE ("sized_block"), compute included."""
    probes: list[Callable[[], object]] = []
    kinds = [(_fwd_bwd, TINY_SHAPE), (_update, TINY_SHAPE)] + ([(_fwd_bwd, SIZED_SHAPE)] if sized else [])
    for probe, shape in kinds:
        for layers in PROBE_LAYERS:
            torch.manual_seed(0)
            model = Transformer(_probe_model(layers, shape))
            wrap(model)
            probes.append(probe(model, shape))
    seconds = typical_seconds_each(probes, calls)
    result = {}
    for prefix, shallow, deep in (("", seconds[0], seconds[1]), ("update_", seconds[2], seconds[3])):
        result[f"{prefix}block"] = _per_block(shallow, deep)
        result[f"{prefix}model"] = max(0.0, shallow - result[f"{prefix}block"] * PROBE_LAYERS[0])
    if sized:
        result["sized_block"] = _per_block(*seconds[4:6])
    return result


def _per_block(shallow_s: float, deep_s: float) -> float:
    """Seconds per block: the slope between the probes at the two PROBE_LAYERS depths."""
    return max(0.0, (deep_s - shallow_s) / (PROBE_LAYERS[1] - PROBE_LAYERS[0]))


def measure_local() -> dict[str, float]:
    """Single-process measurements: small-GEMM rate, fresh-memory bandwidth, per-block host time (run in
    a fresh interpreter by `measure_round`)."""
    m, k, n = SMALL_GEMM
    inputs = torch.randn(m, k, requires_grad=True)
    weight = torch.randn(n, k, requires_grad=True)

    def linear_forward_backward() -> None:  # a linear layer's three GEMMs, as autograd runs them
        torch.nn.functional.linear(inputs, weight).sum().backward()

    small_gemm_s = typical_seconds(linear_forward_backward, calls=500)
    memory_bytes_per_s, fresh_pages = fresh_memory_bytes_per_s()
    return {
        "small_gemm_flops_per_s": 3 * 2 * m * k * n / small_gemm_s,
        "memory_bytes_per_s": memory_bytes_per_s,
        "memory_fresh_page_fraction": fresh_pages,  # reported, not used
        **{f"{name}_host_s": seconds for name, seconds in host_seconds(sized=True).items()},
    }


def fresh_memory_bytes_per_s(calls: int = 20) -> tuple[float, float]:
    """Bytes per second of an add whose 32 MB result is fresh memory, faulted in 4 KB pages; and the share
    of the result's pages that each call faulted in (1.0 when it measured what it means to).

    The trainer's element-wise operators allocate their results too, a few hundred KB each: on this
    machine's test model about 2,500 page faults a step. At that rate (about 6e9 B/s on one thread, a
    quarter of the same add into a result it already has) the model's element-wise terms come out as a
    profile of the step has them, within a few ms. But where the kernel backs large mappings with 2 MB
    pages (transparent huge pages "always"), a fresh 32 MB result takes 16 faults instead of 8,192: the
    probe read 1.2e10 here (likely also the 4.9e10 of one CI run), while the trainer's step did not
    change (0.044 s; its results are too small for huge pages), so every layout was predicted short. The
    probe therefore turns huge pages off for this process (prctl PR_SET_THP_DISABLE, Linux) while it runs."""
    big, other = torch.randn(MEMORY_FLOATS), torch.randn(MEMORY_FLOATS)
    with small_pages():
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        add_s = typical_seconds(lambda: torch.add(big, other), calls=calls)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    result_pages = MEMORY_FLOATS * 4 / resource.getpagesize()
    return 3 * MEMORY_FLOATS * 4 / add_s, faults / ((calls + 1) * result_pages)  # + 1: the warm-up


@contextmanager
def small_pages() -> Iterator[None]:
    """Transparent huge pages off for this process while inside, then as they were (nothing changes
    where prctl has no such option: not Linux, or a kernel before 3.15)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
    previous = prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) if prctl else -1
    if not prctl or previous < 0 or prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        yield
        return
    try:
        yield
    finally:
        prctl(PR_SET_THP_DISABLE, previous, 0, 0, 0)


def rank_main(rank: str, workdir: str, threads: str) -> None:
    """A measuring process (run in its own interpreter by `measure_round`, which passes its arguments as
    text), which writes its figures to `workdir`: rank "local" takes the single-process measurements; ranks
    "0" and "1" the two-process ones, meeting through a file there."""
    torch.set_num_threads(int(threads))
    if rank == "local":
        measured = measure_local()
    else:
        measured = in_two_rank_group(int(rank), os.path.join(workdir, "init"), _measure_gloo)
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(measured))


def in_two_rank_group(rank: int, init_file: str, measure: Callable[[], dict[str, float]]) -> dict[str, float]:
    """`measure()` as rank `rank` of a gloo group of two, met through `init_file`.

    The models a probe parallelises hold collective work in reference cycles (DTensor's and FSDP's hooks),
    so they outlive the probe until a garbage collection. They are collected here, while the group is
    alive: collected at the interpreter's exit, after the group was gone, they aborted a rank ('terminate
    called without an active exception') in 8 of 20 runs of the TP probe alone, and `megascale calibrate`
    failed with it."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    try:
        measured = measure()
        gc.collect()
    finally:
        dist.destroy_process_group()
    return measured


def tensor_parallel(mesh: DeviceMesh) -> Callable[[torch.nn.Module], None]:
    """What the TP probes apply to a model: the trainer's tensor parallelism over `mesh`, with sequence
    parallelism and the default overlap, as a run without flags has them."""
    from megascale.models import sharding
    from megascale.parallel.tensor import apply_tensor_parallel

    overlap = OverlapConfig()

    def apply(model: torch.nn.Module) -> None:
        apply_tensor_parallel(
            model,
            mesh,
            blocks=sharding.BLOCKS,
            block_plan=sharding.BLOCK_PLAN,
            top_level_plan=sharding.TOP_LEVEL_PLAN,
            sequence_parallel=True,
            overlap_chunks=overlap.tp_chunks if overlap.tp else None,
        )

    return apply


def _measure_gloo() -> dict[str, float]:
    """Both ranks run this in step: collectives' latency and bandwidth, and TP's and FSDP's host time."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from megascale.models import sharding
    from megascale.parallel.data import apply_fsdp

    one, two = torch.ones(1), torch.empty(2)
    shard, full = torch.ones(PROBE_FLOATS // 2), torch.empty(PROBE_FLOATS)
    latency_s = typical_seconds(lambda: dist.all_gather_single(two, one), calls=30)
    gather_s = typical_seconds(lambda: dist.all_gather_single(full, shard), calls=9)
    scatter_s = typical_seconds(lambda: dist.reduce_scatter_single(shard, full), calls=9)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    overlap = OverlapConfig()  # the trainer's default overlaps, as a run without flags has them
    tp_host = host_seconds(tensor_parallel(mesh), calls=24, sized=True)
    fsdp_host = host_seconds(
        lambda model: apply_fsdp(model, mesh, blocks=sharding.BLOCKS, zero_stage=3, overlap=overlap.dp),
        calls=24,
    )
    half_bytes = PROBE_FLOATS * 4 / 2  # what a ring over 2 ranks moves per rank: (n - 1)/n of the tensor
    return {
        "collective_latency_s": latency_s,
        "gather_bytes_per_s": half_bytes / max(gather_s - latency_s, 1e-9),
        "scatter_bytes_per_s": half_bytes / max(scatter_s - latency_s, 1e-9),
        **{f"tp_{name}_host_s": seconds for name, seconds in tp_host.items()},
        **{f"fsdp_{name}_host_s": seconds for name, seconds in fsdp_host.items()},
    }


# A round's processes take 10-30 s on a quiet 2-core machine; this bounds a hang, not a busy machine.
PROBE_TIMEOUT_S = 300.0


def measure_round(threads: int) -> dict[str, float]:
    """One round of measurement: a fresh process takes the single-process figures, then a pair of fresh
    processes the two-process ones (rank 0's); and the share of the CPU time the hypervisor took."""
    before = cpu_times()
    measured: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as workdir:
        for ranks in (["local"], (0, 1)):
            run_ranks(
                "import sys; from megascale.calibrate import rank_main; rank_main(*sys.argv[1:])",
                [workdir, str(threads)],
                PROBE_TIMEOUT_S,
                ranks,
            )
            measured |= json.loads(Path(workdir, f"rank{ranks[0]}.json").read_text())
    measured["steal_fraction"] = steal_fraction(before, cpu_times())
    return measured


def run_ranks(code: str, args: list[str], timeout_s: float, ranks: Sequence[int | str] = (0, 1)) -> None:
    """`python -c code RANK *args` for each of `ranks`, each a fresh interpreter (a child forked from a
    parent that ran multi-threaded kernels can hang in its first one). All are killed by pid if they
    outlive `timeout_s`; a rank that fails raises with the exit codes and what the ranks printed."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in ranks
    ]
    try:
        errors = [proc.communicate(timeout=timeout_s)[1] for proc in procs]
    except subprocess.TimeoutExpired as err:
        raise MeasurementError(
            f"calibrate: a measuring process ran past {timeout_s:.0f} s (the machine is busy, or the probe "
            "hung); nothing was cached: run `megascale calibrate` again when the machine is quieter"
        ) from err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = [proc.returncode for proc in procs]
    if any(codes):
        printed = "".join(errors)[-2000:]
        raise RuntimeError(f"calibrate: a measuring process failed (exit codes {codes}):\n{printed}")


def calibrate_profile(threads: int) -> dict[str, float]:
    """Measure everything the CPU profile needs with `threads` threads per process, and cache it."""
    rounds, _ = least_disturbed(
        lambda: measure_round(threads), lambda each: each["steal_fraction"], ROUNDS, MAX_ROUNDS, QUIET_STEAL
    )
    measured = {name: statistics.median(each[name] for each in rounds) for name in rounds[0]}
    path = profile_cache()
    cache = json.loads(path.read_text()) if path.is_file() else {}
    cache[cache_key(threads)] = measured
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache, indent=2))
    return measured


# What each figure of `calibrate_profile` is: its unit, and what it measures and feeds (plan/profiles.py).
_HOST = {
    "block": "per transformer block of a tiny model's forward + backward (the host dispatching operators)",
    "model": "of the rest of a tiny model (embedding, final norm, output layer) in a forward + backward",
    "update_block": "per block of the step's update (gradient norm, clipping, fused AdamW)",
    "update_model": "of the rest of the model in the step's update",
    "sized_block": "per block of a forward + backward at the size CPU runs train (256 tokens of hidden 128), "
    "compute included",
}
FIGURES: dict[str, tuple[str, str]] = {
    "small_gemm_flops_per_s": (
        "FLOP/s",
        "a small linear layer's forward + backward (256 x 128 x 384): how far below the peak the GEMMs of "
        "CPU-sized models run",
    ),
    "memory_bytes_per_s": ("B/s", "an add into fresh memory: the rate of the step's element-wise work"),
    "memory_fresh_page_fraction": (
        "fraction",
        "of the memory probe's result pages faulted in fresh (1 = measured as meant; reported, not used)",
    ),
    **{f"{name}_host_s": ("s", f"host time {meaning}") for name, meaning in _HOST.items()},
    **{
        f"{probe}_{name}_host_s": ("s", f"host time {meaning}, under {label} over 2 processes")
        for probe, label in (("tp", "tensor parallelism"), ("fsdp", "FSDP"))
        for name, meaning in _HOST.items()
        if name != "sized_block" or probe == "tp"
    },
    "collective_latency_s": (
        "s",
        "a one-element all-gather between 2 gloo processes: a collective's latency",
    ),
    "gather_bytes_per_s": ("B/s", "each rank's share of a 4 MB all-gather over 2 processes, latency removed"),
    "scatter_bytes_per_s": (
        "B/s",
        "each rank's share of a 4 MB reduce-scatter over 2 processes, latency removed",
    ),
    "steal_fraction": (
        "fraction",
        "of the CPU time the hypervisor gave other guests during the rounds kept (0 on bare metal)",
    ),
}


def describe_peaks(threads: int, peaks: dict[str, float]) -> list[str]:
    """The start of `megascale calibrate`'s report: what its figures are, and the matmul peaks. Every figure
    is a line `cpu_<name> <value>  <unit>: <what it is>` (the first two fields for scripts)."""
    header = (
        f"this CPU with {threads} thread(s) a process, each figure the median of {ROUNDS} rounds in fresh "
        "processes: the peaks are what MFU divides by (unless training.peak_tflops is set), the rest the CPU "
        "profile megascale plan predicts step times from (plan/profiles.py)"
    )
    return [header] + [
        f"cpu_matmul_peak_{dtype}_tflops {tflops:.4f}  TFLOP/s: a large {dtype} matmul, this CPU's peak"
        for dtype, tflops in peaks.items()
    ]


def describe_measured(measured: dict[str, float]) -> list[str]:
    """The rest of the report: each figure of `calibrate_profile` with its unit and what it is."""
    lines = []
    for name, value in measured.items():
        unit, meaning = FIGURES.get(name, ("", ""))
        lines.append(f"cpu_{name} {value:.4g}  {unit}: {meaning}" if unit else f"cpu_{name} {value:.4g}")
    return lines
