"""The sections of one training run: its data, optimizer, loop, checkpoints and metrics."""

from __future__ import annotations

from dataclasses import dataclass

from megascale.options import option


@dataclass
class DataConfig:
    """Training data: where the text comes from, how it is tokenized, and how it is batched."""

    source: str = option(
        "stdlib",
        "Text to train on: 'stdlib' (the Python standard library's own "
        "source, present on every machine), a directory, a glob, a .jsonl file, a "
        "directory already written by `megascale prepare` (has meta.json), or files read by Hugging Face "
        "`datasets`: 'parquet:PATH', 'json:PATH' (JSON Lines), 'arrow:PATH' (a path or glob each) or "
        "'hf-disk:DIR' (a `save_to_disk` folder); docs/data.md.",
    )
    tokenizer: str = option(
        "byte",
        "'byte' (256 byte values + EOS, no training), 'bpe' (trained "
        "locally on the source), or a path to a tokenizer.json.",
    )
    bpe_vocab_size: int = option(8192, "Vocabulary size when training a BPE tokenizer.", ge=260)
    text_field: str = option(
        "text", "Field (column) holding each document's text in .jsonl and `datasets` input."
    )
    jsonl_field: str = option(
        "text",
        "Former name of text_field, still read: a value other than 'text' counts while text_field is 'text'.",
    )
    streaming: bool = option(
        False,
        "Read `datasets` sources as a stream, tokenized while training, instead of preparing token shards "
        "first; resumes at the exact sample (docs/data.md).",
    )
    mixture: str = option(
        "",
        "Several sources with weights, replacing data.source: 'SOURCE=WEIGHT' entries separated by commas "
        "or new lines, e.g. 'parquet:/data/web/*.parquet=0.7, json:/data/code.jsonl=0.3'; each training "
        "sequence comes from one source, in the weights' proportions. Empty: data.source alone.",
    )
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
        "Compute precision: float32, or bfloat16 autocast (weights and optimizer state stay float32; FSDP "
        "gathers bfloat16 copies of the blocks' weights, half the bytes, and reduces gradients in float32).",
        choices=("float32", "bfloat16"),
    )
    fp8: str = option(
        "none",
        "Linear layers' matmuls in float8 with dynamic scaling (torchao's float8 training): 'tensorwise' "
        "(one scale a tensor), 'rowwise' (one a row: closer to bfloat16, no float8 all-gather), or 'none'.",
        choices=("none", "tensorwise", "rowwise"),
    )
    fp8_all_gather: bool = option(
        False,
        "With fp8 = 'tensorwise' and FSDP (dp_shard > 1): all-gather the float8 layers' weights in float8, "
        "a byte an element.",
    )
    fp8_exclude: str = option(
        "output,router.gate",
        "Comma-separated linear layer names (matched as name suffixes) kept in the compute precision under "
        "fp8; embeddings and the MoE experts' grouped weights always are.",
    )
    compile: bool | None = option(
        None,
        "Compile the model's blocks with torch.compile; unset: compiled where measured to win (a CPU run "
        "in bfloat16 of 100 steps or more, dense, in a layout that allows it: megascale/autocompile.py).",
    )
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
    snapshot_every: int = option(
        0,
        "Also copy the state into the node's memory every N steps between saves (stage 1 alone, written "
        "nowhere; two buffers a rank, taken in turn). A restart on the same nodes resumes from the newest "
        "one, so a fault costs at most N steps instead of up to checkpoint.every; 0: only at saves.",
        ge=0,
    )
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
    wandb: str = option(
        "off",
        "Weights & Biases (pip install megascale[wandb]): 'offline' writes the run under <run_dir>/wandb "
        "for `wandb sync`, 'online' sends it as it goes; the same scalars as metrics.jsonl, the config, "
        "and the run report at the end. A resumed run continues the same W&B run.",
        choices=("off", "offline", "online"),
    )
    wandb_project: str = option("megascale", "Weights & Biases project.")
    wandb_entity: str | None = option(None, "Weights & Biases entity (team or user); default: yours.")
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
