"""The planner's validation set: published training throughputs it was not fitted on, and its error on each.

The planner's constants come from the MegaScale paper's tables alone (`megascale.plan.paper`); these rows
come from other papers and projects, each with its source, its FLOP convention and what we assumed where
the source is silent (docs/planning.md, "Validation set"). Sources count FLOPs differently (hardware FLOPs
with recomputation, model FLOPs with or without causal halving, 6N with or without the embeddings), so a
row is compared by its step time, which every convention agrees on: each row's published step time is the
one the source states, or the one its throughput implies under its own FLOP formula. The predicted MFU of
a row is then the published MFU times published over predicted step time, in the source's convention, and
the error is in that convention's points.

`python -m megascale.plan.validation` prints the table of docs/planning.md (a test checks they agree).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass

from megascale.config import AttentionConfig, ModelConfig
from megascale.models.flops import num_params
from megascale.plan.hardware import PROFILES, HardwareProfile
from megascale.plan.job import MIXED_BF16, Cluster, Features, Job, Layout
from megascale.plan.search import NoLayoutFits, Plan, fastest_per_split, search
from megascale.plan.step import StepEstimate, estimate_step
from megascale.plan.systems import (
    FSDP,
    MEGATRON_2021_SC21,
    MEGATRON_2022,
    MEGATRON_CORE,
    TORCHTITAN,
)

A100, H100 = PROFILES["a100"], PROFILES["h100"]
TERA = 1e12


def gpt(dim: int, layers: int, heads: int, vocab: int, seq_len: int, tied: bool = True) -> ModelConfig:
    """A GPT of Megatron's shape: LayerNorm, GeLU MLP 4h wide, learned positions, multi-head attention."""
    return ModelConfig(
        dim=dim,
        n_layers=layers,
        vocab_size=vocab,
        ffn_dim=4 * dim,
        max_seq_len=seq_len,
        norm="layernorm",
        mlp="gelu",
        position="learned",
        tie_embeddings=tied,
        attention=AttentionConfig(n_heads=heads, n_kv_heads=heads),
    )


def llama(
    dim: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq_len: int
) -> ModelConfig:
    """A Llama: RMSNorm, SwiGLU, RoPE, grouped-query attention, untied embeddings."""
    return ModelConfig(
        dim=dim,
        n_layers=layers,
        vocab_size=vocab,
        ffn_dim=ffn,
        max_seq_len=seq_len,
        tie_embeddings=False,
        attention=AttentionConfig(n_heads=heads, n_kv_heads=kv_heads),
    )


# FLOPs per token in each source's own convention, from which its throughput figures were computed.
def megatron_hardware_flops(model: ModelConfig, seq_len: int) -> float:
    """SC'21 Eq. 3 (Narayanan et al. 2021): every block GEMM 4 times (forward, backward, the recomputed
    forward), attention's score matmuls unhalved, the logit layer 3 times."""
    h, layers, vocab = model.dim, model.n_layers, model.vocab_size
    return 96 * layers * h * h * (1 + seq_len / (6 * h) + vocab / (16 * layers * h))


def megatron_model_flops(model: ModelConfig, seq_len: int) -> float:
    """Korthikanti et al. 2022, Appendix A, and Megatron-Core's `num_floating_point_operations` for a GPT
    with a 4h GeLU MLP: forward and backward, no recomputation, attention's score matmuls unhalved."""
    h, layers, vocab = model.dim, model.n_layers, model.vocab_size
    return 72 * layers * h * h * (1 + seq_len / (6 * h) + vocab / (12 * layers * h))


def palm_flops(params: float) -> Callable[[ModelConfig, int], float]:
    """PaLM's model FLOPs (Chowdhery et al. 2022, Appendix B): 6N per token for N parameters (as the source
    counts them), plus 12 * layers * dim * seq_len for attention's score matmuls, unhalved."""
    return lambda model, seq_len: 6 * params + 12 * model.n_layers * model.dim * seq_len


@dataclass(frozen=True)
class Source:
    """Where rows come from, how they counted FLOPs, the system they ran, and what we assumed."""

    name: str
    where: str
    convention: str
    features: Features
    profile: HardwareProfile
    assumed: str
    # The peak the source's MFU divides by, where its devices ran below the profile's datasheet one
    # (torchtitan's power-capped H100s, reported against the SXM's 989 TFLOP/s); None: the profile's.
    mfu_peak_tflops: float | None = None


@dataclass(frozen=True)
class Published:
    """One published run and what its source says of it; `step_s` is stated or derived (`published`)."""

    source: Source
    label: str
    model: ModelConfig
    seq_len: int
    global_batch: int
    layout: Layout
    step_s: float
    mfu: float  # the published MFU, in the source's convention (of the bfloat16 peak)
    fp8: bool = False  # whether the run's linear layers ran in float8
    fp8_all_gather: bool = False  # ... and FSDP gathered their weights in float8 (torchao's all-gather)
    dropout: bool = False  # whether the model trained with dropout (`Job.dropout`)
    grad_bytes: int = MIXED_BF16.grad_bytes  # gradients as accumulated and reduce-scattered

    @property
    def gpus(self) -> int:
        return self.layout.devices

    @property
    def job(self) -> Job:
        precision = dataclasses.replace(MIXED_BF16, grad_bytes=self.grad_bytes)
        if self.fp8_all_gather:
            precision = dataclasses.replace(precision, gathered_block_bytes=1)
        return Job(
            self.model,
            self.seq_len,
            self.global_batch,
            precision=precision,
            fp8=self.fp8,
            fp8_all_gather=self.fp8_all_gather,
            dropout=self.dropout,
        )

    def predict(self) -> StepEstimate:
        cluster = Cluster(self.gpus)  # stragglers are the MegaScale cluster's (paper §5.1), not these
        return estimate_step(self.job, self.layout, self.source.features, self.source.profile, cluster)

    @property
    def predicted_mfu(self) -> float:
        """The MFU the prediction implies, in the source's convention."""
        return self.mfu * self.step_s / self.predict().step_s

    @property
    def error_points(self) -> float:
        return 100 * (self.predicted_mfu - self.mfu)

    def searched_plans(self) -> list[Plan]:
        """`megascale plan`'s search for this row's job and devices, over the layouts its system can run,
        fastest first; raises NoLayoutFits where the memory model leaves no layout room."""
        features = self.source.features
        return search(
            self.job,
            Cluster(self.gpus),
            self.source.profile,
            features,
            skip_selective=features.fused_kernels,
        )

    def search_agrees(self) -> bool:
        """Whether the search (`searched_plans`) ranks the published layout among its first five splits of
        the devices (`fastest_per_split`, as `megascale plan` lists them) or predicts it within 3 points
        of its own pick; not where the memory model leaves no layout room."""
        try:
            plans = self.searched_plans()
        except NoLayoutFits:
            return False
        shape = (self.layout.tp, self.layout.pp, self.layout.dp, self.layout.cp)
        top = [
            (plan.layout.tp, plan.layout.pp, plan.layout.dp, plan.layout.cp)
            for plan in fastest_per_split(plans)[:5]
        ]
        pick_mfu = self.mfu * self.step_s / plans[0].estimate.step_s
        return shape in top or 100 * (pick_mfu - self.predicted_mfu) <= 3


def published(
    source: Source,
    label: str,
    job: tuple[ModelConfig, int, int],
    layout: Layout,
    flops_per_token: Callable[[ModelConfig, int], float],
    *,
    step_s: float | None = None,
    tflops_per_gpu: float | None = None,
    tokens_per_s_per_gpu: float | None = None,
    fp8: bool = False,
    fp8_all_gather: bool = False,
    dropout: bool = False,
    grad_bytes: int = MIXED_BF16.grad_bytes,
) -> Published:
    """A row of `job` (model, sequence length, global batch) from what its source gives: the iteration
    time, or a throughput (TFLOP/s per GPU under the source's FLOP formula, or tokens/s per GPU); the
    other figures follow under that formula. `fp8`: the run's linear layers ran in float8;
    `fp8_all_gather`: FSDP gathered their weights in float8; `dropout`: the model trained with dropout;
    `grad_bytes`: its gradients' bytes as accumulated and reduce-scattered (float32 unless said)."""
    model, seq_len, global_batch = job
    flops = global_batch * seq_len * flops_per_token(model, seq_len)
    peak_per_device = source.profile.peak_flops("bfloat16")
    if source.mfu_peak_tflops is not None:
        peak_per_device = source.mfu_peak_tflops * TERA
    peak = layout.devices * peak_per_device
    if tokens_per_s_per_gpu is not None:
        step_s = global_batch * seq_len / (layout.devices * tokens_per_s_per_gpu)
    elif tflops_per_gpu is not None:
        step_s = flops / (layout.devices * tflops_per_gpu * TERA)
    assert step_s is not None, "a row needs its step time or a throughput"
    mfu = flops / (step_s * peak)
    return Published(
        source,
        label,
        model,
        seq_len,
        global_batch,
        layout,
        step_s,
        mfu,
        fp8,
        fp8_all_gather,
        dropout,
        grad_bytes,
    )


SC21 = Source(
    name="Megatron-LM, SC'21 Table 1",
    where="Narayanan et al. 2021 (arXiv 2104.04473) Table 1; per-row micro-batch and virtual stages from "
    "NVIDIA/Megatron-LM examples/academic_paper_scripts/sc21/run_table_1.sh",
    convention="hardware FLOPs (Eq. 3: full recomputation counted), % of 312 TFLOP/s",
    features=MEGATRON_2021_SC21,
    profile=A100,
    assumed="no sequence parallelism (it did not exist); data parallelism without ZeRO (zero_stage 0): "
    "torch's DDP without a pipeline, Megatron-LM's own after the backward with one (run_table_1.sh's "
    "DDP=torch and DDP=local); dropout, Megatron-LM's default (run_table_1.sh sets none); gradients "
    "accumulated and reduced in float16 (the scripts' CONFIG.sh trains in --fp16, and that Megatron-LM "
    "keeps them in float32 only under bf16: megatron/model/distributed.py at the scripts' commit)",
)
SC21_ROWS = [
    # (hidden, layers, heads, tp, pp, gpus, batch, micro-batch, virtual stages, TFLOP/s per GPU)
    (2304, 24, 24, 1, 1, 32, 512, 16, 1, 137),
    (3072, 30, 32, 2, 1, 64, 512, 16, 1, 138),
    (4096, 36, 32, 4, 1, 128, 512, 16, 1, 142),
    (6144, 40, 48, 8, 1, 256, 1024, 8, 1, 135),
    (8192, 48, 64, 8, 2, 512, 1536, 4, 1, 138),
    (10240, 60, 80, 8, 4, 1024, 1792, 2, 3, 140),
    (12288, 80, 96, 8, 8, 1536, 2304, 2, 2, 148),
    (16384, 96, 128, 8, 16, 1920, 2160, 1, 2, 155),
    (20480, 105, 128, 8, 35, 2520, 2520, 1, 3, 163),
    (25600, 128, 160, 8, 64, 3072, 3072, 1, 1, 163),
]


def sc21() -> list[Published]:
    rows = []
    for dim, layers, heads, tp, pp, gpus, batch, micro, chunks, tflops in SC21_ROWS:
        model = gpt(dim, layers, heads, 51200, 2048)
        layout = Layout(tp, pp, gpus // (tp * pp), chunks, micro, 0, "full", sequence_parallel=False)
        label = f"{model_size(model)} tp{tp} pp{pp} on {gpus}"
        job = (model, 2048, batch)
        rows.append(
            published(
                SC21,
                label,
                job,
                layout,
                megatron_hardware_flops,
                tflops_per_gpu=tflops,
                dropout=True,
                grad_bytes=2,
            )
        )
    return rows


KORTHIKANTI = Source(
    name="Megatron-LM, Korthikanti et al. 2022 Table 5",
    where="Korthikanti et al. 2022 (arXiv 2205.05198) Tables 3 and 5, and the 530B data-parallel run of "
    "§6.3; the MFU figures also in NVIDIA/Megatron-LM's README of May 2022",
    convention="model FLOPs (Appendix A), % of 312 TFLOP/s; iteration times as published",
    features=MEGATRON_2022,
    profile=A100,
    assumed="the 1T model not interleaved (the paper names interleaving for 175B and 530B only); the "
    "Megatron-LM of its time (the column-parallel backward's collectives asynchronous, data parallelism "
    "without the distributed optimizer: zero_stage 0); dropout, Megatron-LM's default",
)
KORTHIKANTI_ROWS = [
    # (hidden, layers, heads, tp, pp, gpus, batch, micro-batch, virtual stages, s with SP + selective
    # recomputation, s with full recomputation and no SP)
    (6144, 48, 64, 8, 1, 8, 4, 4, 1, 1.10, 1.42),
    (12288, 96, 96, 8, 8, 64, 64, 1, 3, 13.75, 18.13),
    (20480, 105, 128, 8, 35, 280, 280, 1, 3, 37.83, 49.05),
    (25600, 128, 160, 8, 64, 512, 512, 1, 1, 71.49, 94.42),
]


def korthikanti() -> list[Published]:
    rows = []
    for dim, layers, heads, tp, pp, gpus, batch, micro, chunks, selective_s, full_s in KORTHIKANTI_ROWS:
        model = gpt(dim, layers, heads, 51200, 2048)
        for recompute, sp, step_s in (("selective", True, selective_s), ("full", False, full_s)):
            layout = Layout(tp, pp, gpus // (tp * pp), chunks, micro, 0, recompute, sp)
            label = f"{model_size(model)} tp{tp} pp{pp} on {gpus}, {recompute} recompute"
            job = (model, 2048, batch)
            rows.append(
                published(KORTHIKANTI, label, job, layout, megatron_model_flops, step_s=step_s, dropout=True)
            )
    model = gpt(20480, 105, 128, 51200, 2048)  # §6.3: the 530B model on 8 data-parallel replicas
    layout = Layout(8, 35, 8, 3, 1, 0, "selective", True)  # before the distributed optimizer
    label, job = "530B tp8 pp35 dp8 on 2,240", (model, 2048, 2240)
    rows.append(published(KORTHIKANTI, label, job, layout, megatron_model_flops, step_s=39.15, dropout=True))
    return rows


MEGATRON_CORE_H100 = Source(
    name="Megatron-Core r0.8, H100 weak scaling",
    where="NVIDIA/Megatron-LM README, 'Performance Benchmarking' (images/model_table.png, July 2024)",
    convention="model FLOPs (Megatron-Core's formula, unhalved attention), % of 989 TFLOP/s",
    features=MEGATRON_CORE,
    profile=H100,
    assumed="bf16; without a pipeline, one micro-batch of the whole data-parallel share, else micro-batches "
    "of 1; no recomputation beyond FlashAttention's; the distributed optimizer "
    "(ZeRO-1); no interleaving; untied embeddings (the table's parameter counts need them); a 4h GeLU MLP; "
    "dropout, Megatron-LM's default",
)
MEGATRON_CORE_ROWS = [
    # (hidden, layers, heads, tp, pp, gpus, batch, TFLOP/s per GPU)
    (2048, 24, 16, 1, 1, 48, 192, 408.8),
    (4096, 30, 32, 2, 1, 96, 192, 465.9),
    (6144, 32, 48, 4, 1, 192, 192, 489.1),
    (7168, 48, 56, 8, 1, 384, 192, 459.6),
    (8192, 84, 64, 8, 2, 768, 384, 419.7),
    (10240, 92, 80, 8, 4, 1536, 768, 420.5),
    (12288, 96, 96, 8, 6, 2304, 1152, 432.8),
    (16384, 96, 128, 8, 8, 3072, 1536, 474.4),
    (18432, 112, 144, 8, 16, 6144, 3072, 459.9),
]


def megatron_core() -> list[Published]:
    rows = []
    for dim, layers, heads, tp, pp, gpus, batch, tflops in MEGATRON_CORE_ROWS:
        model = gpt(dim, layers, heads, 131072, 4096, tied=False)
        dp = gpus // (tp * pp)
        micro = batch // dp if pp == 1 else 1
        layout = Layout(tp, pp, dp, 1, micro, 1, "selective", True)
        label, job = f"{model_size(model)} tp{tp} pp{pp} on {gpus:,}", (model, 4096, batch)
        rows.append(
            published(
                MEGATRON_CORE_H100,
                label,
                job,
                layout,
                megatron_model_flops,
                tflops_per_gpu=tflops,
                dropout=True,
            )
        )
    return rows


TORCHTITAN_A100 = Source(
    name="torchtitan, FSDP2 on 64 A100s",
    where="pytorch/torchtitan docs/performance.md (2024; Llama 3 rows added April 2024)",
    convention="6N + 12 L h s (N with the embeddings), % of 312 TFLOP/s",
    features=dataclasses.replace(TORCHTITAN, model_parallel=False),  # its table benchmarks FSDP2 alone (1D)
    profile=A100,
    assumed="the network of our A100 profile (200 Gb/s per GPU; the source does not say); 'selective op' "
    "recomputation as torchtitan's policy of April 2024 (every second matmul and the element-wise "
    "operators recomputed)",
)
LLAMA3_8B = llama(4096, 32, 32, 8, 14336, 128256, 8192)
TORCHTITAN_ROWS = [
    # (name, model, seq_len, local batch, activation checkpointing, tokens/s per GPU, parameters as counted)
    ("Llama 3 8B", LLAMA3_8B, 8192, 1, "selective op", 2973, 8.03e9),
    ("Llama 3 70B", llama(8192, 80, 64, 8, 28672, 128256, 8192), 8192, 1, "full", 331, 70.6e9),
    ("Llama 2 13B", llama(5120, 40, 40, 40, 13824, 32000, 4096), 4096, 2, "none", 2162, 13.0e9),
    ("Llama 2 70B", llama(8192, 80, 64, 8, 28672, 32000, 4096), 4096, 2, "full", 353, 69.0e9),
]
TORCHTITAN_RECOMPUTE = {"selective op": "op", "full": "full", "none": "none"}


def torchtitan() -> list[Published]:
    rows = []
    for name, model, seq_len, local, checkpointing, tokens_per_s, params in TORCHTITAN_ROWS:
        layout = Layout(1, 1, 64, 1, local, 3, TORCHTITAN_RECOMPUTE[checkpointing], False)
        label, job = f"{name}, recompute {checkpointing}", (model, seq_len, 64 * local)
        flops = palm_flops(params)
        rows.append(published(TORCHTITAN_A100, label, job, layout, flops, tokens_per_s_per_gpu=tokens_per_s))
    return rows


LLM_FOUNDRY = Source(
    name="MosaicML llm-foundry, FSDP on H100",
    where="mosaicml/llm-foundry scripts/train/benchmarking/README.md, 'H100 80GB BF16 (Large Scale)'",
    convention="6N + 12 L d s (N with the embeddings), % of 989 TFLOP/s",
    # Composer: FSDP alone; attention by llm-foundry's triton FlashAttention, the default `--attn_impl`
    # of the benchmark script (scripts/train/benchmarking/submit_benchmarks.py) when the table was made.
    # Its loss, flash-attn's fused cross entropy (MPT's default `loss_fn`), keeps bfloat16 logits and
    # makes a bfloat16 gradient.
    features=dataclasses.replace(
        FSDP, model_parallel=False, attention_kernel="flash", loss_bytes_per_logit=4
    ),
    profile=H100,
    assumed="the network of our H100 profile (400 Gb/s per GPU; the source does not say); MPT as a GPT "
    "with learned positions and tied embeddings; FULL_SHARD as ZeRO-3, SHARD_GRAD_OP as ZeRO-2; its "
    "triton attention kernel (FlashAttention-1's algorithm) at FlashAttention-1's speed; no dropout and "
    "flash-attn's fused cross entropy (MPT's defaults)",
)
MPT = {  # name: (d_model, heads, layers)
    "1b": (2048, 16, 24),
    "3b": (2560, 20, 32),
    "7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "30b": (7168, 56, 48),
    "70b": (8192, 64, 80),
}
LLM_FOUNDRY_ROWS = [
    # (model, gpus, micro-batch, global batch, tokens/s per GPU, ZeRO stage, recompute)
    ("70b", 128, 8, 1024, 1058, 3, "full"),
    ("70b", 512, 8, 4096, 1007, 3, "full"),
    ("30b", 128, 8, 1024, 2199, 3, "full"),
    ("30b", 512, 8, 4096, 2115, 3, "full"),
    ("13b", 128, 16, 2048, 5080, 3, "full"),
    ("13b", 512, 16, 8192, 4952, 3, "full"),
    ("7b", 128, 6, 768, 10475, 3, "none"),
    ("7b", 512, 6, 3072, 9670, 3, "none"),
    ("3b", 128, 8, 1024, 23422, 2, "none"),
    ("3b", 512, 8, 4096, 21664, 2, "none"),
    ("1b", 128, 12, 1536, 44123, 2, "none"),
    ("1b", 512, 12, 6144, 39837, 2, "none"),
]


def llm_foundry() -> list[Published]:
    rows = []
    for name, gpus, micro, batch, tokens_per_s, zero, recompute in LLM_FOUNDRY_ROWS:
        dim, heads, layers = MPT[name]
        model = gpt(dim, layers, heads, 50368, 2048)
        layout = Layout(1, 1, gpus, 1, micro, zero, recompute, False)
        label, job, flops = f"MPT-{name} on {gpus}", (model, 2048, batch), palm_flops(num_params(model))
        rows.append(published(LLM_FOUNDRY, label, job, layout, flops, tokens_per_s_per_gpu=tokens_per_s))
    return rows


BLOOM = Source(
    name="BLOOM-176B, Megatron-DeepSpeed",
    where="bigscience-workshop/bigscience train/tr11-176B-ml (README, chronicles.md: 105.22 s per iteration)",
    convention="hardware FLOPs (SC'21 Eq. 3), % of 312 TFLOP/s; the iteration time as logged",
    # DeepSpeed's ZeRO-1 bf16 optimizer; the Megatron-DeepSpeed of 2022 had neither sequence parallelism nor
    # selective recomputation, and the run recomputed every block (its logged TFLOPs count it, SC'21 Eq. 3).
    # Its pipeline cuts 70 layers into 12 stages, so stages of unequal counts; DeepSpeed's pipeline engine
    # has no interleaved schedule.
    features=dataclasses.replace(
        MEGATRON_2021_SC21,
        zero_stages=(1,),
        uneven_stages=True,
        interleaved_min_pp=None,
        dp_overlap=False,  # DeepSpeed's ZeRO-1 reduces after the backward (no hooks: DeepSpeed PR 1246)
        pp_exchange="each",  # its pipeline engine's sends and receives, each a blocking call
    ),
    profile=dataclasses.replace(A100, inter_node_bytes_per_s=400e9 / 8 / 8),  # 4 x 100 Gb/s Omni-Path a node
    assumed="non-interleaved 1F1B; no sequence parallelism; 4 Omni-Path links of 100 Gb/s per node shared "
    "by its 8 GPUs; the 70 layers 6 a stage, 5 on the last two (the last beside the output layer); "
    "dropout, Megatron-DeepSpeed's default (tr11-176B-ml.slurm sets none)",
)


def bloom() -> list[Published]:
    model = gpt(14336, 70, 112, 250880, 2048)
    layout = Layout(4, 12, 8, 1, 2, 1, "full", False)
    label, job = "176B tp4 pp12 dp8 on 384", (model, 2048, 2048)
    return [published(BLOOM, label, job, layout, megatron_hardware_flops, step_s=105.22, dropout=True)]


LLAMA3 = Source(
    name="Llama 3 405B pre-training",
    where="Llama 3 paper (arXiv 2407.21783) Table 4: its rows at sequence 8,192 and its long-context row "
    "(sequence 131,072, context parallelism 16)",
    convention="BF16 model FLOPs (PaLM's: 6N + 12 L h s), % of 989 TFLOP/s",
    # FSDP keeping weights gathered; context parallelism all-gathers the keys and values, not overlapped.
    features=dataclasses.replace(MEGATRON_CORE, zero_stages=(2,), cp_overlap=False, uneven_stages=True),
    profile=H100,
    assumed="N = 405e9; interleaving with 2 virtual stages per rank (the paper does not give V), its "
    "126 layers one fewer on the first and the last stage (as the paper says: the stages balanced with "
    "the embedding and the output layer, `stage_split` 'params'); no "
    "recomputation (the paper says none at 8K); FSDP keeping weights gathered (ZeRO-2); at 131,072: DP 8, "
    "as 16,384 GPUs over TP 8 x CP 16 x PP 16 leave (the table's DP 4 multiplies out to 8,192), and 128 "
    "sequences a step (16M tokens, as on the other rows); its all-gather of keys and values priced as "
    "the ring's transfers (the same bytes), not overlapped (the paper calls its latency exposed, small "
    "beside the attention's work)",
)


def llama3() -> list[Published]:
    model = llama(16384, 126, 128, 8, 53248, 128256, 8192)
    rows = []
    for dp, tflops in ((64, 430), (128, 400)):
        layout = Layout(8, 16, dp, 2, 1, 2, "selective", True, stage_split="params")
        label, job = f"405B tp8 pp16 dp{dp} on {layout.devices:,}", (model, 8192, 2048)
        rows.append(published(LLAMA3, label, job, layout, palm_flops(405e9), tflops_per_gpu=tflops))
    long_context = llama(16384, 126, 128, 8, 53248, 128256, 131072)
    layout = Layout(8, 16, 8, 2, 1, 2, "selective", True, cp=16, stage_split="params")
    label = f"405B tp8 pp16 dp8 cp16 on {layout.devices:,}, sequence 131,072"
    job = (long_context, 131072, 128)  # 16M tokens a step, as on the rows at 8,192
    rows.append(published(LLAMA3, label, job, layout, palm_flops(405e9), tflops_per_gpu=380))
    return rows


def model_size(model: ModelConfig) -> str:
    billions = num_params(model) / 1e9
    return f"{billions:.0f}B" if billions >= 10 else f"{billions:.1f}B"


TABLES: tuple[Callable[[], list[Published]], ...] = (
    sc21,
    korthikanti,
    megatron_core,
    torchtitan,
    llm_foundry,
    bloom,
    llama3,
)


def validation_rows() -> list[Published]:
    return [row for table in TABLES for row in table()]


def error_summary(rows: list[Published]) -> tuple[float, float, float]:
    """The rows' mean absolute error, mean signed error and worst error, in points."""
    errors = [row.error_points for row in rows]
    return sum(map(abs, errors)) / len(errors), sum(errors) / len(errors), max(errors, key=abs)


def render_markdown() -> str:
    """Every validation row's published and predicted MFU, in its source's convention (docs/planning.md)."""
    rows = validation_rows()
    lines = [
        "| source | run | published step (s) | predicted step (s) | published MFU | predicted MFU | error "
        "(points) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        predicted = row.predict().step_s
        lines.append(
            f"| {row.source.name} | {row.label} | {row.step_s:.2f} | {predicted:.2f} | "
            f"{100 * row.mfu:.1f}% | {100 * row.predicted_mfu:.1f}% | {row.error_points:+.1f} |"
        )
    mean_abs, mean, worst = error_summary(rows)
    agreeing = sum(row.search_agrees() for row in rows)
    lines += [
        "",
        f"{len(rows)} rows: mean absolute error {mean_abs:.1f} points, mean signed error {mean:+.1f}, "
        f"worst {worst:+.1f}. The search, over the layouts each system can run, ranks the published layout "
        f"among its first five splits of the devices or predicts it within 3 points of its own pick on "
        f"{agreeing} of {len(rows)}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
