"""Training throughput and MFU of megascale's Trainer against Hugging Face's same-shape LlamaForCausalLM.

For each model (configs/default.toml, configs/llama-50m.toml) and each dtype (float32, bfloat16 autocast with
float32 weights), one process builds megascale's real `Trainer` and a `LlamaForCausalLM` with the same
hidden, intermediate, layer, head, kv-head and vocab sizes (SDPA attention, untied output). Hugging Face's
side is a plain loop doing the same work per step: the same micro-batches (gradient accumulation), the same
autocast, AdamW with the same hyperparameters, `clip_grad_norm_` with the same max norm, `zero_grad`. After
warm-up, timed steps alternate between the two (ours, HF, HF, ours, ...) so machine noise hits both alike;
tokens/s come from median step times, and the ratio is the median of the back-to-back pairs' ratios.
MFU is model FLOPs per second (megascale.models.flops) over this CPU's measured matmul peak
(`megascale calibrate`), or on an accelerator over its vendor dense peak; on CUDA each side's step peak
memory above the resident state is reported too. Prints one `name value` line per figure (progress goes
to stderr) and writes them all, with the machine, as JSON.

    python bench/throughput.py --out bench/results/throughput.json
    python bench/throughput.py --device cuda --compile --hf-fused --models 1b --dtypes bfloat16 \
        --set data.source=corpus.txt --out bench/results/throughput-h100.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import transformers

from megascale.config import JobConfig, ModelConfig, load_config
from megascale.models.feed_forward import ffn_dim_of
from megascale.models.flops import flops_per_token, num_params
from megascale.observe.peak import calibrate, cpu_model, device_name, peak_for
from megascale.trainer import Trainer

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
# Model name -> (config file, overrides). The byte tokenizer's 257 ids fit the 50M model's 32000-entry
# embedding; compute does not depend on token values, and it spares training a 32k BPE.
MODELS = {
    "default": ("default.toml", []),
    "50m": ("llama-50m.toml", ["--data.tokenizer=byte"]),
    # The GPU checklist's ~1B Llama: dim 2048, 16 layers, 16 query / 8 key-value heads, sequences of 2048.
    "1b": (
        "llama-50m.toml",
        [
            "--data.tokenizer=byte",
            "--model.dim=2048",
            "--model.n_layers=16",
            "--model.attention.n_heads=16",
            "--model.attention.n_kv_heads=8",
            "--model.max_seq_len=2048",
            "--data.seq_len=2048",
            "--training.global_batch_size=8",
            "--training.micro_batch_size=8",
        ],
    ),
}
DTYPE_LABELS = {"float32": "fp32", "bfloat16": "bf16"}

log = logging.getLogger("bench.throughput")


def build_trainer(model: str, dtype: str, bench: argparse.Namespace, run_dir: str) -> Trainer:
    """megascale's Trainer for `model` in `dtype`, writing nothing but its log into `run_dir`."""
    config_file, extra = MODELS[model]
    overrides = [
        f"--training.run_dir={run_dir}",
        f"--training.dtype={dtype}",
        f"--training.threads={bench.threads}",
        f"--training.device={bench.device}",
        f"--training.compile={str(bench.compile).lower()}",
        "--checkpoint.enabled=false",
        "--checkpoint.resume=false",
        "--metrics.progress=false",
        "--metrics.tensorboard=false",
        "--metrics.jsonl=false",
        *extra,
        *(f"--{override}" for override in bench.set),
    ]
    return Trainer(load_config(CONFIG_DIR / config_file, overrides))


def hf_config(model: ModelConfig) -> transformers.LlamaConfig:
    """The Hugging Face Llama of the same shape as `model` (which must use the Llama options)."""
    return transformers.LlamaConfig(
        vocab_size=model.vocab_size,
        hidden_size=model.dim,
        intermediate_size=ffn_dim_of(model),
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.attention.n_heads,
        num_key_value_heads=model.attention.n_kv_heads,
        max_position_embeddings=model.max_seq_len,
        rms_norm_eps=model.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": model.attention.rope_theta},
        tie_word_embeddings=False,
        use_cache=False,  # training: no key/value cache
        attn_implementation="sdpa",
    )


class HFLoop:
    """A plain training loop around LlamaForCausalLM doing the same work per step as `Trainer.train_step`."""

    def __init__(self, cfg: JobConfig, device: torch.device, compile_model: bool, fused: bool):
        training, optim = cfg.training, cfg.optim
        torch.manual_seed(training.seed)
        self.device = device
        self.model = transformers.LlamaForCausalLM(hf_config(cfg.model)).to(device)
        self.model.train()
        hf_params = sum(p.numel() for p in self.model.parameters())
        if hf_params != num_params(cfg.model):
            raise RuntimeError(f"HF model has {hf_params:,} parameters, megascale {num_params(cfg.model):,}")
        # The same two groups as megascale.optim.param_groups: no weight decay on norm gains.
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        # torch's default implementation (foreach), as a plain loop has it, or fused as megascale's.
        self.optimizer = torch.optim.AdamW(
            groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, fused=fused or None
        )
        self.forward = torch.compile(self.model) if compile_model else self.model
        self.max_grad_norm = optim.grad_clip
        self.autocast_dtype = torch.bfloat16 if training.dtype == "bfloat16" else None
        generator = torch.Generator().manual_seed(training.seed)
        shape = (training.micro_batch_size, cfg.data.seq_len)
        accumulation = training.global_batch_size // training.micro_batch_size
        self.micro_batches = [
            torch.randint(cfg.model.vocab_size, shape, generator=generator).to(device)
            for _ in range(accumulation)
        ]

    def train_step(self) -> float:
        """One optimizer step over all micro-batches; returns its wall time in seconds."""
        started = time.perf_counter()
        total_loss = torch.zeros((), device=self.device)
        for tokens in self.micro_batches:
            with self._autocast():
                loss = self.forward(input_ids=tokens, labels=tokens).loss / len(self.micro_batches)
            loss.backward()
            total_loss += loss.detach()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss.item()  # waits for the device
        return time.perf_counter() - started

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def alternate(
    timers: dict[str, Callable[[], float]], warmup: int, steps: int, case: str
) -> dict[str, list[float]]:
    """Run the timers in turn (A, B, B, A, ...: neither always runs right after the other); return the
    times of the steps after warm-up, per timer."""
    times_s: dict[str, list[float]] = {name: [] for name in timers}
    for step in range(warmup + steps):
        order = list(timers) if step % 2 == 0 else list(reversed(timers))
        for name in order:
            elapsed_s = timers[name]()
            if step >= warmup:
                times_s[name].append(elapsed_s)
            log.info("%s step %d/%d %s %.3f s", case, step + 1, warmup + steps, name, elapsed_s)
    return times_s


class StepMemory:
    """On CUDA: each timer's largest step peak above the memory held when its step began (activations and
    transients; the weights and optimizer state of both models stay resident throughout)."""

    def __init__(self, device: torch.device):
        self.on_cuda = device.type == "cuda"  # torch.cuda only behind this check
        self.peak_gib: dict[str, float] = {}

    def wrap(self, name: str, timer: Callable[[], float]) -> Callable[[], float]:
        if not self.on_cuda:
            return timer

        def timed() -> float:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
            elapsed_s = timer()
            above = (torch.cuda.max_memory_allocated() - held) / 2**30
            self.peak_gib[name] = max(self.peak_gib.get(name, 0.0), above)
            return elapsed_s

        return timed


def peak_tflops_of(device: torch.device, dtype: str, threads: int) -> float:
    """The MFU denominator: a known accelerator's vendor figure, else this CPU's measured matmul peak."""
    if device.type == "cpu":
        return calibrate(dtype, threads)
    peak = peak_for(device, dtype, threads, None)
    if peak is None:
        raise SystemExit(f"no peak FLOP/s known for {device_name(device)} in {dtype}")
    return peak.tflops


def measure(model: str, dtype: str, bench: argparse.Namespace) -> dict[str, Any]:
    """Median step times of megascale's Trainer and the HF loop, measured alternately in one process."""
    case = f"{model}_{DTYPE_LABELS[dtype]}"
    with tempfile.TemporaryDirectory(prefix="megascale-bench-") as run_dir:
        trainer = build_trainer(model, dtype, bench, run_dir)
        cfg = trainer.cfg
        hf = HFLoop(cfg, trainer.device, bench.compile, bench.hf_fused)
        memory = StepMemory(trainer.device)
        timers = {
            "megascale": memory.wrap("megascale", lambda: trainer.train_step().step_time_s),
            "hf": memory.wrap("hf", hf.train_step),
        }
        times_s = alternate(timers, bench.warmup, bench.steps, case)
        device = trainer.device
        trainer.close()
    tokens_per_step = cfg.training.global_batch_size * cfg.data.seq_len
    flops = flops_per_token(cfg.model, cfg.data.seq_len)
    peak_tflops = peak_tflops_of(device, dtype, bench.threads)
    figures: dict[str, float] = {}
    for name, samples in times_s.items():
        tokens_per_s = tokens_per_step / statistics.median(samples)
        figures[f"{case}_{name}_tokens_per_s"] = tokens_per_s
        figures[f"{case}_{name}_mfu"] = tokens_per_s * flops / (peak_tflops * 1e12)
        if name in memory.peak_gib:
            figures[f"{case}_{name}_step_peak_gib"] = memory.peak_gib[name]
    # The ratio is the median over back-to-back pairs of steps (ours, HF): each pair sees the same machine
    # load, so slow drifts in the shared machine's speed cancel; the quartiles show how far noise moves it.
    pair_ratios = [hf_s / ours_s for ours_s, hf_s in zip(times_s["megascale"], times_s["hf"])]
    figures[f"{case}_ratio"] = statistics.median(pair_ratios)
    figures[f"{case}_ratio_of_medians"] = (
        figures[f"{case}_megascale_tokens_per_s"] / figures[f"{case}_hf_tokens_per_s"]
    )
    if len(pair_ratios) >= 2:
        figures[f"{case}_ratio_q1"], _, figures[f"{case}_ratio_q3"] = statistics.quantiles(pair_ratios, n=4)
    shape = {
        "params": num_params(cfg.model),
        "flops_per_token": flops,
        "global_batch_size": cfg.training.global_batch_size,
        "micro_batch_size": cfg.training.micro_batch_size,
        "seq_len": cfg.data.seq_len,
        "peak_tflops": peak_tflops,
    }
    return {"figures": figures, "shape": shape, "step_times_s": times_s}


def write_figure(name: str, value: float) -> None:
    """One `name value` line on stdout: rates to 0.1, ratios, MFUs and peaks to 3 decimals."""
    sys.stdout.write(f"{name} {value:.1f}\n" if name.endswith("tokens_per_s") else f"{name} {value:.3f}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(__file__).parent / "results" / "throughput.json"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per implementation and case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation and case")
    parser.add_argument("--models", default="default,50m", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated, of float32, bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for both")
    parser.add_argument("--device", default="cpu", help="'cpu', 'cuda', ... (training.device) for both")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument("--hf-fused", action="store_true", help="fused AdamW for Hugging Face's loop too")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for megascale, e.g. data.source=corpus",
    )
    args = parser.parse_args()
    models, dtypes = args.models.split(","), args.dtypes.split(",")
    for chosen, allowed in ((models, MODELS), (dtypes, DTYPE_LABELS)):
        unknown = [item for item in chosen if item not in allowed]
        if unknown:
            parser.error(f"unknown {unknown}; choose from {', '.join(allowed)}")
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="[%(asctime)s] %(message)s")
    torch.set_num_threads(args.threads)

    started_s = time.perf_counter()
    figures: dict[str, float] = {}
    cases: dict[str, Any] = {}
    device = torch.device(args.device)
    for dtype in dtypes:
        # The denominator of every MFU below: this CPU's matmul peak (measured once and cached), or the
        # accelerator's vendor figure.
        source = "measured" if device.type == "cpu" else "vendor"
        name = f"peak_{DTYPE_LABELS[dtype]}_{source}_tflops"
        figures[name] = peak_tflops_of(device, dtype, args.threads)
        write_figure(name, figures[name])
    for model in models:
        for dtype in dtypes:
            result = measure(model, dtype, args)
            cases[f"{model}_{DTYPE_LABELS[dtype]}"] = {
                "shape": result["shape"],
                "step_times_s": result["step_times_s"],
            }
            for name, value in result["figures"].items():
                figures[name] = value
                write_figure(name, value)
            sys.stdout.flush()
    log.info("done in %.0f s", time.perf_counter() - started_s)

    machine = {
        "cpu": cpu_model(),
        "device": device_name(device),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }
    settings = {
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "statistic": "tokens/s from median step times; ratio = median of back-to-back pair ratios",
        "mfu_relative_to": "measured CPU matmul peak (megascale calibrate), per dtype"
        if device.type == "cpu"
        else "the accelerator's vendor dense peak (megascale.observe.peak), per dtype",
        "compile": args.compile,
        "hf_fused_adamw": args.hf_fused,
        "overrides": args.set,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine, "settings": settings, "cases": cases, "results": figures}
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
