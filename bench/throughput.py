"""Training throughput and MFU of megascale's Trainer against Hugging Face's same-shape LlamaForCausalLM.

For each model (configs/default.toml, configs/llama-50m.toml) and each dtype (float32, bfloat16 autocast with
float32 weights), megascale's real `Trainer` is built beside a `LlamaForCausalLM` with the same hidden,
intermediate, layer, head, kv-head and vocab sizes (SDPA attention, untied output). Hugging Face's side is
a plain loop doing the same work per step: the same micro-batches (gradient accumulation), the same
autocast, the same AdamW implementation (fused, as megascale's) with the same hyperparameters,
`clip_grad_norm_` with the same max norm, `zero_grad`. The plain loop runs eager and megascale as its defaults
run it: `training.compile` unset compiles its blocks where that was measured to win (a CPU bfloat16 run of
100 steps or more: megascale.autocompile), reported as `<case>_megascale_compiled`; `--eager` runs both
eager, `--compile` compiles both. After warm-up, timed steps alternate between the two
(ours, HF, HF, ours, ...) so machine noise hits both alike. With `--processes 2` (the default) each side
lives in a process of its own, spawned afresh, and the parent steps them in lockstep, one at a time:
megascale's Trainer changes its whole process on CPU, which a plain loop in its own process would not
have: it sets glibc's malloc (megascale.malloc), and its data-prefetch thread's OpenMP team makes libgomp's
waiting threads sleep almost at once instead of spinning. `--processes 1` builds both in this process, the
plain loop then inheriting both. Each step is timed twice: wall clock, and its process's CPU time
(`time.process_time`, every thread of the process: torch's intra-op threads are in-process), which other
work on a shared machine disturbs far less. tokens/s come from median wall times; each ratio (ours / HF
speed) is the median of the back-to-back pairs' ratios, with its quartiles.
MFU is model FLOPs per second (megascale.models.flops) over this CPU's measured matmul peak
(`megascale calibrate`), or on an accelerator over its vendor dense peak; on CUDA each side's step peak
memory above the resident state is reported too. Prints one `name value` line per figure (progress goes
to stderr) and writes them all, with the machine, as JSON.

    python bench/throughput.py --out bench/results/throughput.json
    python bench/throughput.py --device cuda --compile --models 1b --dtypes bfloat16 \
        --set data.source=corpus.txt --out bench/results/throughput-h100.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing
import transformers

from megascale.config import JobConfig, ModelConfig, load_config
from megascale.models.feed_forward import ffn_dim_of
from megascale.models.flops import flops_per_token, num_params
from megascale.observe.peak import calibrate, cpu_model, device_name, peak_for
from megascale.parallel.distributed import pick_device

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
SIDES = ("megascale", "hf")  # the order of the first step's pair
STOP_TIMEOUT_S = 30.0  # how long a side's process has to tear down and exit before it is killed

log = logging.getLogger("bench.throughput")


def job_config(model: str, dtype: str, bench: argparse.Namespace, run_dir: str | None = None) -> JobConfig:
    """megascale's config for `model` in `dtype`; a Trainer built from it writes nothing but its log, into
    `run_dir` (needed only to build one)."""
    config_file, extra = MODELS[model]
    overrides = [
        *([f"--training.run_dir={run_dir}"] if run_dir else []),
        f"--training.dtype={dtype}",
        f"--training.threads={bench.threads}",
        f"--training.device={bench.device}",
        # Unset unless asked: megascale's default compiles its blocks where that wins (megascale.autocompile).
        *([f"--training.compile={str(bench.compile).lower()}"] if bench.compile or bench.eager else []),
        "--checkpoint.enabled=false",
        "--checkpoint.resume=false",
        "--metrics.progress=false",
        "--metrics.tensorboard=false",
        "--metrics.jsonl=false",
        *extra,
        *(f"--{override}" for override in bench.set),
    ]
    return load_config(CONFIG_DIR / config_file, overrides)


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

    def __init__(self, cfg: JobConfig, device: torch.device, compile_model: bool, optimizer: str):
        training, optim = cfg.training, cfg.optim
        torch.manual_seed(training.seed)
        self.device = device
        self.model = transformers.LlamaForCausalLM(hf_config(cfg.model)).to(device)
        self.model.train()
        self.num_params = sum(p.numel() for p in self.model.parameters())
        # The same two groups as megascale.optim.param_groups: no weight decay on norm gains.
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        # Fused, as megascale's (megascale.optim.build_optimizer), unless the plain loop's default (foreach)
        # is asked for: the comparison is then of the steps, not of two AdamW implementations.
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            fused=True if optimizer == "fused" else None,
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
        """One optimizer step over all micro-batches; returns the mean loss."""
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
        return total_loss.item()  # waits for the device

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def timed(step: Callable[[], Any]) -> Callable[[], tuple[float, float]]:
    """`step` made to return its (wall, process CPU) seconds: the CPU time of every thread of this process."""

    def run() -> tuple[float, float]:
        wall_started, cpu_started = time.perf_counter(), time.process_time()
        step()
        return time.perf_counter() - wall_started, time.process_time() - cpu_started

    return run


def alternate(
    timers: dict[str, Callable[[], tuple[float, float]]], warmup: int, steps: int, case: str
) -> dict[str, dict[str, list[float]]]:
    """Run the timers in turn (A, B, B, A, ...: neither always runs right after the other); return the
    wall and CPU times of the steps after warm-up, per clock and timer."""
    times_s: dict[str, dict[str, list[float]]] = {
        clock: {name: [] for name in timers} for clock in ("wall", "cpu")
    }
    for step in range(warmup + steps):
        order = list(timers) if step % 2 == 0 else list(reversed(timers))
        for name in order:
            wall_s, cpu_s = timers[name]()
            if step >= warmup:
                times_s["wall"][name].append(wall_s)
                times_s["cpu"][name].append(cpu_s)
            log.info(
                "%s step %d/%d %s %.3f s (cpu %.3f s)", case, step + 1, warmup + steps, name, wall_s, cpu_s
            )
    return times_s


class StepMemory:
    """On CUDA: each timer's largest step peak above the memory held when its step began (activations and
    transients; the weights and optimizer state stay resident throughout)."""

    def __init__(self, device: torch.device):
        self.on_cuda = device.type == "cuda"  # torch.cuda only behind this check
        self.peak_gib: dict[str, float] = {}

    def wrap(self, name: str, timer: Callable[[], tuple[float, float]]) -> Callable[[], tuple[float, float]]:
        if not self.on_cuda:
            return timer

        def measured() -> tuple[float, float]:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
            wall_and_cpu_s = timer()
            above = (torch.cuda.max_memory_allocated() - held) / 2**30
            self.peak_gib[name] = max(self.peak_gib.get(name, 0.0), above)
            return wall_and_cpu_s

        return measured


def peak_tflops_of(device: torch.device, dtype: str, threads: int) -> float:
    """The MFU denominator: a known accelerator's vendor figure, else this CPU's measured matmul peak."""
    if device.type == "cpu":
        return calibrate(dtype, threads)
    peak = peak_for(device, dtype, threads, None)
    if peak is None:
        raise SystemExit(f"no peak FLOP/s known for {device_name(device)} in {dtype}")
    return peak.tflops


@contextlib.contextmanager
def built_side(side: str, model: str, dtype: str, bench: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """One side of a case, built: {"step": its training step, "device", "params" (the HF model's count;
    megascale's is `num_params` of its config), "malloc_keeps_freed_memory"}; closed on exit. Only
    megascale's side imports the Trainer, which sets the process's malloc on CPU."""
    with tempfile.TemporaryDirectory(prefix="megascale-bench-") as run_dir:
        cfg = job_config(model, dtype, bench, run_dir)
        if side == "hf":
            device = pick_device(cfg.training.device)
            hf = HFLoop(cfg, device, bench.compile, bench.hf_optimizer)
            yield {"step": hf.train_step, "device": device, "params": hf.num_params}
            return
        # Imported here, not at the top: a spawned HF side loads this module and must not load megascale's.
        from megascale.malloc import keep_freed_memory
        from megascale.trainer import Trainer

        trainer = Trainer(cfg)
        try:
            yield {
                "step": trainer.train_step,
                "device": trainer.device,
                "params": num_params(cfg.model),
                "compiled": trainer.compiled,
                # The Trainer has set it on CPU; setting it again only reports whether it took.
                "malloc_keeps_freed_memory": trainer.device.type == "cpu" and keep_freed_memory(),
            }
        finally:
            trainer.close()


def check_same_size(hf_params: int, ours_params: int) -> None:
    """Fail before any timing unless both models have the same parameter count."""
    if hf_params != ours_params:
        raise RuntimeError(f"HF model has {hf_params:,} parameters, megascale {ours_params:,}")


def measure_in_one_process(
    model: str, dtype: str, bench: argparse.Namespace, case: str, params: int
) -> dict[str, Any]:
    """Both sides built in this process (megascale's first: the HF loop inherits its malloc setting) and
    stepped alternately: {"times_s", "peak_gib", "device", "malloc_keeps_freed_memory"}."""
    with built_side("megascale", model, dtype, bench) as ours, built_side("hf", model, dtype, bench) as hf:
        check_same_size(hf["params"], params)
        memory = StepMemory(ours["device"])
        timers = {name: memory.wrap(name, timed(side["step"])) for name, side in zip(SIDES, (ours, hf))}
        times_s = alternate(timers, bench.warmup, bench.steps, case)
    keeps = ours["malloc_keeps_freed_memory"]
    return {
        "times_s": times_s,
        "peak_gib": memory.peak_gib,
        "device": ours["device"],
        "malloc_keeps_freed_memory": {"megascale": keeps, "hf": keeps},
        "compiled": ours["compiled"],
    }


def serve_side(conn: Connection, side: str, model: str, dtype: str, bench: argparse.Namespace) -> None:
    """The body of one side's process: build the side, answer ("ready", info), then time one step per
    "step" request, answering ("step", wall s, CPU s), until "stop", answered ("stopped", step peaks).
    Any failure is answered ("error", traceback). Exits when the parent is gone or silent too long."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="[%(asctime)s] %(message)s")
    torch.set_num_threads(bench.threads)
    try:
        with built_side(side, model, dtype, bench) as built:
            memory = StepMemory(built["device"])
            timer = memory.wrap(side, timed(built["step"]))
            info = {key: value for key, value in built.items() if key != "step"}
            conn.send(("ready", {**info, "device": str(built["device"])}))
            # The parent waits at most timeout_s for the other side between two requests to this one.
            while conn.poll(2 * bench.timeout_s + STOP_TIMEOUT_S):
                request = conn.recv()
                if request == "stop":
                    break
                conn.send(("step", *timer()))
            else:
                raise TimeoutError(
                    f"no request from the benchmark in {2 * bench.timeout_s + STOP_TIMEOUT_S} s"
                )
        conn.send(("stopped", memory.peak_gib))
    except EOFError:  # the parent is gone: nobody to answer
        raise SystemExit(1) from None
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None


class SideProcess:
    """One side of a case in a spawned process of its own (a fresh interpreter: it inherits no malloc
    setting, nor anything else process-wide, from this one or the other side), driven over a pipe. Every
    wait is bounded by `timeout_s`; `close` makes sure the process is gone."""

    def __init__(self, side: str, model: str, dtype: str, bench: argparse.Namespace):
        self.side, self.timeout_s = side, bench.timeout_s
        context = torch.multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=serve_side, args=(child_conn, side, model, dtype, bench), name=f"throughput-{side}"
        )
        self.process.start()
        child_conn.close()  # so that the child's death reads as end-of-file here

    def request(self, message: str | None, expected: str) -> Any:
        """Send `message` (None: nothing), wait for the answer named `expected` and return its payload."""
        if message is not None:
            with contextlib.suppress(ConnectionError):  # the process is gone: reported below
                self.conn.send(message)
        if not wait([self.conn, self.process.sentinel], timeout=self.timeout_s):
            raise TimeoutError(
                f"the {self.side} process did not answer {message or 'ready'} in {self.timeout_s} s"
            )
        try:
            name, *payload = self.conn.recv() if self.conn.poll() else ("exited",)
        except (EOFError, ConnectionError):
            name, payload = "exited", []
        if name == "error":
            raise RuntimeError(f"the {self.side} process failed:\n{payload[0]}")
        if name != expected:
            self.process.join(STOP_TIMEOUT_S)
            raise RuntimeError(
                f"the {self.side} process exited (code {self.process.exitcode}) before {expected}"
            )
        return payload[0] if len(payload) == 1 else tuple(payload)

    def close(self) -> None:
        """Hang up (a side waiting for a request then exits), wait for the process to exit, and kill it by
        its pid if it has not within STOP_TIMEOUT_S."""
        self.conn.close()
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            log.warning("killing the %s process (pid %d)", self.side, self.process.pid)
            self.process.kill()
            self.process.join(STOP_TIMEOUT_S)


def measure_in_two_processes(
    model: str, dtype: str, bench: argparse.Namespace, case: str, params: int
) -> dict[str, Any]:
    """Each side built in its own process, one after the other, then stepped in lockstep (only one side
    computes at a time): {"times_s", "peak_gib", "device", "malloc_keeps_freed_memory"}."""
    with contextlib.ExitStack() as stack:
        sides, infos = {}, {}
        for name in SIDES:
            sides[name] = SideProcess(name, model, dtype, bench)
            stack.callback(sides[name].close)
            infos[name] = sides[name].request(None, "ready")
        check_same_size(infos["hf"]["params"], params)
        timers = {name: lambda side=side: side.request("step", "step") for name, side in sides.items()}
        times_s = alternate(timers, bench.warmup, bench.steps, case)
        peak_gib: dict[str, float] = {}
        for side in sides.values():
            peak_gib.update(side.request("stop", "stopped"))
    return {
        "times_s": times_s,
        "peak_gib": peak_gib,
        "device": torch.device(infos["megascale"]["device"]),
        "malloc_keeps_freed_memory": {
            "megascale": infos["megascale"]["malloc_keeps_freed_memory"],
            "hf": False,
        },
        "compiled": infos["megascale"]["compiled"],
    }


def measure(model: str, dtype: str, bench: argparse.Namespace) -> dict[str, Any]:
    """Median step times of megascale's Trainer and the HF loop, measured alternately, and the figures."""
    case = f"{model}_{DTYPE_LABELS[dtype]}"
    cfg = job_config(model, dtype, bench)
    in_processes = measure_in_two_processes if bench.processes == 2 else measure_in_one_process
    measured = in_processes(model, dtype, bench, case, num_params(cfg.model))
    times_s, device = measured["times_s"], measured["device"]
    tokens_per_step = cfg.training.global_batch_size * cfg.data.seq_len
    flops = flops_per_token(cfg.model, cfg.data.seq_len)
    peak_tflops = peak_tflops_of(device, dtype, bench.threads)
    figures: dict[str, float] = {f"{case}_megascale_compiled": float(measured["compiled"])}
    for name, samples in times_s["wall"].items():
        tokens_per_s = tokens_per_step / statistics.median(samples)
        figures[f"{case}_{name}_tokens_per_s"] = tokens_per_s
        figures[f"{case}_{name}_mfu"] = tokens_per_s * flops / (peak_tflops * 1e12)
        figures[f"{case}_{name}_cpu_s"] = statistics.median(times_s["cpu"][name])
        if name in measured["peak_gib"]:
            figures[f"{case}_{name}_step_peak_gib"] = measured["peak_gib"][name]
    # Each ratio is the median over back-to-back pairs of steps (ours, HF): each pair sees the same machine
    # load, so slow drifts in the shared machine's speed cancel; the quartiles show how far noise moves it.
    for clock, prefix in (("cpu", "cpu_"), ("wall", "")):
        ours_s, hf_s = times_s[clock]["megascale"], times_s[clock]["hf"]
        pair_ratios = [theirs / ours for ours, theirs in zip(ours_s, hf_s)]
        figures[f"{case}_{prefix}ratio"] = statistics.median(pair_ratios)
        if len(pair_ratios) >= 2:
            quartiles = statistics.quantiles(pair_ratios, n=4)
            figures[f"{case}_{prefix}ratio_q1"] = quartiles[0]
            figures[f"{case}_{prefix}ratio_q3"] = quartiles[2]
    shape = {
        "params": num_params(cfg.model),
        "flops_per_token": flops,
        "global_batch_size": cfg.training.global_batch_size,
        "micro_batch_size": cfg.training.micro_batch_size,
        "seq_len": cfg.data.seq_len,
        "peak_tflops": peak_tflops,
    }
    return {
        "figures": figures,
        "shape": shape,
        "step_times_s": times_s,
        "malloc_keeps_freed_memory": measured["malloc_keeps_freed_memory"],
    }


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
    compiling = parser.add_mutually_exclusive_group()
    compiling.add_argument("--compile", action="store_true", help="torch.compile both models")
    compiling.add_argument(
        "--eager",
        action="store_true",
        help="neither compiled (training.compile=false); by default the HF loop runs eager and megascale as "
        "its defaults do (training.compile unset: compiled where it wins, megascale.autocompile)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        choices=(1, 2),
        default=2,
        help="2: each side in a process of its own, stepped in lockstep (the default); 1: both in this "
        "process, the HF loop inheriting what megascale's Trainer sets process-wide on CPU",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=900.0,
        help="with --processes 2: the longest wait for one side to build or to take one step",
    )
    parser.add_argument(
        "--hf-optimizer",
        choices=("fused", "foreach"),
        default="fused",
        help="AdamW implementation of Hugging Face's loop: fused (as megascale's, the default) or foreach "
        "(torch's default, as a plain loop has it)",
    )
    parser.add_argument(
        "--hf-fused",
        dest="hf_optimizer",
        action="store_const",
        const="fused",
        help="the same as --hf-optimizer=fused (the default; kept for bench/gpu.sh)",
    )
    parser.add_argument(
        "--omp-spincount",
        type=int,
        default=1000,
        help="GOMP_SPINCOUNT of both sides' processes (with --processes 2): how long an OpenMP thread spins "
        "for its team before it sleeps. Short for both, so that a core other work takes from one side does "
        "not turn into CPU time spent spinning, which libgomp's long default does when a process has no "
        "more threads than cores; 0 leaves the environment as it is",
    )
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
    if args.omp_spincount:  # read by libgomp as each spawned side starts
        os.environ["GOMP_SPINCOUNT"] = str(args.omp_spincount)

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
            malloc_keeps_freed_memory = result["malloc_keeps_freed_memory"]
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
        "statistic": "tokens/s from median wall step times; ratio (wall) and cpu_ratio (process CPU time) = "
        "median of back-to-back pair ratios, HF time / megascale time",
        "mfu_relative_to": "measured CPU matmul peak (megascale calibrate), per dtype"
        if device.type == "cpu"
        else "the accelerator's vendor dense peak (megascale.observe.peak), per dtype",
        "processes": args.processes,
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        "processes_means": "each side in a spawned process of its own, stepped in lockstep"
        if args.processes == 2
        else "both sides in one process, stepped alternately",
        "compile": "both" if args.compile else "neither" if args.eager else "megascale's default",
        "hf_adamw": args.hf_optimizer,
        "megascale_adamw": "fused",
        # megascale's Trainer sets it process-wide on CPU: with one process the Hugging Face loop has it too.
        "malloc_keeps_freed_memory": malloc_keeps_freed_memory,
        "overrides": args.set,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine, "settings": settings, "cases": cases, "results": figures}
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
