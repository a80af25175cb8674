"""The MoE layer's grouped-GEMM compute against a loop over experts and against a dense layer of equal active
FLOPs, side by side in one process.

Times forward + backward of one feed-forward layer on the same tokens, in turns (one repeat of each kind,
then the next repeat), by the process's CPU time (on an accelerator: wall time between synchronisations),
and reports each kind's median, the tokens it passes per second, and the ratios:
- `grouped`: megascale's MoE layer (models/moe.py): token slots sorted by expert, one `torch._grouped_mm`
  per projection;
- `loop`: the same layer with its experts computed one at a time over the tokens routed to each (how
  Hugging Face's Mixtral computes them);
- `dense`: the dense SwiGLU layer whose hidden size is top_k x expert_dim, i.e. the FLOPs a token computes in
  the MoE layer's experts (the router's are left out).
Prints one `name value` line per figure and writes them all as JSON.

    python bench/moe.py --out bench/results/moe.json
    python bench/moe.py --device cuda --dtype bfloat16 --out gpu-moe.json  (wall time between syncs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from megascale.config import load_config
from megascale.models.feed_forward import FeedForward
from megascale.models.moe import MoE, training_step

DIM, EXPERTS, TOP_K, EXPERT_DIM = 256, 8, 2, 352
BATCH, SEQ = 16, 256


def loop_over_experts(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s output with each expert computed on its own tokens in a Python loop."""
    flat = x.reshape(-1, x.shape[-1])
    weights, chosen, _ = layer.router(flat)
    out = torch.zeros_like(flat)
    experts = layer.experts
    w3 = experts.w3
    assert w3 is not None  # a SwiGLU layer
    for e in range(layer.num_experts):
        tokens, slots = torch.where(chosen == e)
        if tokens.numel() == 0:
            continue
        hidden = F.silu(flat[tokens] @ experts.w1[e]) * (flat[tokens] @ w3[e])
        out.index_add_(0, tokens, (hidden @ experts.w2[e]) * weights[tokens, slots, None].to(out.dtype))
    return out.view_as(x)


def run(repeats: int, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    cfg = load_config(
        None,
        [
            f"--model.dim={DIM}",
            f"--model.moe.experts={EXPERTS}",
            f"--model.moe.top_k={TOP_K}",
            f"--model.moe.expert_dim={EXPERT_DIM}",
        ],
    ).model
    torch.manual_seed(0)
    moe = MoE(cfg)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.02)
    dense = FeedForward(cfg, hidden=TOP_K * EXPERT_DIM)
    moe.to(device, dtype)
    dense.to(device, dtype)
    x = torch.randn(BATCH, SEQ, DIM, device=device, dtype=dtype, requires_grad=True)
    kinds: dict[str, Callable[[], torch.Tensor]] = {
        "grouped": lambda: moe(x),
        "loop": lambda: loop_over_experts(moe, x),
        "dense": lambda: dense(x),
    }
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(kinds["grouped"](), kinds["loop"](), **tolerance)
    # CPU: the process's CPU time. An accelerator: wall time between synchronisations.
    on_cpu = device.type == "cpu"
    clock = time.process_time if on_cpu else time.perf_counter
    unit = "cpu_ms" if on_cpu else "ms"
    times_ms: dict[str, list[float]] = {kind: [] for kind in kinds}
    with training_step():
        for attempt in range(repeats + 1):
            for kind, forward in kinds.items():
                if not on_cpu:
                    torch.accelerator.synchronize()
                started = clock()
                forward().square().mean().backward()
                if not on_cpu:
                    torch.accelerator.synchronize()
                if attempt:  # the first round warms up
                    times_ms[kind].append(1e3 * (clock() - started))
    results = {f"{kind}_{unit}": statistics.median(times) for kind, times in times_ms.items()}
    rate = "tokens_per_cpu_s" if on_cpu else "tokens_per_s"  # forward + backward passes of the layer
    results |= {f"{kind}_{rate}": BATCH * SEQ / (results[f"{kind}_{unit}"] / 1e3) for kind in kinds}
    results["loop_over_grouped"] = results[f"loop_{unit}"] / results[f"grouped_{unit}"]
    results["grouped_over_dense"] = results[f"grouped_{unit}"] / results[f"dense_{unit}"]
    results["tokens"] = BATCH * SEQ
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "moe.json")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats of each kind (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="'cpu', 'cuda', ...")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="of the weights")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = run(args.repeats, torch.device(args.device), getattr(torch, args.dtype))
    for name, value in results.items():
        sys.stdout.write(f"{name} {value:.2f}\n")
    meta = {
        "threads": args.threads,
        "torch": torch.__version__,
        "dim": DIM,
        "experts": EXPERTS,
        "top_k": TOP_K,
        "expert_dim": EXPERT_DIM,
        "tokens": BATCH * SEQ,
        "dtype": args.dtype,
        "device": args.device,
        "repeats": args.repeats,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
