"""The training systems the planner knows, as `Features`: what each overlaps, fuses and can run.

One table serves `megascale plan --system NAME` and the validation against published runs
(`megascale.plan.validation`): a published run names its system as the command line does, and its data
file says where the run differs from it (an older release, a setting of the run).
"""

from __future__ import annotations

import dataclasses

from megascale.plan.job import Features

# Megatron-LM as the MegaScale paper ran it for its baseline (arXiv:2402.15627 §6.1): none of the paper's
# overlaps, FlashAttention, and a host stall a step: Table 3's "misc optimizations" step removed about
# 0.2 s of about 13 s (+1.1 MFU points) by hiding data loading and garbage collection.
MEGATRON = Features(host_overhead_s=0.2)
# MegaScale (arXiv:2402.15627 §3): the TP, PP and DP overlaps of §3.2, fused kernels of §3.3, asynchronous
# data of §3.4; megascale's own overlaps of context and expert parallelism (MegaScale-MoE,
# arXiv:2505.11432 §4: the tp ranks as the expert-parallel group).
MEGASCALE = Features(
    tp_overlap=True, pp_overlap=True, dp_overlap=True, cp_overlap=True, ep_overlap="both", moe_tp=("ep",),
    fused_kernels=True, async_data=True, host_overhead_s=0.2, uneven_stages=True,
)  # fmt: skip
# Megatron-Core (https://github.com/NVIDIA/Megatron-LM/tree/core_r0.8.0, 2024): DP, TP, PP and CP
# communication overlapped, Transformer Engine's fused kernels (fused attention, float8 inputs kept in
# float8), the distributed optimizer (ZeRO-1); virtual stages from pp = 2 since commit 3ee489d9ea (May
# 2024), where the pipeline's transfers overlap.
MEGATRON_CORE = Features(
    tp_overlap=True, tp_overlap_attention=True, pp_overlap=True, dp_overlap=True, cp_overlap=True,
    fused_kernels=True, zero_stages=(1,), host_overhead_s=0.2, float8_keeps_inputs=True, interleaved_min_pp=2,
)  # fmt: skip
# PyTorch's FSDP (torchtitan's FSDP2, Composer's FSDP): per-block all-gathers prefetched, reduce-scatters
# behind the backward, every micro-batch; torch's SDPA, which ran FlashAttention-2 on Hopper in late 2024
# (https://github.com/pytorch/pytorch/issues/141133); a host stall a step, as MEGATRON's.
FSDP = Features(
    dp_overlap=True, dp_sync_per_micro_batch=True, attention_kernel="flash2", host_overhead_s=0.2,
    grads_as_made=True,
)  # fmt: skip
# torchtitan (https://github.com/pytorch/torchtitan, 2024): FSDP2 with TP, PP (torch's schedules:
# interleaved from pp 2, layers cut unevenly) and CP (the next ring step's keys and values sent while the
# current one computes); per-operator selective recomputation ("op"); uncompiled, its RMSNorm and RoPE
# run as composite float32 operators (`Features.elementwise` "eager").
TORCHTITAN = dataclasses.replace(
    FSDP, recomputes=("none", "op", "full"), elementwise="eager", uneven_stages=True, interleaved_min_pp=2,
    cp_overlap=True,
)  # fmt: skip
# MosaicML llm-foundry (Composer's FSDP alone): its triton FlashAttention (FlashAttention-1's algorithm,
# the benchmark script's default `--attn_impl`) and flash-attn's fused cross entropy, which keeps bfloat16
# logits and makes a bfloat16 gradient (https://github.com/mosaicml/llm-foundry/tree/main/scripts/train/
# benchmarking).
LLM_FOUNDRY = dataclasses.replace(
    FSDP, model_parallel=False, attention_kernel="flash", loss_bytes_per_logit=4
)
# Megatron-DeepSpeed as BLOOM-176B ran it in 2022 (https://github.com/bigscience-workshop/bigscience/tree/
# master/train/tr11-176B-ml): attention over materialised scores, no sequence parallelism or selective
# recomputation, DeepSpeed's ZeRO-1, which reduces after the backward (no backward hooks:
# microsoft/DeepSpeed PR 1246), and its pipeline engine, which cuts stages unevenly and does not interleave.
DEEPSPEED = Features(
    attention_kernel="materialized", zero_stages=(1,), sequence_parallel=False, recomputes=("full",),
    host_overhead_s=0.2, uneven_stages=True, interleaved_min_pp=None,
)  # fmt: skip
# megascale's own trainer as it runs today (megascale/parallel/parallelize.py): FSDP2 synchronising every
# micro-batch, no overlap modelled (on a CPU, gloo's collectives and the compute share the cores), torch's
# SDPA, its own model's activations (`memory.trainer_block_bytes`).
TRAINER = Features(
    dp_sync_per_micro_batch=True, attention_kernel="fused", moe_tp=("whole", "ep"), moe_attention="tp",
    pp_scatter_gather=False, own_blocks=True, uneven_stages=True, interleaved_min_pp=2, grads_as_made=True,
)  # fmt: skip

# By the names `megascale plan --system` takes (`megascale.plan.command.SYSTEM_NAMES`).
SYSTEMS: dict[str, Features] = {
    "megascale": MEGASCALE,
    "megatron-lm": MEGATRON,
    "megatron-core": MEGATRON_CORE,
    "deepspeed": DEEPSPEED,
    "torchtitan": TORCHTITAN,
    "llm-foundry": LLM_FOUNDRY,
    "trainer": TRAINER,
}
