"""Sliding-window attention scales linearly in sequence length at fixed W; full causal attention does not.

Times forward + backward of `causal_attention` (batch 1, 8 heads, head_dim 64, fp32, CPU) at W = 256 and
without a window, for seq = 1024 ... 8192, and reports time(8192) / time(1024): 8 is linear, 64 quadratic.
Prints one `name value` line per figure and writes them all as JSON.

    python bench/attention_window.py --out bench/results/attention_window.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from megascale.models.attention import causal_attention

SEQS = (1024, 2048, 4096, 8192)
WINDOW = 256
HEADS, HEAD_DIM = 8, 64


def step_time_ms(seq: int, window: int | None, repeats: int) -> float:
    """Median wall time of one forward + backward, after one untimed warm-up."""
    generator = torch.Generator().manual_seed(0)
    shape = (1, HEADS, seq, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=generator, requires_grad=True) for _ in range(3))
    upstream = torch.randn(shape, generator=generator)
    times_ms = []
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        torch.autograd.grad(causal_attention(q, k, v, window), (q, k, v), upstream)
        if attempt:
            times_ms.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times_ms)


def run(repeats: int) -> dict[str, float]:
    results: dict[str, float] = {}
    for label, window in ((f"swa_w{WINDOW}", WINDOW), ("causal", None)):
        for seq in SEQS:
            results[f"{label}_seq{seq}_ms"] = step_time_ms(seq, window, repeats)
        results[f"{label}_ratio_seq{SEQS[-1]}_over_seq{SEQS[0]}"] = (
            results[f"{label}_seq{SEQS[-1]}_ms"] / results[f"{label}_seq{SEQS[0]}_ms"]
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(__file__).parent / "results" / "attention_window.json"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per point (median reported)")
    args = parser.parse_args()
    results = run(args.repeats)
    for name, value in results.items():
        sys.stdout.write(f"{name} {value:.1f}\n" if name.endswith("_ms") else f"{name} {value:.2f}\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "window": WINDOW,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "batch": 1,
        "dtype": "float32",
        "repeats": args.repeats,
    }
    args.out.write_text(json.dumps({"config": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
