"""What each published system could run, as `Features`: the validation and hold-out sources' systems.

Megatron-LM as SC'21 and Korthikanti et al. ran it (2021-2022), Megatron-Core (2024), PyTorch's FSDP and
torchtitan. The planner predicts a published row under its system's features, and its search ranks only
the layouts that system could run (docs/planning.md, "Validation set"); each choice names its source.
"""

from __future__ import annotations

import dataclasses

from megascale.plan.job import MEGATRON, Features

# Megatron-LM as it ran in 2021-2022: no overlap of pipeline communication, attention over materialised
# scores, data parallelism without a distributed optimizer, a host stall per step (the MegaScale paper's
# baseline, before FlashAttention). The gradient all-reduce goes behind the backward without a pipeline,
# where it ran torch's DDP, and after it with one, where it ran its own (SC'21's scripts, run_table_1.sh:
# DDP=torch for pp = 1, DDP=local otherwise; only its schedule without a pipeline defers DDP's sync to
# the last micro-batch).
MEGATRON_2021 = dataclasses.replace(
    MEGATRON,
    attention_kernel="materialized",
    zero_stages=(0,),
    dp_overlap=True,
    dp_overlap_pipelined=False,
)
# ... in 2022, with the column-parallel layers' backward collectives behind their gradient GEMMs
# (September 2021 for the all-reduce, March 2022 for sequence parallelism's gather and reduce-scatter).
MEGATRON_2022 = dataclasses.replace(MEGATRON_2021, tp_backward_overlap=True)
# ... as SC'21 ran it: before sequence parallelism and selective recomputation (Korthikanti et al. 2022),
# and every run recomputing whole blocks, as its hardware FLOPs (Eq. 3) count the recomputed forward.
MEGATRON_2021_SC21 = dataclasses.replace(MEGATRON_2021, sequence_parallel=False, recomputes=("full",))
# Megatron-Core in 2024: data-, tensor- and pipeline-parallel communication overlapped, fused kernels
# (Transformer Engine's: fused attention, ring attention's transfers behind the blocks, float8 inputs).
MEGATRON_CORE = Features(
    tp_overlap=True,
    tp_overlap_attention=True,
    pp_overlap=True,
    dp_overlap=True,
    cp_overlap=True,
    fused_kernels=True,
    zero_stages=(1,),  # the distributed optimizer
    host_overhead_s=0.2,
    float8_keeps_inputs=True,
    partial_recompute=True,
    # Virtual stages at pp = 2 since Megatron-LM 3ee489d9ea (May 2024, in core_r0.8.0), where the
    # pipeline's transfers overlap (`overlap_p2p_comm`, on by default); pp > 2 before, and without it.
    interleaved_min_pp=2,
)
# FSDP (PyTorch's, in torchtitan and Composer, uncompiled): per-block all-gathers prefetched, reduce-
# scatters behind the backward, FlashAttention-2 (torch's SDPA ran it on Hopper too in late 2024,
# pytorch/pytorch#141133), element-wise operators one kernel each.
FSDP = Features(
    dp_overlap=True,
    attention_kernel="flash2",
    dp_sync_per_micro_batch=True,
    host_overhead_s=0.2,
    grads_as_made=True,
)
# torchtitan's FSDP2, whose selective recomputation is per operator ("op": every second matmul of a block
# and its element-wise operators recomputed, `megascale.plan.compute`), uncompiled: its Llama's RMSNorm
# and RoPE run as composite float32 operators, each a pass through memory.
TORCHTITAN = dataclasses.replace(FSDP, recomputes=("none", "op", "full"), elementwise="eager")
