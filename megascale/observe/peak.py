"""Device peak FLOP/s for MFU: a table of known accelerators, or a measured peak, never a guess.

MFU is only as honest as its denominator. Known accelerators come from their vendors' dense (no sparsity)
figures; anything else (this CPU included) needs `training.peak_tflops` or a peak measured once by
`megascale calibrate` (a square-matmul benchmark, cached per CPU, thread count, dtype and torch version),
and the MFU is then labelled as relative to a measured peak.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Dense peak TFLOP/s by (device-name substring, dtype). Sources: NVIDIA A100 datasheet (bf16 312, tf32 156),
# H100 SXM5 datasheet (bf16 989, tf32 494, fp8 1979), H800 SXM (same tensor cores as H100 SXM), H200
# datasheet (989, fp8 1979), HGX B200 at 1,000 W (bf16 2250, tf32 1100, fp8 4500: half of the sparse figures
# NVIDIA's Blackwell datasheet lists), GB200 NVL72's B200 at 1,200 W (2500, 1250, 5000), V100 SXM2 datasheet
# (fp16 tensor cores 125, fp32 15.7; no bf16). The float32 rows are the TF32 peaks where a device has TF32;
# megascale leaves TF32 off (torch's default), so a float32 run's MFU on these GPUs reads low.
PEAK_TFLOPS: dict[tuple[str, str], float] = {
    # A name is matched by substring in this order: GB200 before B200.
    ("A100", "bfloat16"): 312.0,
    ("A100", "float16"): 312.0,
    ("A100", "float32"): 156.0,
    ("H100", "bfloat16"): 989.0,
    ("H100", "float16"): 989.0,
    ("H100", "float32"): 494.0,
    ("H100", "float8"): 1979.0,
    ("H800", "bfloat16"): 989.0,
    ("H800", "float16"): 989.0,
    ("H800", "float32"): 494.0,
    ("H800", "float8"): 1979.0,
    ("H200", "bfloat16"): 989.0,
    ("H200", "float16"): 989.0,
    ("H200", "float32"): 494.0,
    ("H200", "float8"): 1979.0,
    ("GB200", "bfloat16"): 2500.0,
    ("GB200", "float16"): 2500.0,
    ("GB200", "float32"): 1250.0,
    ("GB200", "float8"): 5000.0,
    ("B200", "bfloat16"): 2250.0,
    ("B200", "float16"): 2250.0,
    ("B200", "float32"): 1100.0,
    ("B200", "float8"): 4500.0,
    ("V100", "float16"): 125.0,
    ("V100", "float32"): 15.7,
}


@dataclass(frozen=True)
class Peak:
    """A peak in TFLOP/s and where it came from ('table', 'config' or 'measured')."""

    tflops: float
    source: str


def device_name(device: torch.device) -> str:
    if device.type == "cuda":  # device-generic naming has no portable API yet; guarded by the type check
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_cache() -> Path:
    return Path(os.environ.get("MEGASCALE_CACHE", "~/.cache/megascale")).expanduser() / "calibrate.json"


def _cache_key(dtype: str, threads: int) -> str:
    return f"{cpu_model()}|threads={threads}|{dtype}|torch={torch.__version__}"


def measure_matmul_tflops(dtype: str, threads: int, size: int = 2048, seconds: float = 2.0) -> float:
    """Best achieved TFLOP/s of repeated size x size matmuls in `dtype` on `threads` CPU threads."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch_dtype = getattr(torch, dtype)
        a = torch.randn(size, size).to(torch_dtype)
        b = torch.randn(size, size).to(torch_dtype)
        torch.mm(a, b)  # warm-up: first call selects kernels
        best_s = float("inf")
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            torch.mm(a, b)
            best_s = min(best_s, time.perf_counter() - started)
        return 2 * size**3 / best_s / 1e12
    finally:
        torch.set_num_threads(previous_threads)


def calibrate(dtype: str, threads: int, force: bool = False) -> float:
    """The measured CPU matmul peak, from the cache or measured now and cached."""
    cached = None if force else cached_calibration(dtype, threads)
    if cached is not None:
        return cached
    tflops = measure_matmul_tflops(dtype, threads)
    store_calibration(dtype, threads, tflops)
    return tflops


def _update_cache(change: Callable[[dict[str, float]], object]) -> None:
    path = calibration_cache()
    cache = json.loads(path.read_text()) if path.is_file() else {}
    change(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(cache, indent=2))
    os.replace(temporary, path)


def store_calibration(dtype: str, threads: int, tflops: float) -> None:
    _update_cache(lambda cache: cache.__setitem__(_cache_key(dtype, threads), tflops))


def forget_calibration(dtype: str, threads: int) -> None:
    """Drop a cached peak (a run computed faster than it): the next run that needs it measures it."""
    _update_cache(lambda cache: cache.pop(_cache_key(dtype, threads), None))


def cached_calibration(dtype: str, threads: int) -> float | None:
    path = calibration_cache()
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(_cache_key(dtype, threads))


def peak_for(device: torch.device, dtype: str, threads: int, configured_tflops: float | None) -> Peak | None:
    """The peak to divide by: the config's, the table's, or the cached measurement; None if unknown."""
    if configured_tflops is not None:
        return Peak(configured_tflops, "config")
    name = device_name(device)
    for (needle, table_dtype), tflops in PEAK_TFLOPS.items():
        if needle in name and table_dtype == dtype:
            return Peak(tflops, "table")
    if device.type == "cpu":
        measured = cached_calibration(dtype, threads)
        if measured is not None:
            return Peak(measured, "measured")
    return None
