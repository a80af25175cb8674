"""Float8 linear layers against bfloat16: the default model trained for 200 steps each way, validation loss.

`megascale train` on the embedded default corpus and model, bfloat16 autocast, for `--steps` steps with
validation every 50, then the same with `--training.fp8=tensorwise` and `--training.fp8=rowwise` (torchao's
float8 training, parallel/float8.py). Same seed, same batches, one process each, run one after the other.
Reports each run's final validation loss, its ratio to bfloat16's, the curves at every validation, and the
median compute time a step (metrics.jsonl's `compute_s`, wall time on a shared machine): on a CPU
`_scaled_mm` is no faster than a bfloat16 matmul, so the time says what float8 costs here, not what it
saves on a GPU.
Prints one `name value` line per figure and writes them all as JSON.

    python bench/fp8.py --out bench/results/fp8.json   # about 15 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.record, run as a script

from bench.record import save_record  # noqa: E402
from megascale.observe.metrics import read_metrics  # noqa: E402

RUNS = {
    "bf16": [],
    "fp8_tensorwise": ["--training.fp8=tensorwise"],
    "fp8_rowwise": ["--training.fp8=rowwise"],
}


def train(run_dir: Path, steps: int, extra: list[str]) -> list[dict]:
    command = [
        sys.executable,
        "-m",
        "megascale.cli",
        "train",
        "--training.dtype=bfloat16",
        "--training.compile=false",  # both eager, as the figures in docs/performance.md were measured
        f"--training.steps={steps}",
        "--training.val_every=50",
        "--training.log_every=1",
        "--checkpoint.enabled=false",
        "--metrics.progress=false",
        "--metrics.tensorboard=false",
        f"--training.run_dir={run_dir}",
        *extra,
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return read_metrics(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fp8.json")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    figures: dict[str, float] = {}
    curves: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in RUNS.items():
            records = train(Path(tmp) / name, args.steps, extra)
            curves[name] = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
            figures[f"{name}_val_loss"] = curves[name][max(curves[name])]
            compute = [r["compute_s"] for r in records if "compute_s" in r][5:]
            if compute:
                figures[f"{name}_compute_s_per_step"] = statistics.median(compute)
    for name in RUNS:
        if name != "bf16":
            figures[f"{name}_val_loss_over_bf16"] = figures[f"{name}_val_loss"] / figures["bf16_val_loss"]
    for name, value in figures.items():
        print(f"{name} {value:.4f}")
    save_record(args.out, {**figures, "val_loss_curves": curves}, {"steps": args.steps, "runs": RUNS})


if __name__ == "__main__":
    main()
