"""Float8 GEMMs and float8 linear layers against bfloat16 on one device: what the planner's float8 terms
assume (`plan/compute.py`: a block's linear GEMMs at `float8_gemm_efficiency` of the bf16 curve's fraction
of the float8 peak, plus casting each layer's input, weight and output gradient as memory traffic).

1. GEMMs: the three GEMMs of a linear layer [tokens, in] x [in, out]'s forward and backward, at shapes of
   published float8 runs (Llama 3 8B unsharded, Llama 3 70B at tp4, GPT-3 175B at tp4), each in bfloat16
   (`torch.mm`) and in float8 (`torch._scaled_mm`, e4m3 operands and e5m2 gradients, per-tensor and
   per-row scales, bfloat16 output: the cuBLAS kernels torchao and Transformer Engine call). Prints each
   one's fraction of its peak and the float8 / bfloat16 rate, beside the planner's `gemm_seconds`.
2. Layers: one bias-free linear layer's forward + backward at the same shapes, `nn.Linear` in bfloat16
   against torchao's `Float8Linear` (per-tensor and per-row scaling, megascale's `training.fp8`), eager
   and compiled: what float8 saves once its amax and cast kernels are paid, against the planner's
   prediction (its float8 GEMMs plus the layer's `float8_cast_bytes` at the HBM bandwidth).
Wall time between synchronisations on an accelerator (median of --repeats, each timing at least 50 ms of
back-to-back calls), process CPU time on a CPU; prints one `name value` line per figure, writes JSON.

    python bench/fp8_linear.py --device cuda --out fp8-linear.json
    python bench/fp8_linear.py --scale 16 --parts gemm --out cpu-fp8.json   (every dimension / 16)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.record, run as a script

from bench import kernel_efficiency  # noqa: E402
from bench.record import save_record  # noqa: E402
from megascale.observe.peak import device_name, peak_for  # noqa: E402
from megascale.plan.compute import float8_cast_bytes, gemm_seconds, linear_gemms_seconds  # noqa: E402
from megascale.plan.hardware import PROFILES, HardwareProfile  # noqa: E402

# (name, tokens, in, out): a block's linear layers in published float8 runs at sequence 8192 (2048 for
# GPT-3), one micro-batch, one tensor-parallel rank's share.
SHAPES = [
    ("llama8b_qkv", 8192, 4096, 6144),
    ("llama8b_up_gate", 8192, 4096, 28672),
    ("llama8b_down", 8192, 14336, 4096),
    ("llama70b_tp4_qkv", 8192, 8192, 2560),
    ("llama70b_tp4_out", 8192, 2048, 8192),
    ("llama70b_tp4_up_gate", 8192, 8192, 14336),
    ("llama70b_tp4_down", 8192, 7168, 8192),
    ("gpt175b_tp4_fc1", 2048, 12288, 12288),
]


def timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    """kernel_efficiency's timer, after one more warm-up call: a compiled layer compiles and autotunes."""
    measure = kernel_efficiency.timer(device, repeats)

    def warmed(work: Callable[[], object]) -> float:
        work()
        return measure(work)

    return warmed


def planner_profile(device: torch.device) -> HardwareProfile:
    """The planner's profile of this device (its GEMM curve and peaks); the H100's where it has none."""
    name = device_name(device).upper()
    return next((profile for key, profile in PROFILES.items() if key.upper() in name), PROFILES["h100"])


def peak_flops(device: torch.device, dtype: str) -> float:
    """The device's dense peak in `dtype` (FLOP/s), nan where the peak table has none."""
    peak = peak_for(device, dtype, torch.get_num_threads(), None)
    return peak.tflops * 1e12 if peak is not None else float("nan")


def to_float8(x: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` scaled into `dtype`'s range, per tensor or per row, and the float32 scale that undoes it."""
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    scale = torch.finfo(dtype).max / amax.float().clamp(min=1e-12)
    return (x.float() * scale).to(dtype), scale.reciprocal()


def gemm_figures(device: torch.device, scale: int, measure: Callable, figures: dict) -> None:
    """Each shape's forward, input-gradient and weight-gradient GEMM in bfloat16 and float8."""
    profile = planner_profile(device)
    bf16_peak, fp8_peak = peak_flops(device, "bfloat16"), peak_flops(device, "float8")
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    for name, tokens, n_in, n_out in SHAPES:
        tokens, n_in, n_out = tokens // scale, n_in // scale, n_out // scale
        # (m, k, n, the left operand's float8 type): forward x @ w.T, then dgrad dy @ w, wgrad dy.T @ x.
        for gemm, (m, k, n, left) in {
            "fwd": (tokens, n_in, n_out, e4m3),
            "dgrad": (tokens, n_out, n_in, e5m2),
            "wgrad": (n_out, tokens, n_in, e5m2),
        }.items():
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            b = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()  # column-major, as cuBLAS wants
            flops = 2 * m * k * n
            bf16_s = measure(lambda a=a, b=b: torch.mm(a, b))
            key = f"{name}.{gemm}"
            figures[f"gemm.{key}.bf16_fraction"] = flops / bf16_s / bf16_peak
            figures[f"gemm.{key}.planned_bf16_fraction"] = (
                flops / gemm_seconds(m, k, n, profile, "bfloat16") / bf16_peak
            )
            for recipe, rowwise in (("tensorwise", False), ("rowwise", True)):
                a8, sa = to_float8(a, left, rowwise)
                b8, sb = to_float8(b.t(), e4m3, rowwise)  # per output column of b: rows of b.T
                b8, sb = b8.t(), sb.t() if rowwise else sb
                if rowwise and left == e5m2:
                    continue  # cuBLAS's per-row scaling takes e4m3 operands only
                try:
                    fp8_s = measure(
                        lambda a8=a8, b8=b8, sa=sa, sb=sb: torch._scaled_mm(
                            a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16
                        )
                    )
                except RuntimeError as error:  # a device or torch without this kernel
                    figures[f"gemm.{key}.fp8_{recipe}_error"] = str(error).splitlines()[0][:120]
                    continue
                figures[f"gemm.{key}.fp8_{recipe}_fraction"] = flops / fp8_s / fp8_peak
                figures[f"gemm.{key}.fp8_{recipe}_speedup"] = bf16_s / fp8_s
            figures[f"gemm.{key}.planned_fp8_speedup"] = gemm_seconds(
                m, k, n, profile, "bfloat16"
            ) / gemm_seconds(m, k, n, profile, "float8")


def layer_figures(device: torch.device, scale: int, measure: Callable, compiled: bool, figures: dict) -> None:
    """One linear layer's forward + backward: nn.Linear in bfloat16 against torchao's Float8Linear."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    profile = planner_profile(device)
    for name, tokens, n_in, n_out in SHAPES:
        tokens, n_in, n_out = tokens // scale, n_in // scale, n_out // scale
        x = torch.randn(tokens, n_in, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(tokens, n_out, device=device, dtype=torch.bfloat16)
        times = {}
        for recipe in ("bf16", "tensorwise", "rowwise"):
            layer = torch.nn.Linear(n_in, n_out, bias=False, device=device, dtype=torch.bfloat16)
            if recipe != "bf16":
                layer = convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
            if compiled:  # a fresh cache: every Float8Linear shares one forward, whose recompiles are capped
                torch._dynamo.reset()
            run = torch.compile(layer) if compiled else layer

            def step(run=run, layer=layer, x=x, grad=grad) -> None:
                run(x).backward(grad)
                x.grad = None
                layer.weight.grad = None

            try:
                times[recipe] = measure(step)
            except Exception as error:  # noqa: BLE001 - a recipe this torch or device cannot run
                figures[f"layer.{name}.{recipe}.error"] = str(error).splitlines()[0][:120]
        mode = "compiled" if compiled else "eager"
        for recipe in ("tensorwise", "rowwise"):
            if recipe in times and "bf16" in times:
                figures[f"layer.{mode}.{name}.{recipe}_speedup"] = times["bf16"] / times[recipe]
        bf16_s = linear_gemms_seconds([(n_in, n_out)], tokens, profile, "bfloat16")
        fp8_s = linear_gemms_seconds([(n_in, n_out)], tokens, profile, "float8")
        cast_s = float8_cast_bytes(tokens, n_in, n_out) / profile.hbm_bytes_per_s
        figures[f"layer.{mode}.{name}.planned_speedup"] = bf16_s / (fp8_s + cast_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=str(torch.accelerator.current_accelerator() or "cpu"))
    parser.add_argument("--scale", type=int, default=1, help="divide every dimension by this")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parts", default="gemm,eager,compiled", help="any of gemm, eager, compiled")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fp8_linear.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    measure = timer(device, args.repeats)
    figures: dict = {}
    parts = args.parts.split(",")
    if "gemm" in parts:
        gemm_figures(device, args.scale, measure, figures)
    for mode in ("eager", "compiled"):
        if mode in parts:
            layer_figures(device, args.scale, measure, mode == "compiled", figures)
    for name, value in figures.items():
        print(name, f"{value:.3f}" if isinstance(value, float) else value, flush=True)
    setup = {
        "device": device_name(device),
        "planner_profile": planner_profile(device).name,
        "scale": args.scale,
    }
    save_record(args.out, figures, setup | {"repeats": args.repeats, "parts": args.parts})


if __name__ == "__main__":
    main()
