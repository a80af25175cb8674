"""What the cost model is asked about: a job (model, sequence, batch), a layout, the system's features.

Plain values, apart from the training config: the planner also describes systems megascale is not, and
layouts no config has yet; `layout_from_config` reads a layout from a megascale config.
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
    fp8: bool = False  # the blocks' linear layers in float8 (training.fp8); the rest stays in `dtype`
    fp8_all_gather: bool = False  # ... their weights gathered in float8 (training.fp8_all_gather)
    dropout: bool = False  # Megatron-LM's GPTs train with dropout (a byte of mask an element kept)

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
    """How the job is spread over devices, tp x pp x dp x cp of them: dp counts the batches a step reads at
    once, the cp ranks of a ring split their sequences; to the weights both are data-parallel ranks
    (`fsdp_ranks`), as the trainer's dp_shard holds cp."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    micro_batch: int = 1
    zero_stage: int = 1  # 1: optimizer state sharded over dp; 2: + gradients; 3: + weights
    recompute: str = "selective"  # RECOMPUTES: the attention core, torchtitan's "op" set, or whole blocks
    sequence_parallel: bool = True
    # Mixture of experts (docs/planning.md, "Mixture of experts"): the routed experts over ep ranks, and
    # how the layer uses the tp ranks: each expert split ("split", Megatron-LM), the layer whole on each
    # ("whole", megascale's trainer), or the tp ranks as expert-parallel ranks ("ep", MegaScale-MoE); and
    # the attention's: heads split ("tp") or the sequence, DeepSpeed-Ulysses' all-to-alls around it ("sp").
    ep: int = 1
    moe_tp: str = "split"
    attention: str = "tp"
    cp: int = 1  # context-parallel ranks of a ring, each holding 2 of a sequence's 2 x cp chunks
    zero_bubble: bool = False  # a zero-bubble V schedule (ZB-V, DualPipeV)
    stage_split: str = "uniform"  # how the layers are cut into pp x v stages (parallel.pp_split)
    offload: bool = False  # activation offload (parallel.activation_offload)

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def fsdp_ranks(self) -> int:
        """Ranks that hold the same weights (ZeRO shards over them): the data- and context-parallel ranks."""
        return self.dp * self.cp

    def micro_batches(self, job: Job) -> int:
        """Micro-batches each pipeline runs per step."""
        return job.global_batch // (self.dp * self.micro_batch)

    def forward_passes(self, job: Job) -> int:
        """Forward passes a block runs a step: its own, and again in the backward under full recomputation."""
        return 2 if self.recompute == "full" else 1

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
    """What a system overlaps, fuses and can run (MegaScale, arXiv:2402.15627 §3; docs/planning.md, "The
    model"); all off is Megatron-LM as the paper ran it. `megascale.plan.systems` names each system's."""

    tp_overlap: bool = False  # chunked all-gather/GEMM and GEMM/reduce-scatter (§3.2, Fig. 3)
    tp_overlap_attention: bool = False  # ... of the attention's projections too in a serial block
    tp_backward_overlap: bool = False  # the column-parallel backward's collectives beside its GEMMs
    pp_overlap: bool = False  # decoupled, asynchronous send/receive (§3.2, Fig. 4)
    dp_overlap: bool = False  # per-chunk all-gather / reduce-scatter behind compute (§3.2)
    dp_overlap_pipelined: bool = True  # ... with a pipeline too (torch's DDP: only without one)
    fused_kernels: bool = False  # the device's fastest attention, fused LayerNorm and GeLU (§3.3)
    # Without them: the element-wise operators one kernel each ("kernels") or as torch's eager mode runs
    # the model's composite operators ("eager"); attention in FlashAttention-1 ("flash"), -2 ("flash2"),
    # the device's fastest ("fused") or over materialised scores ("materialized").
    elementwise: str = "kernels"
    attention_kernel: str = "flash"
    async_data: bool = False  # data preprocessing behind the gradient sync (§3.4)
    cp_overlap: bool = False  # the ring's transfers beside each ring step's attention
    # The all-to-alls behind the experts' GEMMs ("both", MegaScale-MoE's) or behind another micro-batch's
    # block ("batch", Megatron-Core's overlap_moe_expert_parallel_comm).
    ep_overlap: str = "none"
    moe_tp: tuple[str, ...] = ("split",)  # the ways it lays an MoE layer over the tp ranks (Layout.moe_tp)
    moe_attention: str = "sp"  # the attention beside experts over the tp ranks (Layout.attention)
    moe_weighted_activation: bool = False  # the router's weights inside the experts' activation
    dp_sync_per_micro_batch: bool = False  # FSDP: data-parallel traffic every micro-batch (ZeRO 2, 3)
    # What its data parallelism can shard (searched): FSDP's ZeRO-3 and ZeRO-2 (reshard_after_forward,
    # https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).
    zero_stages: tuple[int, ...] = (2, 3)
    model_parallel: bool = True  # whether it splits the model (TP, PP, CP); FSDP-only systems do not
    sequence_parallel: bool = True  # whether it splits the sequence beside TP (Korthikanti et al. 2022)
    recomputes: tuple[str, ...] = ("none", "selective", "full")  # the recomputation it offers
    pp_scatter_gather: bool = True  # without SP, each tp rank sends its slice of a pipeline transfer
    # Per-step host work that stalls the devices (data loading, GC: MegaScale, arXiv:2402.15627 §3.4).
    host_overhead_s: float = 0.0
    own_blocks: bool = False  # activations as megascale's model saves them, not Korthikanti's count
    uneven_stages: bool = False  # whether it cuts layers into stages of unequal counts
    # The fewest pipeline stages it interleaves chunks over (None: no interleaved schedule); Megatron-LM
    # refused virtual stages unless pp > 2 until Megatron-Core 0.8
    # (https://github.com/NVIDIA/Megatron-LM/blob/core_r0.7.0/megatron/core/parallel_state.py).
    interleaved_min_pp: int | None = 3
    grads_as_made: bool = False  # gradients made during the backward, not held in a buffer all step
    # Bytes the loss keeps per logit at its peak: float32 logits and gradient (Megatron-LM's cross entropy,
    # https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/tensor_parallel/cross_entropy.py), or
    # 4 for a fused one's bfloat16 pair.
    loss_bytes_per_logit: int = 8
    float8_keeps_inputs: bool = False  # float8 layers keep their inputs in float8 (Transformer Engine's)

    @property
    def host_stall_s(self) -> float:
        """What of the host's per-step work stalls the devices: none where data loading is asynchronous."""
        return 0.0 if self.async_data else self.host_overhead_s

    @property
    def attention(self) -> str:
        """The attention kernel the system runs: the device's fastest with fused kernels."""
        return "fused" if self.fused_kernels else self.attention_kernel


@dataclass(frozen=True)
class Cluster:
    """How many devices, and how often a host is a computational straggler (paper §5.1, §6.3)."""

    devices: int
    straggler_host_fraction: float = 0.0
    straggler_slowdown: float = 0.0


def layout_from_config(cfg: JobConfig, devices: int) -> Layout:
    """The layout a megascale config trains with on `devices` processes (dp_shard holds the cp ranks)."""
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
