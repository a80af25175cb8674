"""Typed job configuration: one dataclass per section, loaded from TOML, overridden as --section.key=value.

Every field carries its help text, allowed values and range in its metadata (`megascale.options`), so that
validation, the error messages and the reference in docs/config.md (``python -m megascale.config``) all come
from one place.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megascale import options
from megascale.errors import ConfigError
from megascale.options import (
    check_fields,
    fail,
    flatten_keys,
    leaf_keys,
    option,
    section,
    set_key,
    to_toml,
)

__all__ = ["JobConfig", "all_keys", "fail", "flatten_keys", "from_dict", "load_config", "to_dict", "to_toml"]


@dataclass
class AttentionConfig:
    """Attention: heads, grouped-query key/value heads, positions and the sliding window."""

    n_heads: int = option(8, "Number of query heads; must divide model.dim.", ge=1)
    n_kv_heads: int = option(
        4,
        "Key/value heads (grouped-query attention); must divide n_heads. "
        "Equal to n_heads gives multi-head attention.",
        ge=1,
    )
    window: int | None = option(
        None,
        "Sliding-window size W: token i attends to positions (i-W, i]. "
        "Unset means full causal attention (paper §3.1).",
        ge=1,
    )
    rope_theta: float = option(10000.0, "RoPE base frequency.", gt=0)


@dataclass
class ModelConfig:
    """Decoder-only transformer shape; Llama-style by default, GPT-style by options."""

    dim: int = option(256, "Hidden size.", ge=1)
    n_layers: int = option(4, "Number of transformer blocks.", ge=1)
    vocab_size: int = option(
        264,
        "Embedding rows; at least the tokenizer's vocabulary (the rest is "
        "padding, e.g. to a multiple of 8 or of the TP degree).",
        ge=2,
    )
    ffn_dim: int | None = option(
        None,
        "MLP hidden size; unset means 4*dim for GeLU and 8/3*dim rounded up to a multiple of 64 for SwiGLU.",
        ge=1,
    )
    max_seq_len: int = option(
        256,
        "Longest sequence the model accepts (size of the learned position table when position = 'learned').",
        ge=1,
    )
    block: str = option(
        "serial",
        "'serial': h = x + Attn(LN(x)); y = h + MLP(LN(h)). 'parallel': "
        "y = x + Attn(LN(x)) + MLP(LN(x)) (paper §3.1, Eq. 2).",
        choices=("serial", "parallel"),
    )
    norm: str = option("rmsnorm", "Normalisation layer.", choices=("rmsnorm", "layernorm"))
    mlp: str = option("swiglu", "MLP type: gated SiLU (Llama) or GeLU (GPT).", choices=("swiglu", "gelu"))
    position: str = option(
        "rope", "Positions: rotary (Llama) or a learned table (GPT).", choices=("rope", "learned")
    )
    norm_eps: float = option(1e-5, "Epsilon of the normalisation layers.", gt=0)
    tie_embeddings: bool = option(False, "Share the input embedding with the output projection.")
    init_std: float = option(
        0.02,
        "Standard deviation of the normal weight initialisation; output "
        "projections are scaled by 1/sqrt(2*n_layers).",
        gt=0,
    )
    attention: AttentionConfig = section(AttentionConfig)


@dataclass
class DataConfig:
    """Training data: where the text comes from, how it is tokenized, and how it is batched."""

    source: str = option(
        "stdlib",
        "Text to train on: 'stdlib' (the Python standard library's own "
        "source, present on every machine), a directory, a glob, a .jsonl file, or a "
        "directory already written by `megascale prepare` (has meta.json).",
    )
    tokenizer: str = option(
        "byte",
        "'byte' (256 byte values + EOS, no training), 'bpe' (trained "
        "locally on the source), or a path to a tokenizer.json.",
    )
    bpe_vocab_size: int = option(8192, "Vocabulary size when training a BPE tokenizer.", ge=260)
    jsonl_field: str = option("text", "Field holding the text in .jsonl input.")
    cache_dir: str = option(
        "~/.cache/megascale", "Where prepared token shards are cached, keyed by source and tokenizer."
    )
    seq_len: int = option(256, "Tokens per training sequence (packed across documents with EOS).", ge=1)
    val_fraction: float = option(0.01, "Fraction of documents held out for validation.", ge=0, lt=1)
    verify: bool = option(True, "Check shard sizes and checksums against meta.json when opening.")
    prefetch: int = option(
        1,
        "Steps of training batches a background thread prepares ahead, so the next step's batches are "
        "read while this step runs (paper §3.4); 0 reads them at the top of each step.",
        ge=0,
    )
    share_per_node: bool = option(
        True,
        "Read each training batch once per node: of the ranks on a node that take the same batches "
        "(tensor-parallel peers, pipeline stages), the lowest reads the shards and the others take the "
        "batch from shared memory (paper §3.4). Changes nothing where every rank takes its own batches.",
    )


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: str = option(
        "adamw", "AdamW (torch's) or LAMB (You et al. 2019; paper §3.1).", choices=("adamw", "lamb")
    )
    lr: float = option(3e-3, "Peak learning rate.", gt=0)
    min_lr_ratio: float = option(0.1, "Final learning rate as a fraction of lr.", ge=0, le=1)
    warmup_steps: int = option(30, "Linear warm-up steps from 0 to lr.", ge=0)
    decay: str = option(
        "cosine",
        "Decay after warm-up down to min_lr_ratio*lr at the last step.",
        choices=("cosine", "linear", "constant"),
    )
    beta1: float = option(0.9, "First-moment decay.", ge=0, lt=1)
    beta2: float = option(0.95, "Second-moment decay.", ge=0, lt=1)
    eps: float = option(1e-8, "Denominator epsilon.", gt=0)
    weight_decay: float = option(0.1, "Decoupled weight decay (not applied to norms and biases).", ge=0)
    trust_clamp: float | None = option(
        None,
        "LAMB only: upper bound of the per-tensor trust ratio ||w|| / ||update||; unset means no clamp.",
        gt=0,
    )
    grad_clip: float | None = option(1.0, "Clip the global gradient norm to this; unset disables.", gt=0)


@dataclass
class TrainingConfig:
    """The training loop: steps, batch, precision, device and logging cadence."""

    steps: int = option(
        240, "Optimizer steps to train for; also the length of the learning-rate schedule.", ge=1
    )
    stop_at_step: int | None = option(
        None,
        "Stop after this step (saving a checkpoint) short of training.steps, whose schedule stays as it "
        "is; run again with a later stop, or none, to go on. Unset: train to training.steps.",
        ge=1,
    )
    global_batch_size: int = option(16, "Sequences per optimizer step.", ge=1)
    micro_batch_size: int = option(
        16,
        "Sequences per forward/backward; global_batch_size must be a "
        "multiple (the rest is gradient accumulation).",
        ge=1,
    )
    seed: int = option(0, "Seed for weights, data order and every other random choice.", ge=0)
    dtype: str = option(
        "float32",
        "Compute precision: float32, or bfloat16 autocast (weights and optimizer state stay float32).",
        choices=("float32", "bfloat16"),
    )
    compile: bool = option(False, "Compile the model with torch.compile.")
    device: str = option("auto", "'auto' (the accelerator if present, else CPU), 'cpu', 'cuda', ...")
    threads: int | None = option(
        None, "CPU threads for intra-op parallelism; unset keeps torch's default (all cores).", ge=1
    )
    run_dir: str = option(
        "runs/default",
        "Directory for checkpoints, metrics and logs; a run resumes from the newest checkpoint found here.",
    )
    log_every: int = option(10, "Log metrics every N steps.", ge=1)
    gc_every: int = option(
        50,
        "Turn Python's automatic garbage collection off while training and collect every N steps, at the "
        "same step on every rank (paper §6.3); 0 leaves the automatic collector on.",
        ge=0,
    )
    val_every: int = option(120, "Compute validation loss every N steps (and at the last step).", ge=1)
    val_sequences: int = option(
        128,
        "Sequences per validation: the first of the held-out split, the same ones in every layout and "
        "micro-batch size (the data-parallel ranks share them).",
        ge=1,
    )
    peak_tflops: float | None = option(
        None,
        "Device peak TFLOP/s for MFU on a device missing from "
        "the built-in table; unset uses `megascale calibrate`'s "
        "measured peak.",
        gt=0,
    )


@dataclass
class CheckpointConfig:
    """Checkpoints: how often, how many, and whether to resume."""

    enabled: bool = option(True, "Save checkpoints.")
    every: int = option(120, "Save every N steps (and at the last step, and on SIGINT/SIGTERM).", ge=1)
    keep: int = option(3, "Keep the newest K checkpoints.", ge=1)
    location: str | None = option(
        None,
        "Where checkpoints go: a path or any fsspec URL (file://, s3://, gs://, memory:// ...); unset means "
        "<run_dir>/checkpoints.",
    )
    async_save: bool = option(
        True,
        "Two-stage saves: copy the state to host memory and go on training while a background thread "
        "writes and commits it (paper §4.4). Off: write and commit before the next step.",
    )
    resume: bool = option(
        True,
        "Resume from the newest checkpoint in the run directory. A run whose checkpoints were all lost "
        "(its ledger, <run_dir>/checkpoints.jsonl, shows commits) refuses to start from scratch; false "
        "starts it from scratch anyway.",
    )
    init_from: str | None = option(
        None,
        "Model weights to start from when there is nothing to resume: a "
        "checkpoint directory (e.g. written by `megascale convert --from hf`). "
        "Optimizer, schedule and data start afresh.",
    )


@dataclass
class MetricsConfig:
    """Where metrics go besides the console."""

    jsonl: bool = option(True, "Write metrics.jsonl in the run directory.")
    tensorboard: bool = option(True, "Write TensorBoard scalars under <run_dir>/tensorboard.")
    progress: bool = option(
        True,
        "Show a live progress display (off when stdout is not a terminal prints plain log lines instead).",
    )
    timeline: bool = option(
        True,
        "Record every rank's timeline (the step's phases, every collective and wait) to "
        "<run_dir>/traces as Chrome trace JSON, and log each step's time by kind (docs/observability.md).",
    )
    straggler_ratio: float = option(
        1.3,
        "A rank whose compute time is above this multiple of its peers' median (ranks of the same pipeline "
        "stage), over straggler_window steps, is named a straggler; 0 turns it off. Needs the timeline.",
        ge=0,
    )
    straggler_window: int = option(20, "Steps over which the straggler detector takes medians.", ge=1)
    hang_dump_s: float = option(
        60.0,
        "A rank that has begun no step for this long writes where it stands (each group's operations, the "
        "one it is blocked in) for `megascale trace hang`; keep it below resilience.hang_timeout_s so the "
        "state is written before the driver restarts the job; 0 turns it off. Needs the timeline.",
        ge=0,
    )


@dataclass
class OverlapConfig:
    """MegaScale's communication overlap (paper §3.2), per parallelism; off runs the plain schedule."""

    dp: bool = option(
        True,
        "Data parallelism: each block's parameter all-gather is issued asynchronously one block ahead, in "
        "forward and in backward, and the step's first all-gather before its batch is fetched.",
    )
    tp: bool = option(
        True,
        "Tensor parallelism with sequence parallelism: each MLP's and each attention's sequence all-gather "
        "and reduce-scatter are pipelined with their projection GEMMs over tp_chunks chunks of the "
        "sequence, forward and backward.",
    )
    tp_chunks: int = option(4, "Sequence chunks of the tensor-parallel overlap.", ge=2)
    pp: bool = option(
        True,
        "Pipeline parallelism (1F1B schedules): every receive posted as soon as its sender schedules it and "
        "waited on just before use, every send waited on only at the end of the step; off: each time "
        "step's sends and receives waited on together.",
    )


@dataclass
class ParallelConfig:
    """3D parallelism: data (replicated x sharded), tensor/sequence and pipeline degrees."""

    dp_replicate: int = option(
        1,
        "Data-parallel replicas (HSDP's replicate dimension); each holds a full copy of the sharded state.",
        ge=1,
    )
    dp_shard: int = option(
        -1,
        "Data-parallel ranks sharding parameters, gradients and optimizer state (FSDP2 / ZeRO); -1 takes "
        "whatever the world size leaves after pp x dp_replicate x tp.",
        ge=-1,
    )
    tp: int = option(1, "Tensor-parallel degree; keep it within a node (fastest links).", ge=1)
    pp: int = option(1, "Pipeline-parallel stages.", ge=1)
    sequence_parallel: bool = option(
        True, "With tp > 1, also shard norms and the residual stream along the sequence (Megatron SP)."
    )
    zero_stage: int = option(
        3,
        "1: keep parameters gathered and gradients whole over the step's micro-batches, reduce-scattering "
        "once at the last (Megatron-LM's distributed optimizer: one all-gather and one reduce-scatter a "
        "step, the most memory); 2: keep parameters gathered from forward to backward, reduce-scatter "
        "every micro-batch (ZeRO-2-like); 3: free them after forward and gather again for backward.",
        choices=(1, 2, 3),
    )
    pp_schedule: str = option("1f1b", "Pipeline schedule.", choices=("1f1b", "interleaved_1f1b", "gpipe"))
    pp_virtual_stages: int = option(
        1, "Model chunks per pipeline rank; more than 1 needs pp_schedule = 'interleaved_1f1b'.", ge=1
    )
    pp_split: str = option(
        "uniform",
        "How layers are divided into stages: equal layer counts, or balanced by parameter count (the "
        "embedding and output layer count towards the first and last stage).",
        choices=("uniform", "params"),
    )
    activation_checkpoint: str = option(
        "none",
        "Recompute activations in the backward: every block whole ('full'), or keep the matmul outputs "
        "and recompute only the cheap element-wise work: norms, activations, RoPE ('selective').",
        choices=("none", "full", "selective"),
    )
    rank_order: str = option(
        "tp-dp-pp",
        "How ranks are numbered, innermost dimension first (consecutive ranks share a node): 'tp-dp-pp' "
        "keeps data-parallel groups within a pod before pipeline stages (paper §2); 'tp-pp-dp' keeps "
        "pipeline neighbours close and spreads data parallelism outermost.",
        choices=("tp-dp-pp", "tp-pp-dp"),
    )
    overlap: OverlapConfig = section(OverlapConfig)
    timeout_s: float = option(
        600.0,
        "Seconds a collective may wait for its peers before failing the job (a dead peer fails it at "
        "once; a hung one only after this).",
        gt=0,
    )
    store: str = option(
        "env",
        "Where the training processes meet to build their process groups: 'env' is torch's TCPStore at "
        "MASTER_ADDR:MASTER_PORT (no setup); redis://HOST:PORT/DB a Redis server, which serves thousands of "
        "ranks at once where TCPStore's one thread queues them (paper §3.5). Keys are kept apart by job "
        "and restart.",
    )


@dataclass
class ResilienceConfig:
    """`megascale launch`: the driver, its executors, fault detection and recovery (docs/resilience.md)."""

    nodes: int = option(
        1, "Nodes the job runs on; on one machine each is an executor with its own processes.", ge=1
    )
    nproc_per_node: int = option(1, "Training processes per node.", ge=1)
    executors: str = option(
        "local",
        "'local': the driver starts one executor per node on its own machine. 'external': executors are "
        "started on each host (`megascale executor`, e.g. by srun or a Kubernetes pod; see deploy/) and "
        "join through the store, which must then be an address they reach (resilience.store).",
        choices=("local", "external"),
    )
    job_id: str | None = option(
        None,
        "The job's id, shared by the driver and its executors (`megascale executor --job`); unset: a random "
        "one. Set it when executors are started elsewhere, e.g. to $SLURM_JOB_ID.",
    )
    spares: int = option(0, "Extra nodes kept idle to replace evicted ones.", ge=0)
    store: str = option(
        "tcp://127.0.0.1:0",
        "Where heartbeats and commands go: tcp://HOST:PORT (a TCPStore the driver hosts; port 0 picks a free "
        "one; with external executors, an address and port they reach) or redis://HOST:PORT/DB (a Redis "
        "server).",
    )
    heartbeat_interval_s: float = option(1.0, "Seconds between an executor's heartbeats.", gt=0)
    heartbeat_timeout_s: float = option(15.0, "A node whose heartbeat is older than this is lost.", gt=0)
    store_grace_s: float = option(
        60.0,
        "How long the driver and the executors wait for the control store to answer again (a Redis "
        "restart) before the job ends resumable; training goes on meanwhile.",
        gt=0,
    )
    hang_timeout_s: float = option(
        120.0, "No step completed for this long, while the processes live, is a hang.", gt=0
    )
    startup_timeout_s: float = option(
        600.0,
        "The first step of an attempt may take this long (start-up, data preparation, compilation, loading "
        "the checkpoint) before it counts as a hang; the driver also waits this long for its executors to "
        "join.",
        gt=0,
    )
    comm_flat_timeout_s: float = option(
        60.0,
        "No step completed and no byte through the workers' sockets or files for this long is a hang, "
        "found before hang_timeout_s (a long step whose communication still flows waits for that); "
        "0 turns it off.",
        ge=0,
    )
    loss_spike_z: float = option(
        6.0,
        "A step's loss more than this many standard deviations above the mean of the last "
        "anomaly_window readings is a loss spike; 0 turns it off.",
        ge=0,
    )
    step_time_factor: float = option(
        3.0,
        "Three heartbeat readings in a row with a step time above this factor x the median of the last "
        "anomaly_window are a collapse of the step time (a degraded node); 0 turns it off.",
        ge=0,
    )
    anomaly_window: int = option(
        50, "Readings (one per new step seen) the loss and step-time detectors keep.", ge=4
    )
    anomaly_action: str = option(
        "warn",
        "On a loss spike or a step-time collapse: 'warn' (an event, the job goes on) or 'restart' (stop, "
        "diagnose, evict nodes that fail, and restart from the newest checkpoint).",
        choices=("warn", "restart"),
    )
    evict_stragglers: bool = option(
        False,
        "When the training processes name a straggler (metrics.straggler_ratio) and a spare node is free: "
        "stop, evict the straggler's node and restart on the spare. Without a free spare it is only logged.",
    )
    diagnose: bool = option(True, "Run the self-check on every node after a fault and evict those that fail.")
    diagnose_bandwidth: bool = option(
        True,
        "Include the communication checks in the self-check: an all-to-all among nproc_per_node fresh local "
        "processes, and an all-reduce between neighbouring nodes (a few seconds of process start-up each).",
    )
    expected_gflops: float | None = option(
        None,
        "The float32 matmul rate (GFLOP/s) a healthy node reaches in the self-check; unset: compared with "
        "the median of the nodes diagnosed together (three or more).",
    )
    expected_alltoall_gbps: float | None = option(
        None,
        "The all-to-all rate (GB/s sent per process) a healthy node reaches in the self-check; unset: "
        "compared with the median of the nodes diagnosed together.",
    )
    expected_allreduce_gbps: float | None = option(
        None,
        "The rate (GB/s) of a healthy two-node all-reduce in the self-check; unset: compared with the median "
        "of the links measured together (three or more).",
    )
    min_speed_ratio: float = option(
        0.5, "A node whose self-check rate is below this fraction of the expected one fails.", gt=0, le=1
    )
    diagnose_timeout_s: float = option(
        120.0, "A node that has not reported its self-check by then fails it.", gt=0
    )
    max_restarts: int = option(5, "Restarts before the driver gives up.", ge=0)
    nan_policy: str = option(
        "skip",
        "On a non-finite loss or gradient norm (agreed by all ranks): 'skip' the update and go on; "
        "'rollback': exit, and the driver restarts from the newest checkpoint.",
        choices=("skip", "rollback"),
    )
    inject: str | None = option(
        None,
        "Faults to inject, for tests and rehearsals (also MEGASCALE_INJECT), e.g. 'kill:rank=1:step=7'; see "
        "docs/resilience.md.",
    )


@dataclass
class JobConfig:
    """A whole training job."""

    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    optim: OptimConfig = section(OptimConfig)
    training: TrainingConfig = section(TrainingConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    metrics: MetricsConfig = section(MetricsConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    resilience: ResilienceConfig = section(ResilienceConfig)

    def validate(self) -> None:
        """Check every field's range and the rules between fields; raise ConfigError on the first."""
        check_fields(self)
        self.check_rules()

    def check_rules(self) -> None:
        """The rules between fields (each field's own range is `check_fields`'); ConfigError on the first."""
        m, a, t = self.model, self.model.attention, self.training
        if m.dim % a.n_heads:
            fail("model.attention.n_heads", a.n_heads, f"must divide model.dim = {m.dim}")
        if a.n_heads % a.n_kv_heads:
            fail(
                "model.attention.n_kv_heads",
                a.n_kv_heads,
                f"must divide model.attention.n_heads = {a.n_heads}",
            )
        if (m.dim // a.n_heads) % 2 and m.position == "rope":
            fail(
                "model.attention.n_heads",
                a.n_heads,
                f"gives an odd head size {m.dim // a.n_heads}; RoPE needs an even one",
            )
        if self.data.seq_len > m.max_seq_len:
            fail("data.seq_len", self.data.seq_len, f"exceeds model.max_seq_len = {m.max_seq_len}")
        if self.parallel.dp_shard == 0:
            fail("parallel.dp_shard", 0, "must be >= 1, or -1 for the rest of the world size")
        store = self.parallel.store
        if store != "env" and not re.fullmatch(r"redis://[^/:@]+:\d+(/\d+)?", store):
            fail("parallel.store", store, "must be 'env' or redis://HOST:PORT/DB (redis://10.0.0.1:6379/0)")
        if t.stop_at_step is not None and t.stop_at_step > t.steps:
            fail(
                "training.stop_at_step",
                t.stop_at_step,
                f"is past training.steps = {t.steps}, where training ends anyway; lower it or unset it",
            )
        if t.global_batch_size % t.micro_batch_size:
            fail(
                "training.global_batch_size",
                t.global_batch_size,
                f"must be a multiple of training.micro_batch_size = {t.micro_batch_size}",
            )


def all_keys() -> list[str]:
    """Every dotted leaf key of a job config, e.g. 'model.attention.window'."""
    return leaf_keys(JobConfig)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> JobConfig:
    """Defaults, then the TOML file at `path`, then `--section.key=value` overrides; validated."""
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config: file {str(path)!r} does not exist")
        try:
            table = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config: {path} is not valid TOML: {err}") from None
        for key, value in flatten_keys(table).items():
            set_key(cfg, key, value, from_text=False)
    for item in overrides:
        key, sep, value = item.removeprefix("--").partition("=")
        if not sep:
            raise ConfigError(f"config: override {item!r} must look like --section.key=value")
        set_key(cfg, key, value, from_text=True)
    cfg.validate()
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(table: dict) -> JobConfig:
    """Rebuild a JobConfig from `to_dict` output (as stored in checkpoints)."""
    cfg = JobConfig()
    for key, value in flatten_keys(table).items():
        set_key(cfg, key, value, from_text=False)
    return cfg


def render_reference() -> str:
    """docs/config.md: every field with its type, default and meaning."""
    preamble = [
        "# Configuration reference",
        "",
        "Generated by `python -m megascale.config > docs/config.md`; a test checks it is current.",
        "",
        "Set fields in a TOML file (`megascale train --config configs/default.toml`) or on the "
        "command line as `--section.key=value` (later wins). `--print-config` shows the result.",
        "",
    ]
    return options.render_reference(JobConfig, preamble)


if __name__ == "__main__":
    sys.stdout.write(render_reference())
