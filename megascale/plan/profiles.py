"""Hardware profiles by name: a datasheet's (hardware.py), or this CPU as `megascale calibrate` measured it
(calibrate.py runs the probes and writes `profile_cache()`, which this module only reads).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megascale.errors import ConfigError
from megascale.observe.peak import cached_calibration, calibration_cache, cpu_model
from megascale.plan.hardware import PROFILES, HardwareProfile

# The probes' shapes. (m, k, n) of the small-GEMM probe: a linear layer of the model bench/plan_accuracy.py
# trains on a CPU (256 tokens a micro-batch, hidden 128, three projections' width). (hidden, sequence,
# batch) of the host-time probes: a tiny model, where the host is all there is, and one of that bench's
# size (256 tokens of hidden 128), for what tensor parallelism adds per byte of activations.
SMALL_GEMM = (256, 128, 384)
TINY_SHAPE = (16, 8, 1)
SIZED_SHAPE = (SMALL_GEMM[1], 64, SMALL_GEMM[0] // 64)
# What `megascale calibrate` stores; a cache without one of them was written by an older version.
MEASURED = (
    *("small_gemm_flops_per_s", "memory_bytes_per_s", "collective_latency_s"),
    *("gather_bytes_per_s", "scatter_bytes_per_s", "sized_block_host_s", "tp_sized_block_host_s"),
    *(f"{probe}{name}_host_s" for probe in ("", "tp_", "fsdp_") for name in ("block", "model")),
    *(f"{probe}update_{name}_host_s" for probe in ("", "tp_", "fsdp_") for name in ("block", "model")),
)
# The profile's host-time fields by the probe's names: per block, rest of the model, and the same of the
# update.
PARTS = {"layer": "block", "model": "model", "update_layer": "update_block", "update_model": "update_model"}


def profile_cache() -> Path:
    return calibration_cache().with_name("plan-calibrate.json")


def cache_key(threads: int) -> str:
    return f"{cpu_model()}|threads={threads}|torch={torch.__version__}"


def activation_bytes(shape: tuple[int, int, int]) -> int:
    """Bytes of one block's input activations for a probe of `shape` (float32)."""
    dim, seq, batch = shape
    return 4 * dim * seq * batch


def profile_named(name: str, threads: int = 1) -> HardwareProfile:
    """A profile by name: a GPU's, or 'cpu' once `megascale calibrate` has measured this machine."""
    key = name.lower()
    if key == "cpu":
        return cpu_profile(threads)
    if key not in PROFILES:
        raise ConfigError(
            f"plan: --hardware {name!r} is unknown; choose one of {', '.join([*PROFILES, 'cpu'])}"
        )
    return PROFILES[key]


def cpu_profile(threads: int = 1) -> HardwareProfile:
    """This CPU as a profile, from the cached measurements; an error if they are missing."""
    path = profile_cache()
    measured = json.loads(path.read_text()).get(cache_key(threads)) if path.is_file() else None
    peak_tflops = cached_calibration("float32", threads)
    if measured is None or peak_tflops is None:
        raise ConfigError(
            f"plan: --hardware cpu needs this machine measured with {threads} thread(s); run "
            f"`megascale calibrate --dtype float32 --threads {threads}` first"
        )
    missing = [name for name in MEASURED if name not in measured]
    if missing:
        raise ConfigError(
            f"plan: the calibration in {path} predates {', '.join(missing)}; run "
            f"`megascale calibrate --dtype float32 --threads {threads}` again"
        )
    return measured_profile(measured, threads, peak_tflops, f"measured by `megascale calibrate` ({path})")


def measured_profile(
    measured: dict[str, float], threads: int, peak_tflops: float, source: str
) -> HardwareProfile:
    """The CPU profile from `megascale calibrate`'s figures (`measured`) and matmul peak."""
    peak = peak_tflops * 1e12
    small_flops = 2 * SMALL_GEMM[0] * SMALL_GEMM[1] * SMALL_GEMM[2]
    small_efficiency = min(measured["small_gemm_flops_per_s"] / peak, 0.999)
    gather, scatter = measured["gather_bytes_per_s"], measured["scatter_bytes_per_s"]
    latency = measured["collective_latency_s"]
    cores = os.cpu_count() or 1
    return HardwareProfile(
        name=f"{cpu_model()} ({threads} thread(s) per process, measured)",
        peak_tflops={"float32": peak_tflops},
        hbm_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),  # shared by all processes
        hbm_bytes_per_s=measured["memory_bytes_per_s"],
        intra_node_bytes_per_s=2 / (1 / gather + 1 / scatter),  # FSDP runs gathers and scatters alike
        inter_node_bytes_per_s=2 / (1 / gather + 1 / scatter),
        intra_node_latency_s=latency,
        inter_node_latency_s=latency,
        devices_per_node=1024,  # every process of a local run is on this host
        nodes_per_pod=1,
        gemm_efficiency=1.0,  # the peak is itself a (large) GEMM's measured rate
        gemm_half_flops=small_flops * (1 / small_efficiency - 1),
        attention_efficiency=small_efficiency,  # timed like a small GEMM: a few % of these runs' FLOPs
        attention_half_flops=0.0,
        flash2_attention_speed=1.0,  # the one kernel the probes time
        grouped_gemm_efficiency=1.0,  # no MoE probe: an MoE layer is priced by its experts' GEMMs alone
        float8_gemm_efficiency=1.0,  # a CPU profile has no float8 peak
        moe_operator_overhead=0.0,
        network_efficiency=1.0,  # the bandwidths above are already what a collective achieved
        layer_overhead_s=measured["block_host_s"],  # the others: what TP and FSDP add to these
        tp_layer_overhead_s_per_byte=tp_overhead_per_byte(measured),
        tp_comm_measured=True,
        model_overhead_s=measured["model_host_s"],
        **{
            f"{kind}{part}_overhead_s": max(
                0.0, measured[f"{probe}_{name}_host_s"] - measured[f"{name}_host_s"]
            )
            for kind, probe in (("tp_", "tp"), ("dp_", "fsdp"))
            for part, name in PARTS.items()
        },
        update_layer_overhead_s=measured["update_block_host_s"],
        update_model_overhead_s=measured["update_model_host_s"],
        host_cores=max(1, cores // threads),
        source=source,
    )


def tp_overhead_per_byte(measured: dict[str, float]) -> float:
    """Seconds per byte of a micro-batch's activations that tensor parallelism adds to a block beyond half its
    compute: the TP probe's per-block growth from the tiny to the sized shape, less half the plain probe's
    (its transfers and copies take the cores that compute; docs/planning.md, 'Checked on this machine')."""
    grown = measured["tp_sized_block_host_s"] - measured["tp_block_host_s"]
    compute = (measured["sized_block_host_s"] - measured["block_host_s"]) / 2
    return max(0.0, grown - compute) / (activation_bytes(SIZED_SHAPE) - activation_bytes(TINY_SHAPE))
