"""The parallel section: the 3D layout, its process groups and MegaScale's communication overlap."""

from __future__ import annotations

from dataclasses import dataclass

from megascale.options import option, section

# The zero-bubble pipeline schedules: two stages a rank, in a V (parallel/pipeline.py).
V_SCHEDULES = ("zbv", "dualpipev")


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
    ep: bool = option(
        True,
        "Expert parallelism: each MoE layer's token slots travel in 2 chunks, both dispatched at once; a "
        "chunk's expert compute runs while the other chunk's dispatch or combine all-to-all is in flight, "
        "forward and backward (MegaScale-MoE's overlap of the all-to-all with the experts' GEMMs); off: "
        "one synchronous dispatch and combine.",
    )
    cp: bool = option(
        True,
        "Context parallelism: each ring step's keys and values are sent to the next rank while the current "
        "step's attention blocks are computed, and in the backward the key and value gradients summed by "
        "the ranks before arrive while this step's blocks compute its share; off: sent and waited for "
        "between the steps.",
    )
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
    ep: int = option(
        1,
        "Expert-parallel degree (MoE models): the routed experts are split over ep of the dp_shard ranks "
        "and each token slot is sent to its expert's rank by all-to-all; must divide dp_shard and "
        "model.moe.experts. The experts' weights are sharded by FSDP over the remaining dp_shard / ep.",
        ge=1,
    )
    moe_tp: str = option(
        "whole",
        "How an MoE layer uses the tensor-parallel ranks (tp > 1): 'whole' computes the layer whole on "
        "every tp rank, on the whole sequence; 'ep' makes them expert-parallel ranks for it "
        "(MegaScale-MoE's layout): each routes its own 1/tp of the sequence and the routed experts are "
        "split over ep x tp ranks (must divide model.moe.experts), so no tp rank repeats another's work. "
        "Routing, capacity and the balancing loss still count whole sequences.",
        choices=("whole", "ep"),
    )
    ep_comm_dtype: str = option(
        "float32",
        "Precision of the expert-parallel all-to-all payload, tokens and expert outputs forward and their "
        "gradients backward (MegaScale-MoE's compressed communication): float32 (exact); bfloat16 (half "
        "the bytes, rounded); or float8_e4m3fn (half of bfloat16's bytes plus a float32 scale per 128 "
        "channels of a row: each block scaled by its largest magnitude to e4m3's range, cast to fp8, and "
        "dequantized on arrival, so sums stay in the compute dtype).",
        choices=("float32", "bfloat16", "float8_e4m3fn"),
    )
    cp: int = option(
        1,
        "Context-parallel degree: every sequence is split over cp of the dp_shard ranks, which read the "
        "same batch; each holds 2 chunks of it (one from the front, its mirror from the back, so that "
        "causal attention's work is even) and attention passes keys and values around their ring. Must "
        "divide dp_shard; data.seq_len must divide by 2 x cp. Parameters stay FSDP-sharded over all "
        "dp_shard ranks.",
        ge=1,
    )
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
    pp_schedule: str = option(
        "1f1b",
        "Pipeline schedule: 1F1B, interleaved 1F1B (looped stages), GPipe, or a zero-bubble schedule on "
        "V-shaped stages (rank r holds stages r and 2 pp - 1 - r; the weight gradients fill the bubble): "
        "'zbv' (ZB-V) or 'dualpipev' (DeepSeek's DualPipeV, at least 2 pp micro-batches); neither beside tp.",
        choices=("1f1b", "interleaved_1f1b", "gpipe", *V_SCHEDULES),
    )
    pp_virtual_stages: int = option(
        1,
        "Model chunks per pipeline rank; more than 1 needs pp_schedule = 'interleaved_1f1b', and 'zbv' and "
        "'dualpipev' need exactly 2.",
        ge=1,
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
    activation_offload: bool = option(
        False,
        "Move what each block keeps for its backward off the device during the forward and fetch it back "
        "in the backward: to pinned host memory on an accelerator, fetched one block ahead; to a spill file "
        "in $TMPDIR on CPU, read when autograd asks. With activation_checkpoint = 'full' it offloads the one "
        "input each block keeps.",
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
