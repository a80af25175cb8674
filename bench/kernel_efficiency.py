"""What the planner's compute terms assume, measured on a device: a GEMM's fraction of peak by its size,
causal attention's, and an MoE layer's time against its expert GEMMs' at the planner's MoE shapes.

1. Dense GEMMs: the three GEMMs of a linear layer [tokens, k] x [k, n]'s forward and backward, for square
   and transformer-like shapes; each one's achieved FLOP/s over the device's peak (`observe/peak.py`).
   The planner's curve e(f) = gemm_efficiency x f / (f + gemm_half_flops) is fitted to these points by
   least squares in log space and printed beside them.
2. Causal attention (`F.scaled_dot_product_attention`, the kernel the device picks), forward + backward at
   sequence 8192, head size 128, 4 and 32 heads: the planner's attention efficiency, its FLOPs counted as
   `megascale.plan.compute` counts them (the two score matmuls over the keys a causal query sees, the
   backward twice the forward).
3. MoE layers (megascale's `models/moe.py`, forward + backward), at the work one device does in the
   layouts of MegaScale-MoE's Table 3 (tests/plan/published/megascale-moe-table3.toml; Internal-352B:
   dim 4096, experts of 14336, top-3):
   - `ep8`: one MegaScale-MoE rank's share, 1,024 tokens routed over its 4 experts (768 slots each);
   - `tp8`: one Megatron-LM tensor-parallel rank's, 8,192 tokens over 32 experts of 1,792 (1/8 each);
   for each: the whole layer (router, sort, gather, grouped GEMMs, scatter), its grouped GEMMs alone on
   the same sorted slots, and their ratio: what the layer's other operators add to its GEMMs.
Wall time between synchronisations on an accelerator (median of --repeats), the process's CPU time on a
CPU; prints one `name value` line per figure and writes them all as JSON.

    python bench/kernel_efficiency.py --device cuda --out gpu-kernels.json
    python bench/kernel_efficiency.py --scale 8 --out cpu-kernels.json   (every dimension / 8, on this CPU)
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.record, run as a script

from bench.record import save_record  # noqa: E402
from megascale.config import load_config
from megascale.models.moe import MoE, grouped_mlp, training_step
from megascale.observe.peak import device_name, peak_for
from megascale.plan.compute import keys_per_query

# (tokens, in, out) of a linear layer: square, then Internal-352B-like and smaller transformer shapes.
DENSE_SHAPES = [
    (512, 512, 512),
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (256, 1024, 4096),
    (8192, 4096, 512),
    *[(tokens, 4096, n_out) for tokens in (768, 1024, 2048, 4096, 8192) for n_out in (1792, 4096, 14336)],
]
# (sequence, heads, head size) of causal attention: one tensor- or sequence-parallel rank's share of the
# Internal-352B's 32 heads over 8 ranks, and all of them.
ATTENTION_SHAPES = [(8192, 4, 128), (8192, 32, 128)]
# (name, tokens, experts, expert hidden) at dim 4096, top-3.
MOE_SHAPES = [("ep8", 1024, 4, 14336), ("tp8", 8192, 32, 1792)]
DIM, TOP_K = 4096, 3
BATCH_S = 0.05


def timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    """Median seconds of one call of a callable over `repeats` timings after a warm-up. On an accelerator
    each timing runs it back to back for at least BATCH_S between synchronisations, as a training step's
    host runs ahead of the device, so a small kernel's launch is not counted as its time."""
    on_cpu = device.type == "cpu"
    clock = time.process_time if on_cpu else time.perf_counter

    def timed(work: Callable[[], object], calls: int) -> float:
        if not on_cpu:
            torch.accelerator.synchronize()
        started = clock()
        for _ in range(calls):
            work()
        if not on_cpu:
            torch.accelerator.synchronize()
        return (clock() - started) / calls

    def measure(work: Callable[[], object]) -> float:
        once = timed(work, 1)  # warm-up
        calls = 1 if on_cpu else max(1, math.ceil(BATCH_S / max(once, 1e-6)))
        return statistics.median(timed(work, calls) for _ in range(repeats))

    return measure


def linear_gemms(x: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
    """The three GEMMs of x @ w's forward and backward (output, input gradient, weight gradient), without
    autograd, whose per-call host work would outlast a small GEMM."""
    grad = torch.ones(x.shape[0], w.shape[1], device=x.device, dtype=x.dtype)
    out, grad_x, grad_w = torch.empty_like(grad), torch.empty_like(x), torch.empty_like(w)

    def gemms() -> None:
        torch.mm(x, w, out=out)
        torch.mm(grad, w.t(), out=grad_x)
        torch.mm(x.t(), grad, out=grad_w)

    return gemms


def dense_points(scale: int, device: torch.device, dtype: torch.dtype, measure) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of each GEMM: forward + backward of a linear layer, counted as three GEMMs."""
    points = []
    for tokens, n_in, n_out in DENSE_SHAPES:
        tokens, n_in, n_out = tokens // scale, n_in // scale, n_out // scale
        x = torch.randn(tokens, n_in, device=device, dtype=dtype)
        w = torch.randn(n_in, n_out, device=device, dtype=dtype)
        points.append((2.0 * tokens * n_in * n_out, measure(linear_gemms(x, w)) / 3))
    return points


def fit_curve(points: list[tuple[float, float]], peak: float) -> tuple[float, float]:
    """(e_max, f_half) of e(f) = e_max f / (f + f_half) closest to the points' efficiencies in log space,
    by a grid over f_half with e_max solved for each."""
    best = (math.inf, 0.0, 0.0)
    for exponent in range(60, 131):
        half = 10 ** (exponent / 10)
        logs = [
            math.log(flops / seconds / peak) - math.log(flops / (flops + half)) for flops, seconds in points
        ]
        e_max = math.exp(sum(logs) / len(logs))
        error = sum((value - math.log(e_max)) ** 2 for value in logs)
        best = min(best, (error, e_max, half))
    return best[1], best[2]


def attention_efficiency(
    scale: int, device: torch.device, dtype: torch.dtype, measure, peak_flops: float
) -> dict[str, float]:
    """Each attention shape's forward + backward over peak, counting 3 x the forward's score matmuls."""
    results = {}
    for seq, heads, head_dim in ATTENTION_SHAPES:
        seq, head_dim = seq // scale, max(8, head_dim // scale)
        q, k, v = (
            torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        seconds = measure(backward_of(functools.partial(causal_attention, k=k, v=v), q))
        flops = 3 * 4 * seq * keys_per_query(seq, None) * heads * head_dim
        results[f"attention_{seq}x{heads}x{head_dim}_efficiency"] = flops / seconds / peak_flops
    return results


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def backward_of(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], object]:
    return lambda: function(x).square().mean().backward()


def expert_weights(layer: MoE) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    experts = layer.experts
    return experts.w1, experts.w3, experts.w2


def moe_ratios(scale: int, device: torch.device, dtype: torch.dtype, measure) -> dict[str, float]:
    """Each MoE shape's whole layer and its grouped GEMMs alone, forward + backward."""
    results: dict[str, float] = {}
    for name, tokens, experts, hidden in MOE_SHAPES:
        dim, tokens, hidden = DIM // scale, tokens // scale, hidden // scale
        overrides = [f"--model.dim={dim}", f"--model.moe.experts={experts}", f"--model.moe.top_k={TOP_K}"]
        cfg = load_config(None, [*overrides, f"--model.moe.expert_dim={hidden}"]).model
        torch.manual_seed(0)
        layer = MoE(cfg)
        for param in layer.parameters():
            torch.nn.init.normal_(param, std=0.02)
        layer.to(device, dtype)
        x = torch.randn(1, tokens, dim, device=device, dtype=dtype, requires_grad=True)
        counts = torch.full((experts,), tokens * TOP_K // experts, device=device)
        slots = torch.randn(tokens * TOP_K, dim, device=device, dtype=dtype, requires_grad=True)
        with training_step():
            layer_s = measure(backward_of(layer, x))
        w1, w3, w2 = expert_weights(layer)
        gemms_s = measure(
            backward_of(functools.partial(grouped_mlp, counts=counts, w1=w1, w3=w3, w2=w2), slots)
        )
        flops = 3 * 2 * 3 * tokens * TOP_K * dim * hidden  # three projections, forward + backward
        results |= {
            f"moe_{name}_layer_ms": 1e3 * layer_s,
            f"moe_{name}_expert_gemms_ms": 1e3 * gemms_s,
            f"moe_{name}_layer_over_gemms": layer_s / gemms_s,
            f"moe_{name}_expert_gemm_tflops": flops / gemms_s / 1e12,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "kernel_efficiency.json"
    )
    parser.add_argument("--device", default="cpu", help="'cpu', 'cuda', ...")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats of each (median)")
    parser.add_argument("--scale", type=int, default=1, help="divide every dimension by this (CPU runs)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    peak = peak_for(device, args.dtype, args.threads, None)
    if peak is None:
        sys.exit(f"no peak for {device_name(device)} in {args.dtype}: run `megascale calibrate` first")
    peak_flops = peak.tflops * 1e12
    measure = timer(device, args.repeats)
    points = dense_points(args.scale, device, dtype, measure)
    results: dict[str, float] = {}
    for (tokens, n_in, n_out), (flops, seconds) in zip(DENSE_SHAPES, points):
        results[f"gemm_{tokens // args.scale}x{n_in // args.scale}x{n_out // args.scale}_efficiency"] = (
            flops / seconds / peak_flops
        )
    e_max, half = fit_curve(points, peak_flops)
    results |= {"fitted_gemm_efficiency": e_max, "fitted_gemm_half_flops": half}
    results |= attention_efficiency(args.scale, device, dtype, measure, peak_flops)
    results |= moe_ratios(args.scale, device, dtype, measure)
    for name, value in results.items():
        sys.stdout.write(f"{name} {value:.4g}\n")
    setup = {
        "device": device_name(device),
        "peak_tflops": peak.tflops,
        "dtype": args.dtype,
        "scale": args.scale,
        "repeats": args.repeats,
    }
    save_record(args.out, results, setup)


if __name__ == "__main__":
    main()
