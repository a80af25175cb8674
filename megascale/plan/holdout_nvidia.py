"""Hold-out tables from NVIDIA: Megatron-Core with Transformer Engine, each row in the layout NVIDIA tuned
for it, checked after the validation set was fixed and never used to fit a constant (`megascale.plan.holdout`
collects every hold-out table; docs/planning.md, "Hold-out tables").

NeMo's pre-training table of its 24.07 container (NVIDIA/NeMo docs/source/performance/performance_summary.md,
August-September 2024): Megatron-Core on DGX-H100 in float8, each row with its TP, PP, CP and virtual
stages, priced as the validation set's Megatron-Core rows are (`megascale.plan.systems.MEGATRON_CORE`),
the blocks' linear layers in float8 with their casts as torchao makes them (`megascale.plan.compute`:
Transformer Engine casts less) and their inputs kept in float8 as Transformer Engine keeps them. Its
Nemotron rows are left out: the table gives no shapes for them.

NeMo's long-sequence table (NVIDIA/NeMo docs/source/performance/performance_long_sequence.md): Llama 2
7B in float8 on H100s (container 24.03.01) from 4,096 to 1,048,576 tokens, 4M tokens a step, on 4 to
1,024 GPUs with the TP, PP, DP and CP NVIDIA chose, priced as the 24.07 table's rows are. Its B200 table
is left out: its TP x PP x DP x CP comes to a quarter of its GPU counts.

Megatron-Bridge's table of the NeMo 25.11 container (NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md
at v0.2.2): Llama 3 8B and 70B and Llama 3.1 405B in float8 with current scaling (FP8-CS) on DGX-H100,
DGX-B200 and DGX-GB200, priced as the 24.07 table's rows are, on the datasheet profiles; Blackwell's
kernels at the fractions of peak measured on Hopper (`megascale.plan.hardware`: there is no Blackwell
measurement here); H100's 8B with Megatron's FSDP, recomputing 5 of its 32 blocks, and GB200's 70B with
it, offloading the activations of 40 of its 80 blocks (scripts/performance/configs/llama3 at v0.2.2).
Left out: the GB300 rows (no profile) and the block-scaled float8 figures in the table's parentheses. Its
Qwen3 mixture-of-experts rows (scripts/performance/configs/qwen3) are a table of their own; its
DeepSeek-V3 (latent attention) and GPT-OSS (attention sinks) rows are left out, their attention not
being one the planner prices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from megascale.config import AttentionConfig, ModelConfig, MoEConfig
from megascale.models.flops import attention_flops_per_token, flops_per_token, num_params
from megascale.plan.hardware import PROFILES
from megascale.plan.job import Layout
from megascale.plan.systems import MEGATRON_CORE
from megascale.plan.validation import (
    H100,
    LLAMA3_8B,
    Published,
    Source,
    gpt,
    llama,
    palm_flops,
    published,
)

LLAMA3_70B = llama(8192, 80, 64, 8, 28672, 128256, 8192)
LLAMA3_405B = llama(16384, 126, 128, 8, 53248, 128256, 8192)


def float8_row(
    source: Source, label: str, job: tuple[ModelConfig, int, int], layout: Layout, **figures: Any
) -> Published:
    """A row of these tables: a float8 run, its FLOPs counted as 6N + 12 L h s with N the model's
    parameters; `figures` are what its source gives (`published`'s keywords)."""
    return published(source, label, job, layout, palm_flops(num_params(job[0])), fp8=True, **figures)


NEMO_FP8_H100 = "NeMo 24.07 H100, float8"
NEMO = Source(
    name=NEMO_FP8_H100,
    where="NVIDIA/NeMo docs/source/performance/performance_summary.md (container 24.07, DGX-H100)",
    convention="6N + 12 L h s (N with the embeddings), which gives the table's model TFLOP/s within 2% "
    "(Llama 3 8B's within 6%); % of the 989 TFLOP/s bfloat16 peak",
    features=MEGATRON_CORE,
    profile=H100,
    assumed="the distributed optimizer (ZeRO-1); sequence parallelism with TP; no recomputation beyond "
    "FlashAttention's; the GPT-3 models' vocabulary padded to 50,304; the GPT-3 models with dropout and "
    "gradients reduced in bfloat16, the Llamas without dropout and in float32 (NeMo-Framework-Launcher's "
    "performance configs: hidden_dropout 0.1, distributed_fused_adam's grad_sync_dtype bf16)",
)
LLAMA2_7B = llama(4096, 32, 32, 32, 11008, 32000, 4096)
# (name, model, GPUs, global batch, micro-batch, TP, PP, CP, virtual stages, tokens/s per GPU)
NEMO_ROWS = [
    ("GPT-3 5B", gpt(4096, 24, 32, 50304, 2048), 64, 2048, 4, 1, 1, 1, 1, 22521),
    ("GPT-3 20B", gpt(6144, 44, 48, 50304, 2048), 64, 256, 2, 2, 1, 1, 1, 5851),
    ("GPT-3 175B", gpt(12288, 96, 96, 50304, 2048), 128, 256, 1, 4, 8, 1, 6, 726),
    ("GPT-3 175B", gpt(12288, 96, 96, 50304, 2048), 512, 2048, 2, 4, 8, 1, 6, 782),
    ("Llama 2 7B", LLAMA2_7B, 8, 128, 1, 1, 1, 1, 1, 16847),
    ("Llama 2 13B", llama(5120, 40, 40, 40, 13824, 32000, 4096), 16, 128, 1, 1, 4, 1, 10, 8646),
    ("Llama 2 70B", llama(8192, 80, 64, 8, 28672, 32000, 4096), 64, 128, 1, 4, 4, 1, 20, 1707),
    ("Llama 3 8B", LLAMA3_8B, 8, 128, 1, 1, 1, 2, 1, 12036),
    ("Llama 3 70B", LLAMA3_70B, 64, 128, 1, 4, 4, 2, 5, 1533),
]


def nemo_rows() -> list[Published]:
    rows = []
    for name, model, gpus, batch, micro, tp, pp, cp, chunks, tokens_per_s in NEMO_ROWS:
        layout = Layout(tp, pp, gpus // (tp * pp * cp), chunks, micro, 1, "selective", tp > 1, cp=cp)
        label, job = f"{name} {layout.describe()}", (model, model.max_seq_len, batch)
        # NeMo-Framework-Launcher's GPT-3 performance configs: hidden_dropout 0.1, and distributed_fused_adam
        # with grad_sync_dtype bf16; its Llamas: no dropout, float32 gradients.
        gpt3 = name.startswith("GPT-3")
        rows.append(
            float8_row(
                NEMO,
                label,
                job,
                layout,
                tokens_per_s_per_gpu=tokens_per_s,
                dropout=gpt3,
                grad_bytes=2 if gpt3 else 4,
            )
        )
    return rows


NEMO_LONG_H100 = "NeMo 24.03 H100, float8, Llama 2 7B at 4K-1M tokens"
NEMO_LONG = dataclasses.replace(
    NEMO,
    name=NEMO_LONG_H100,
    where="NVIDIA/NeMo docs/source/performance/performance_long_sequence.md (May 2025 revision), 'LLAMA2-7B "
    "(FP8) - H100' (container 24.03.01, DGX-H100), its runs with context parallelism",
    convention="model TFLOP/s per GPU as NeMo counts them (its Llama formula: 6N without the input "
    "embedding, attention's 12 L h s unhalved), % of the 989 TFLOP/s bfloat16 peak",
    assumed=f"{NEMO.assumed}; micro-batches of 1",
)
# Llama 2 7B in float8, 4M tokens a step at every length: (sequence, GPUs, TP, PP, DP, CP, TFLOP/s per GPU).
LLAMA2_7B_LONG_ROWS = [
    (4096, 4, 1, 1, 4, 1, 768),
    (8192, 8, 1, 2, 4, 1, 730),
    (16384, 16, 2, 1, 8, 1, 660),
    (32768, 32, 2, 1, 8, 2, 610),
    (65536, 64, 4, 1, 8, 2, 574),
    (131072, 128, 4, 1, 8, 4, 555),
    (262144, 256, 4, 1, 8, 8, 549),
    (524288, 512, 8, 1, 4, 16, 549),
    (1048576, 1024, 8, 1, 4, 32, 536),
]


def nemo_long_rows() -> list[Published]:
    rows = []
    for seq_len, gpus, tp, pp, dp, cp, tflops in LLAMA2_7B_LONG_ROWS:
        assert tp * pp * dp * cp == gpus, (seq_len, gpus)
        model = dataclasses.replace(LLAMA2_7B, max_seq_len=seq_len)
        layout = Layout(tp, pp, dp, 1, 1, 1, "selective", tp > 1, cp=cp)
        label, job = f"Llama 2 7B at {seq_len:,} {layout.describe()}", (model, seq_len, 2**22 // seq_len)
        rows.append(float8_row(NEMO_LONG, label, job, layout, tflops_per_gpu=tflops))
    return rows


BRIDGE_H100 = "Megatron-Bridge 25.11 H100, float8"
BRIDGE_BLACKWELL = "Megatron-Bridge 25.11 B200 and GB200, float8"
BRIDGE = dataclasses.replace(
    NEMO,
    # Megatron-Core cuts layers into unequal stages since September 2024 (first and last stages' layer
    # counts, Megatron-LM commit fa8bb5921b), with virtual stages since February 2025 (ef490839e8).
    features=dataclasses.replace(MEGATRON_CORE, uneven_stages=True),
    name=BRIDGE_H100,
    where="NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md at v0.2.2, '25.11 NeMo Container' "
    "(DGX-H100, DGX-B200, DGX-GB200), FP8-CS rows",
    convention="6N + 12 L h s (N with the embeddings), % of the device's bfloat16 peak (989, 2,250 and "
    "2,500 TFLOP/s)",
    assumed="the distributed optimizer (ZeRO-1); sequence parallelism with TP; no recomputation beyond "
    "FlashAttention's; no dropout; gradients reduced in bfloat16 (its Llama configs set "
    "grad_reduce_in_fp32 False); the virtual stages the table gives, layers cut as evenly as they go; "
    "the datasheet profiles (B200 at 1,000 W, GB200 at 1,200 W, 72 GPUs in one NVLink "
    "domain); CUDA graphs not priced (a GPU's launches cost nothing here)",
)


class BridgeRun(NamedTuple):
    """One row of Megatron-Bridge's 25.11 table and what its config sets: `chunks` its virtual stages; for
    a Llama row `fsdp` (Megatron's FSDP, ZeRO-3) and the blocks of a chunk it recomputes whole or whose
    activations it offloads (0: none); for a Qwen3 row its expert-parallel ranks, whether its linear
    layers ran in float8, and `a2a_overlap`, its moe_a2a_overlap (each micro-batch's all-to-alls beside
    another's block)."""

    device: str
    name: str
    model: ModelConfig
    gpus: int
    batch: int
    micro: int
    tp: int
    pp: int
    chunks: int
    tokens_per_s: float  # per GPU, as published
    cp: int = 1
    fsdp: bool = False
    recomputed: int = 0
    offloaded: int = 0
    ep: int = 1
    fp8: bool = True
    a2a_overlap: bool = False


BRIDGE_ROWS = [
    BridgeRun("h100", "Llama 3 8B", LLAMA3_8B, 8, 128, 1, 1, 1, 1, 14451, fsdp=True, recomputed=5),
    BridgeRun("h100", "Llama 3 70B", LLAMA3_70B, 64, 128, 1, 4, 8, 5, 1602),
    BridgeRun("h100", "Llama 3.1 405B", LLAMA3_405B, 1024, 512, 1, 8, 8, 8, 292, cp=2),
    BridgeRun("b200", "Llama 3 8B", LLAMA3_8B, 8, 128, 2, 1, 1, 1, 30624),
    BridgeRun("b200", "Llama 3.1 405B", LLAMA3_405B, 128, 64, 1, 4, 8, 8, 661, cp=2),
    BridgeRun("gb200", "Llama 3 8B", LLAMA3_8B, 8, 128, 2, 1, 1, 1, 31508),
    BridgeRun("gb200", "Llama 3 70B", LLAMA3_70B, 64, 256, 2, 1, 1, 1, 4312, fsdp=True, offloaded=40),
    BridgeRun("gb200", "Llama 3.1 405B", LLAMA3_405B, 256, 1536, 1, 4, 16, 4, 813),
]


def bridge_rows(devices: tuple[str, ...]) -> list[Published]:
    rows = []
    for run in BRIDGE_ROWS:
        if run.device not in devices:
            continue
        profile = PROFILES[run.device]
        table = BRIDGE_H100 if run.device == "h100" else BRIDGE_BLACKWELL
        source = dataclasses.replace(BRIDGE, name=table, profile=profile)
        dp = run.gpus // (run.tp * run.pp * run.cp)
        layout = Layout(
            run.tp,
            run.pp,
            dp,
            run.chunks,
            run.micro,
            3 if run.fsdp else 1,
            "full" if run.recomputed else "selective",
            run.tp > 1,
            cp=run.cp,
            offload=bool(run.offloaded),
            recompute_blocks=run.recomputed,
            offload_blocks=run.offloaded,
        )
        label, job = f"{run.name} on {profile.name} {layout.describe()}", (run.model, 8192, run.batch)
        rows.append(
            float8_row(source, label, job, layout, tokens_per_s_per_gpu=run.tokens_per_s, grad_bytes=2)
        )
    return rows


def qwen3_moe(dim: int, layers: int, heads: int, expert_dim: int) -> ModelConfig:
    """A Qwen3 MoE model (its Hugging Face config): 128 experts, top-8, no shared expert, 4 key-value heads
    of 128, QK-norm, untied embeddings; routing forced even, as the benchmark forces it (each expert its
    mean: a capacity of 1 drops nothing there)."""
    return ModelConfig(
        dim=dim,
        n_layers=layers,
        vocab_size=151936,
        max_seq_len=4096,
        tie_embeddings=False,
        attention=AttentionConfig(n_heads=heads, n_kv_heads=4, head_dim=128, qk_norm=True),
        moe=MoEConfig(experts=128, top_k=8, expert_dim=expert_dim, capacity_factor=1.0),
    )


def causal_model_flops(model: ModelConfig, seq_len: int) -> float:
    """NVIDIA's model FLOPs a token: 6 x the parameters a token uses (the output layer's too), and causal
    attention at half the square (what its tokens/s and TFLOP/s columns imply, within 1%)."""
    return flops_per_token(model, seq_len) - attention_flops_per_token(model, seq_len) / 2


BRIDGE_MOE = "Megatron-Bridge 25.11, Qwen3 MoE"
QWEN3_30B_A3B = qwen3_moe(2048, 48, 32, 768)
QWEN3_235B_A22B = qwen3_moe(4096, 94, 64, 1536)


BRIDGE_MOE_ROWS = [
    BridgeRun("h100", "Qwen3 30B-A3B", QWEN3_30B_A3B, 16, 512, 2, 1, 2, 24, 5275, ep=8, a2a_overlap=True),
    BridgeRun(
        "h100", "Qwen3 235B-A22B", QWEN3_235B_A22B, 256, 2048, 1, 2, 8, 4, 1575, ep=32, a2a_overlap=True
    ),
    BridgeRun("b200", "Qwen3 30B-A3B", QWEN3_30B_A3B, 8, 512, 1, 1, 1, 1, 9299, ep=8),
    BridgeRun("b200", "Qwen3 235B-A22B", QWEN3_235B_A22B, 64, 1024, 1, 1, 8, 2, 3269, ep=8, a2a_overlap=True),
    BridgeRun("gb200", "Qwen3 30B-A3B", QWEN3_30B_A3B, 8, 512, 4, 1, 1, 1, 23766, ep=8),
    BridgeRun("gb200", "Qwen3 235B-A22B", QWEN3_235B_A22B, 256, 8192, 1, 1, 8, 3, 4916, ep=32, fp8=False),
]
MOE_FEATURES = dataclasses.replace(
    BRIDGE.features,
    moe_tp=("split", "ep"),
    moe_attention="tp",
    moe_weighted_activation=True,
    loss_bytes_per_logit=4,
)


def bridge_moe_rows() -> list[Published]:
    rows = []
    for run in BRIDGE_MOE_ROWS:
        features = dataclasses.replace(MOE_FEATURES, ep_overlap="batch" if run.a2a_overlap else "none")
        profile = PROFILES[run.device]
        source = dataclasses.replace(BRIDGE_MOE_SOURCE, profile=profile, features=features)
        dp, moe_tp = run.gpus // (run.tp * run.pp), "ep" if run.tp > 1 else "split"
        layout = Layout(
            run.tp, run.pp, dp, run.chunks, run.micro, 1, "none", run.tp > 1, ep=run.ep, moe_tp=moe_tp
        )
        label, job = f"{run.name} on {profile.name} {layout.describe()}", (run.model, 4096, run.batch)
        rows.append(
            published(
                source,
                label,
                job,
                layout,
                causal_model_flops,
                tokens_per_s_per_gpu=run.tokens_per_s,
                fp8=run.fp8,
                grad_bytes=2,
            )
        )
    return rows


BRIDGE_MOE_SOURCE = dataclasses.replace(
    BRIDGE,
    name=BRIDGE_MOE,
    where="NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md at v0.2.2, '25.11 NeMo Container', "
    "its Qwen3 rows (DGX-H100, DGX-B200, DGX-GB200); scripts/performance/configs/qwen3 at that tag",
    convention="6 x the parameters a token uses + causal attention at half the square (NVIDIA's model "
    "TFLOP/s), % of the device's bfloat16 peak",
    assumed="as for its Llama rows; the table's float8 (FP8-CS on H100, block-scaled FP8-MX on B200 and "
    "GB200's 30B) for the attention's linear layers only, the experts' GEMMs in bfloat16 as the planner "
    "prices every MoE layer (Transformer Engine runs them in float8); routing forced even "
    "(moe_router_force_load_balancing), dropless; experts over the tp ranks too where TP > 1 "
    "(expert_tensor_parallel_size 1); Transformer Engine's fused cross entropy (bfloat16 logits); "
    "moe_a2a_overlap as each all-to-all beside another micro-batch's block; CUDA graphs and the "
    "dispatcher backends not priced",
)


# Each table by name, and how its rows are made (`megascale.plan.holdout.HOLDOUT_TABLES`).
NVIDIA_TABLES = {
    NEMO_FP8_H100: nemo_rows,
    NEMO_LONG_H100: nemo_long_rows,
    BRIDGE_H100: lambda: bridge_rows(("h100",)),
    BRIDGE_BLACKWELL: lambda: bridge_rows(("b200", "gb200")),
    BRIDGE_MOE: bridge_moe_rows,
}
