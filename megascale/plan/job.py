"""What the cost model is asked about: a job (model, sequence, batch), a layout, the system's features.

These are plain values, separate from the training config: the planner also describes systems megascale
is not (Megatron-LM as the MegaScale paper ran it), and layouts no config has yet. `layout_from_config`
reads a layout from a megascale job config, so a planned layout and a trained one are the same thing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megascale.config import JobConfig, ModelConfig
from megascale.config.parallel import V_SCHEDULES


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each copy the training state keeps, and per activation element."""

    weight_bytes: int  # the weights the model holds (and data parallelism all-gathers)
    grad_bytes: int  # gradients as accumulated and reduce-scattered
    optimizer_bytes: int  # optimizer state per parameter (fp32 master copy + moments)
    activation_bytes: int
    # A block's weights as data parallelism all-gathers them, where that is a narrower copy of the
    # weights held (None: the weights themselves).
    gathered_block_bytes: int | None = None

    @property
    def block_gather_bytes(self) -> int:
        return self.gathered_block_bytes or self.weight_bytes


# Mixed precision as Megatron-LM keeps it: bf16 weights, fp32 main gradients (grad_reduce_in_fp32,
# https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/distributed/distributed_data_parallel_config.py),
# fp32 master weights and Adam's two moments, 12 bytes a parameter (ZeRO, arXiv:1910.02054 §3.1).
MIXED_BF16 = Precision(weight_bytes=2, grad_bytes=4, optimizer_bytes=12, activation_bytes=2)
# megascale: fp32 weights and AdamW's two fp32 moments, fp32 compute or bf16 autocast (training.dtype);
# under bf16 its FSDP gathers bf16 copies of the blocks' weights, the rest in fp32, and with
# training.fp8_all_gather the blocks' float8 linear layers a byte an element, their norms counted with them
# (megascale/parallel/data.py, megascale/parallel/float8.py).
FP32_WEIGHTS = Precision(weight_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4)
FP32_WEIGHTS_BF16_GATHERS = dataclasses.replace(FP32_WEIGHTS, gathered_block_bytes=2)
FP32_WEIGHTS_FP8_GATHERS = dataclasses.replace(FP32_WEIGHTS, gathered_block_bytes=1)


@dataclass(frozen=True)
class Job:
    """The work of one optimizer step: a model, its sequence length and the global batch in sequences."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    dtype: str = "bfloat16"
    precision: Precision = MIXED_BF16
    # The blocks' linear layers in float8 (torchao's float8 training, megascale's training.fp8): their GEMMs
    # at the float8 peak, plus casting their inputs and output gradients; attention, the output layer and
    # the MFU's peak stay in `dtype`.
    fp8: bool = False
    # ... with their weights all-gathered in float8 (megascale's training.fp8_all_gather, torchao's float8
    # all-gather): each rank casts its shard before each gather, and the layers cast no weight after.
    fp8_all_gather: bool = False
    # Whether the blocks apply dropout in training (Megatron-LM's GPT defaults, 0.1), keeping a one-byte
    # mask per element for the backward; megascale's models, and Llama-style ones, have none (and at
    # p = 0 torch's dropout returns its input, keeping nothing).
    dropout: bool = False

    @property
    def linear_dtype(self) -> str:
        """The precision the blocks' linear layers run in."""
        return "float8" if self.fp8 else self.dtype

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


# Activation recomputation a layout may use (`Layout.recompute`).
RECOMPUTES = ("none", "selective", "op", "full")


@dataclass(frozen=True)
class Layout:
    """How the job is spread over devices; tp x pp x dp x cp = devices.

    `dp` counts the batches one step reads at once (data-parallel replicas of the work); the `cp` ranks of
    a context-parallel ring split each of those batches' sequences and are counted apart from it. They are
    data-parallel ranks to the weights all the same: gradients are reduced, and ZeRO shards, over dp x cp
    ranks (`fsdp_ranks`), as megascale's trainer puts cp inside `parallel.dp_shard`."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    micro_batch: int = 1
    zero_stage: int = 1  # 1: optimizer state sharded over dp; 2: + gradients; 3: + weights
    # "none", "selective" (the attention core: Korthikanti et al. 2022), "op" (torchtitan's selective op
    # checkpointing: every second matmul of a block and its element-wise operators) or "full" (whole blocks)
    recompute: str = "selective"
    sequence_parallel: bool = True
    # Mixture of experts (docs/planning.md, "Mixture of experts"): the routed experts are split over ep
    # ranks, which are data-parallel ranks (of the dp x cp that hold the same weights) unless moe_tp is
    # "ep" (then tp ranks: ep/tp tp groups).
    ep: int = 1
    # How an MoE layer uses the tp ranks: "split" (each expert's hidden size split, tokens all-gathered
    # and reduce-scattered as for a dense MLP: Megatron-LM), "whole" (computed whole on every tp rank
    # on the whole sequence: megascale's trainer by default), "ep" (the tp ranks are expert-parallel
    # ranks, each sending its share of the sequence by all-to-all: MegaScale-MoE, and megascale's trainer
    # with parallel.moe_tp = "ep").
    moe_tp: str = "split"
    # How attention uses the tp ranks: "tp" (heads split, Megatron's TP + SP) or "sp" (every rank holds
    # the whole weights and a share of the sequence; queries, keys and values exchanged by all-to-all to
    # split the heads for the attention core: DeepSpeed-Ulysses, MegaScale-MoE's attention).
    attention: str = "tp"
    # Context parallelism (docs/planning.md, "Context parallelism"): every sequence split over cp adjacent
    # data-parallel ranks, 2 of its 2 x cp chunks each, attention passing keys and values around their ring.
    cp: int = 1

    # A zero-bubble schedule (ZB-V, DualPipeV: 2 chunks a rank in a V, weight gradients in the bubble)
    zero_bubble: bool = False
    # How the layers are cut into pp x v stages (megascale's parallel.pp_split, `megascale.plan.stages`):
    # equal counts, the earlier stages taking the remainder ("uniform"), or balanced by parameters with the
    # embedding and the output layer counted toward the first and the last stage ("params").
    stage_split: str = "uniform"
    # Activation offload (megascale's parallel.activation_offload): every block but each chunk's last moves
    # what it keeps off the device until its backward, which fetches it back (one block ahead on an
    # accelerator; on a CPU when autograd asks for it).
    offload: bool = False

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def fsdp_ranks(self) -> int:
        """Ranks that hold the same weights (ZeRO shards and gradient reduction span them): the data- and
        context-parallel ranks."""
        return self.dp * self.cp

    def micro_batches(self, job: Job) -> int:
        """Micro-batches each pipeline runs per step."""
        return job.global_batch // (self.dp * self.micro_batch)

    def recomputed_share(self, job: Job) -> float:
        """The share of the blocks whose forward the backward runs again whole (full recomputation)."""
        return 1.0 if self.recompute == "full" else 0.0

    def forward_passes(self, job: Job) -> float:
        """Forward passes a block runs a step: its own, and again in the backward under full recomputation."""
        return 1 + self.recomputed_share(job)

    def local_seq_len(self, job: Job) -> int:
        """Positions of each sequence one rank computes: its 2 chunks of 2 x cp under context parallelism."""
        return job.seq_len // self.cp

    @property
    def experts_over_tp(self) -> bool:
        """Whether the tp ranks are the expert-parallel group (MegaScale-MoE)."""
        return self.moe_tp == "ep"

    def describe(self) -> str:
        chunks = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        chunks = " zb-v" if self.zero_bubble else chunks
        sp = " sp-attention" if self.attention == "sp" else ""
        if self.experts_over_tp:
            experts = f" ep{self.ep}=tp" + (f" x {self.ep // self.tp}" if self.ep > self.tp else "")
        else:
            experts = f" ep{self.ep}" if self.ep > 1 else ""
        context = f" cp{self.cp}" if self.cp > 1 else ""
        return (
            f"tp{self.tp}{sp} pp{self.pp}{chunks} dp{self.dp}{context}{experts} mb{self.micro_batch} "
            f"zero{self.zero_stage} recompute={self.recompute}"
            + (" split=params" if self.pp > 1 and self.stage_split == "params" else "")
            + (" offload" if self.offload else "")
        )


@dataclass(frozen=True)
class Features:
    """Which of the system's optimisations are on (paper §3); all off is Megatron-LM as the paper ran it."""

    tp_overlap: bool = False  # chunked all-gather/GEMM and GEMM/reduce-scatter (§3.2, Fig. 3)
    tp_overlap_attention: bool = False  # ... of the attention's projections too in a serial block
    # Without that: the column-parallel layers' backward collectives behind their own gradient GEMMs
    # (Megatron-LM from September 2021, LinearWithGradAccumulationAndAsyncCommunication).
    tp_backward_overlap: bool = False
    pp_overlap: bool = False  # decoupled, asynchronous send/receive (§3.2, Fig. 4)
    dp_overlap: bool = False  # per-chunk all-gather / reduce-scatter behind compute (§3.2)
    # Whether that overlap holds with a pipeline too: Megatron-LM in 2021-2022 ran torch's DDP, whose
    # buckets reduce behind the last micro-batch's backward, only without one (SC'21's scripts).
    dp_overlap_pipelined: bool = True
    # The device's fastest fused attention (FlashAttention-2 on Ampere, §3.3), fused LayerNorm and GeLU.
    fused_kernels: bool = False
    # Without them, how the element-wise operators run: "kernels", one kernel each (Megatron-LM's, counted
    # as ELEMENTWISE_PASSES_UNFUSED), or "eager", the model's composite operators as torch's eager mode
    # runs them (an RMSNorm's upcast, square, mean and scalings each a pass; `eager_elementwise_bytes`).
    elementwise: str = "kernels"
    # The attention kernel without them: the device's fastest ("fused": torch's scaled_dot_product_attention
    # as megascale's torch runs it, measured at that rate on an H100 and an H200), FlashAttention-2
    # ("flash2": torch's SDPA in 2024), FlashAttention-1 ("flash": Megatron-LM as the paper ran it) or
    # materialised scores ("materialized": Megatron-LM before FlashAttention, 2021-2022).
    attention_kernel: str = "flash"
    async_data: bool = False  # data preprocessing behind the gradient sync (§3.4)
    # Context parallelism's ring: each step's keys and values (and in the backward their gradients) sent
    # to the next rank while the step's attention blocks compute (megascale's parallel.overlap.cp).
    cp_overlap: bool = False
    # The expert-parallel all-to-alls behind the experts' GEMMs, in chunks (MegaScale-MoE §4): "none",
    # "forward", or "both" (forward and backward: MegaScale-MoE, and megascale's parallel.overlap.ep); or
    # "batch", behind another micro-batch's block (Megatron-Core's overlap_moe_expert_parallel_comm).
    ep_overlap: str = "none"
    # The ways the system lays an MoE layer over the tp ranks (Layout.moe_tp): Megatron-LM splits each
    # expert; MegaScale-MoE makes the tp ranks the expert-parallel group, with sequence-parallel attention
    # (`moe_attention`); megascale's trainer computes the layer whole on each, or as MegaScale-MoE does
    # with its own attention (heads split, Megatron's TP + SP).
    moe_tp: tuple[str, ...] = ("split",)
    moe_attention: str = "sp"
    # Whether the router's weights scale each token slot inside its expert's activation, so the layer
    # keeps no expert output for the backward (Megatron-Core since April 2025, commit 2659630721:
    # weighted_bias_swiglu_impl in moe/experts.py), or multiply the experts' outputs (megascale's layer).
    moe_weighted_activation: bool = False
    dp_sync_per_micro_batch: bool = False  # megascale's FSDP2: DP traffic every micro-batch (ZeRO 2, 3)
    # What the system's data parallelism can shard (searched): FSDP's ZeRO-3 and ZeRO-2
    # (reshard_after_forward, https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).
    zero_stages: tuple[int, ...] = (2, 3)
    model_parallel: bool = True  # whether the system splits the model (TP, PP); FSDP-only ones do not
    # Whether the system splits the sequence over the tp ranks outside the tensor-parallel layers
    # (Megatron-LM from 2022, Korthikanti et al.), and the activation recomputation it offers (searched).
    sequence_parallel: bool = True
    recomputes: tuple[str, ...] = ("none", "selective", "full")
    # Without sequence parallelism each tp rank sends only its slice of a pipeline transfer (Megatron-LM's
    # scatter/gather); megascale's trainer sends the whole tensor from each.
    pp_scatter_gather: bool = True
    # Per-step host work that stalls the devices (data loading, GC: MegaScale, arXiv:2402.15627 §3.4, §6.3).
    host_overhead_s: float = 0.0
    # How a dense block's activations are counted: as Korthikanti et al. count them, for the block's shape
    # (`megascale.plan.memory.block_bytes_per_token`), or as megascale's own model saves them.
    own_blocks: bool = False
    # Whether the system cuts layers into stages of unequal counts (megascale's trainer, `plan/stages.py`)
    # or needs pp x v to divide them (Megatron-LM asserts it).
    uneven_stages: bool = False
    # The fewest pipeline stages the system interleaves model chunks over (None: it has no interleaved
    # schedule, as DeepSpeed's pipeline engine). Megatron-LM refused virtual stages unless pp > 2
    # (https://github.com/NVIDIA/Megatron-LM/blob/core_r0.7.0/megatron/core/parallel_state.py) until
    # Megatron-Core 0.8; torch's pipelining, megascale's trainer, interleaves two.
    interleaved_min_pp: int | None = 3
    # Whether gradients are allocated as the backward makes them (autograd's, FSDP's) rather than held in a
    # buffer through the step (Megatron-LM's and DeepSpeed's contiguous gradient buffers): a step of one
    # micro-batch without a pipeline then peaks below its activations plus every gradient.
    grads_as_made: bool = False
    # Bytes the loss keeps per logit at its peak: float32 logits and their gradient, 4 + 4 (Megatron-LM's
    # vocab-parallel cross entropy casts the logits to float32: https://github.com/NVIDIA/Megatron-LM/blob/
    # main/megatron/core/tensor_parallel/cross_entropy.py; torch's over float32 logits), or a
    # fused cross entropy's bfloat16 logits and bfloat16 gradient (flash-attn's, llm-foundry's default).
    loss_bytes_per_logit: int = 8
    # Whether a float8 job's linear layers keep the inputs they read for the weight-gradient GEMM in
    # float8 (Transformer Engine's: transformer_engine/pytorch/module/linear.py saves the quantized input)
    # or in bfloat16, cast again in the backward (torchao's float8 training, megascale's training.fp8).
    float8_keeps_inputs: bool = False

    @property
    def host_stall_s(self) -> float:
        """What of the host's per-step work stalls the devices: none where data loading is asynchronous."""
        return 0.0 if self.async_data else self.host_overhead_s

    @property
    def attention(self) -> str:
        """The attention kernel the system runs (`megascale.plan.compute.attention_seconds`): the device's
        fastest with fused kernels, else `attention_kernel`."""
        return "fused" if self.fused_kernels else self.attention_kernel


@dataclass(frozen=True)
class Cluster:
    """How many devices, and how often a host is a computational straggler (paper §5.1, §6.3)."""

    devices: int
    straggler_host_fraction: float = 0.0
    straggler_slowdown: float = 0.0


def layout_from_config(cfg: JobConfig, devices: int) -> Layout:
    """The layout a megascale config would train with on `devices` processes: the trainer's dp_shard
    holds the cp ranks, so the data-parallel degree (batches per step) is the rest over cp."""
    par = cfg.parallel
    dp = devices // (par.tp * par.pp * par.cp)
    over_tp = par.moe_tp == "ep" and par.tp > 1 and cfg.model.moe.experts > 0
    return Layout(
        tp=par.tp,
        pp=par.pp,
        dp=dp,
        virtual_stages=par.pp_virtual_stages,
        zero_bubble=par.pp > 1 and par.pp_schedule in V_SCHEDULES,
        micro_batch=cfg.training.micro_batch_size,
        zero_stage=par.zero_stage if dp * par.cp > 1 else 1,
        recompute=par.activation_checkpoint,
        offload=par.activation_offload,
        stage_split=par.pp_split,
        sequence_parallel=par.sequence_parallel,
        ep=par.ep * (par.tp if over_tp else 1),
        moe_tp="ep" if over_tp else "whole",
        cp=par.cp,
    )


def job_from_config(cfg: JobConfig) -> Job:
    """The step a megascale config trains: its model, sequence, global batch and precision."""
    training = cfg.training
    precision = FP32_WEIGHTS_BF16_GATHERS if training.dtype == "bfloat16" else FP32_WEIGHTS
    if training.fp8_all_gather and not cfg.model.moe.experts:  # MoE experts are gathered unconverted
        precision = FP32_WEIGHTS_FP8_GATHERS
    return Job(
        cfg.model,
        cfg.data.seq_len,
        training.global_batch_size,
        training.dtype,
        precision,
        fp8=training.fp8 != "none",
        fp8_all_gather=training.fp8_all_gather,
    )
