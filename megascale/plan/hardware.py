"""Hardware profiles for the cost model: one table of accelerators with their sources, and this CPU.

A profile holds what the step model (`megascale.plan.step`) needs to turn FLOPs and bytes into seconds:
peak FLOP/s per dtype, HBM size and bandwidth, intra- and inter-node bandwidth and latency per device, and
devices per node. The GPU figures are vendor datasheet numbers, not measurements (docs/gpu.md holds what
one H100 measured; no link between GPUs has been); the CPU profile is built only from what `megascale
calibrate` measured on this machine and refuses to exist before that. Peak FLOP/s come from the same table
MFU uses (`megascale.observe.peak`), so a planned MFU and a measured one divide by the same number.

Bandwidths are per device and per direction. Inter-node bandwidth is the device's own NIC: the MegaScale
servers have eight 200 Gb/s NICs wired multi-rail, one per GPU (paper §3.6), as DGX-class A100/H100
servers do (one 200 or 400 Gb/s NIC per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megascale.errors import ConfigError
from megascale.observe.peak import PEAK_TFLOPS


@dataclass(frozen=True)
class HardwareProfile:
    """One device type and the network around it; every bandwidth is bytes/s per device per direction."""

    name: str
    peak_tflops: dict[str, float]
    hbm_bytes: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    intra_node_latency_s: float
    inter_node_latency_s: float
    devices_per_node: int
    nodes_per_pod: int
    gemm_efficiency: float  # fraction of peak a large GEMM reaches
    gemm_half_flops: float  # GEMM size (FLOPs) at which it reaches half of gemm_efficiency
    # Fraction of peak of the device's fastest fused attention kernel (FlashAttention-2 on Ampere, cuDNN's
    # on Hopper), and its work (FLOPs, forward + backward) at half that fraction; 0: any size.
    attention_efficiency: float
    attention_half_flops: float
    flash2_attention_speed: float  # FlashAttention-2's rate as a fraction of that kernel's
    # An MoE layer's experts as one grouped GEMM per projection: the fraction it reaches of the rate the
    # GEMM curve above gives a GEMM of one expert's shape, and what the layer's other operators (router,
    # sort, gather, scatter) add to its time, as a fraction of the grouped GEMMs' (plan/experts.py).
    grouped_gemm_efficiency: float
    moe_operator_overhead: float
    # A float8 GEMM's fraction of the float8 peak, as a share of the fraction the GEMM curve above gives
    # a bf16 GEMM of the same shape of the bf16 peak.
    float8_gemm_efficiency: float
    network_efficiency: float  # fraction of the link bandwidth a collective achieves (bus bandwidth)
    source: str
    # What only a CPU profile measures (`megascale.plan.profiles`, from `megascale calibrate`); a GPU's
    # launches run ahead of the device, so none of it is on a GPU's critical path.
    host_cores: int = 0  # cores the devices of a node share (a CPU's processes); 0: each computes alone
    layer_overhead_s: float = 0.0  # host time per block per micro-batch the device cannot hide
    model_overhead_s: float = 0.0  # the same for the rest of the model (embedding, output layer, loss)
    tp_layer_overhead_s: float = 0.0  # the same, added by tensor parallelism's operator dispatch
    # ... and what it adds per byte of a micro-batch's activations (tokens x hidden) beyond its share of
    # the compute: its copies and transfers where they take the cores that compute (gloo on a CPU).
    # A profile that measures it has its TP communication inside these host times (tp_comm_measured).
    tp_layer_overhead_s_per_byte: float = 0.0
    tp_comm_measured: bool = False
    dp_layer_overhead_s: float = 0.0  # the same, added by sharded data parallelism's per-block hooks
    tp_model_overhead_s: float = 0.0  # what tensor parallelism adds to the rest of the model
    dp_model_overhead_s: float = 0.0  # what sharded data parallelism adds to the rest of the model
    # Host time of the step's update (gradient norm, clipping, optimizer step) per block a device holds,
    # for the rest of the model, and what DTensor tensor parallelism and FSDP add to each:
    update_layer_overhead_s: float = 0.0
    update_model_overhead_s: float = 0.0
    tp_update_layer_overhead_s: float = 0.0
    dp_update_layer_overhead_s: float = 0.0
    tp_update_model_overhead_s: float = 0.0
    dp_update_model_overhead_s: float = 0.0

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak_tflops:
            asked = "--fp8 or training.fp8" if dtype == "float8" else "--dtype"
            raise ConfigError(
                f"plan: {self.name} has no {dtype} peak (asked by {asked}; known: "
                f"{', '.join(self.peak_tflops)}); choose another --hardware or precision"
            )
        return self.peak_tflops[dtype] * 1e12


def _peaks(device: str) -> dict[str, float]:
    return {dtype: tflops for (needle, dtype), tflops in PEAK_TFLOPS.items() if needle == device}


# The calibration constants, the same for every GPU profile (docs/planning.md, "Calibration constants").
# A large bf16 GEMM's fraction of the tensor-core peak: the one constant fitted, on MegaScale's published
# Table 2 and Figure 9 (arXiv:2402.15627); one H100 measured 0.73-0.76 for lone large GEMMs
# (docs/gpu.md#6-kernel-efficiency-at-the-planners-shapes), where the step's GEMMs share the device with
# communication kernels.
GEMM_EFFICIENCY = 0.68
# The GEMM size at half that fraction (a launch and tail of 2e9 FLOPs at the large-GEMM rate): the curve
# it gives was checked against the H100's GEMMs of 11-1,100 GFLOPs, reading 0.58-0.68 where they measured
# 0.54-0.76 (docs/gpu.md#6-kernel-efficiency-at-the-planners-shapes).
GEMM_HALF_FLOPS = 2e9
# FlashAttention-2 forward + backward reaches 50-73% of an A100's peak (Dao 2023, arXiv:2307.08691,
# Fig. 6); the Ampere profiles take the low end, FlashAttention-2 being Ampere's fastest kernel.
AMPERE_ATTENTION_EFFICIENCY = 0.55
AMPERE_FLASH2_ATTENTION_SPEED = 1.0
# Causal attention (torch's SDPA) forward + backward on one H100 at sequence 8,192, head size 128: 0.24 of
# peak with 4 heads and 0.40 with 32, which e(f) = 0.45 f / (f + 1.7e11) passes through (f: the kernel's
# FLOPs); an H200 measured 0.48-0.50 at 16,384-65,536 (docs/gpu.md#6-kernel-efficiency-at-the-planners-
# shapes, docs/gpu.md#9-attention-beyond-sequence-8192-on-an-h200).
HOPPER_ATTENTION_EFFICIENCY = 0.45
HOPPER_ATTENTION_HALF_FLOPS = 1.7e11
# FlashAttention-2 on an H100 SXM5 runs at 0.61-0.63 of cuDNN's fused attention (causal, head size 128,
# forward, sequences 512 to 16k: 191-335 against 315-539 TFLOP/s; Shah et al. 2024, FlashAttention-3,
# arXiv:2407.08608, Fig. 5); torch's SDPA ran it there in late 2024 (pytorch/pytorch#141133,
# https://github.com/pytorch/pytorch/issues/141133).
HOPPER_FLASH2_ATTENTION_SPEED = 0.62
# An MoE layer's grouped GEMMs on one H100 at the two shapes of MegaScale-MoE's 352B model ran at 0.64 and
# 0.63 of the rate the GEMM curve gives a GEMM of one expert's shape, and the layer's other operators added
# 0.22-0.29 of their time (docs/gpu.md#6-kernel-efficiency-at-the-planners-shapes).
GROUPED_GEMM_EFFICIENCY = 0.64
MOE_OPERATOR_OVERHEAD = 0.25
# Float8 GEMMs (cuBLAS through torch._scaled_mm, per-tensor scales) at the shapes of 8 linear layers of
# published float8 runs on one H200: 0.83-1.05, mean 0.92, of the fraction of the float8 peak that the
# GEMM curve gives bf16 (docs/gpu.md#8-float8-on-an-h200).
FLOAT8_GEMM_EFFICIENCY = 0.92
# NCCL's all-reduce bus bandwidth over 8 A100s' NVLink: 230-250 GB/s of the link's 300 (nccl-tests,
# https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests).
NETWORK_EFFICIENCY = 0.80
# Latency of one ring step (Ring, Simple protocol) over NVLink and over the network, as NCCL's own tuning
# model takes them (hwLatencies, https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc).
NVLINK_LATENCY_S = 3.4e-6
NETWORK_LATENCY_S = 14e-6
# 8 GPUs to a server (NVIDIA DGX A100 datasheet, NVIDIA DGX H100 datasheet); 64 servers share one set of
# ToR switches (MegaScale, arXiv:2402.15627 §3.6).
GPUS_PER_NODE = 8
NODES_PER_POD = 64

_GPU: dict[str, Any] = dict(
    gemm_efficiency=GEMM_EFFICIENCY,
    gemm_half_flops=GEMM_HALF_FLOPS,
    attention_efficiency=AMPERE_ATTENTION_EFFICIENCY,
    attention_half_flops=0.0,
    flash2_attention_speed=AMPERE_FLASH2_ATTENTION_SPEED,
    grouped_gemm_efficiency=GROUPED_GEMM_EFFICIENCY,
    moe_operator_overhead=MOE_OPERATOR_OVERHEAD,
    float8_gemm_efficiency=FLOAT8_GEMM_EFFICIENCY,
    network_efficiency=NETWORK_EFFICIENCY,
    intra_node_latency_s=NVLINK_LATENCY_S,
    inter_node_latency_s=NETWORK_LATENCY_S,
    devices_per_node=GPUS_PER_NODE,
    nodes_per_pod=NODES_PER_POD,
)
# Hopper's attention as measured there; Blackwell has no measurement of its own here and takes Hopper's.
_HOPPER: dict[str, Any] = {
    **_GPU,
    "attention_efficiency": HOPPER_ATTENTION_EFFICIENCY,
    "attention_half_flops": HOPPER_ATTENTION_HALF_FLOPS,
    "flash2_attention_speed": HOPPER_FLASH2_ATTENTION_SPEED,
}

# Each profile's figures are its vendor's, named in the comment above it and in its `source` (the NVIDIA V100,
# A100, H100, H200, HGX B200 and GB200 NVL72 datasheets, the NVIDIA H800 product brief).
PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA Tesla V100 datasheet (SXM2 32GB): fp16 tensor cores 125 TFLOPS, fp32 15.7, HBM2 900 GB/s,
    # NVLink 300 GB/s (both directions); no bf16, so plans default to float16. Node: DGX-2H (Megatron-LM's
    # 2019 runs): 16 GPUs on NVSwitch, 8 x 100 Gb/s InfiniBand EDR for the 16 (50 Gb/s per GPU).
    "v100": HardwareProfile(
        name="V100-SXM2-32GB",
        peak_tflops=_peaks("V100"),
        hbm_bytes=32e9,
        hbm_bytes_per_s=900e9,
        intra_node_bytes_per_s=150e9,
        inter_node_bytes_per_s=6.25e9,
        source="NVIDIA V100 datasheet; DGX-2H (16 GPUs, 8 x 100 Gb/s EDR)",
        **{**_GPU, "devices_per_node": 16},
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): bf16 312 TFLOPS dense, HBM2e 2,039 GB/s, NVLink
    # 600 GB/s (both directions); https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
    # nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf. NIC: 200 Gb/s per GPU, as in the paper (§3.6).
    "a100": HardwareProfile(
        name="A100-SXM4-80GB",
        peak_tflops=_peaks("A100"),
        hbm_bytes=80e9,
        hbm_bytes_per_s=2039e9,
        intra_node_bytes_per_s=300e9,
        inter_node_bytes_per_s=25e9,
        source="NVIDIA A100 datasheet; 200 Gb/s NIC per GPU (MegaScale paper §3.6)",
        **_GPU,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): bf16 989 TFLOPS dense, 80 GB HBM3 at 3.35 TB/s, NVLink
    # 900 GB/s; https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet. NIC:
    # ConnectX-7 400 Gb/s per GPU (NVIDIA DGX H100 datasheet).
    "h100": HardwareProfile(
        name="H100-SXM5-80GB",
        peak_tflops=_peaks("H100"),
        hbm_bytes=80e9,
        hbm_bytes_per_s=3350e9,
        intra_node_bytes_per_s=450e9,
        inter_node_bytes_per_s=50e9,
        source="NVIDIA H100 datasheet; DGX H100 datasheet (400 Gb/s NIC per GPU)",
        **_HOPPER,
    ),
    # NVIDIA H800 SXM5 (export variant of H100): same tensor cores and HBM3 as H100 SXM5, NVLink limited to
    # 400 GB/s; NVIDIA H800 product brief (https://www.nvidia.cn/data-center/h800/). NIC: 400 Gb/s per GPU.
    "h800": HardwareProfile(
        name="H800-SXM5-80GB",
        peak_tflops=_peaks("H800"),
        hbm_bytes=80e9,
        hbm_bytes_per_s=3350e9,
        intra_node_bytes_per_s=200e9,
        inter_node_bytes_per_s=50e9,
        source="NVIDIA H800 product brief; 400 Gb/s NIC per GPU",
        **_HOPPER,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): bf16 989 TFLOPS dense, 141 GB HBM3e at 4.8 TB/s, NVLink
    # 900 GB/s; https://www.nvidia.com/en-us/data-center/h200/. NIC: 400 Gb/s per GPU (DGX H200).
    "h200": HardwareProfile(
        name="H200-SXM-141GB",
        peak_tflops=_peaks("H200"),
        hbm_bytes=141e9,
        hbm_bytes_per_s=4800e9,
        intra_node_bytes_per_s=450e9,
        inter_node_bytes_per_s=50e9,
        source="NVIDIA H200 datasheet; DGX H200 (400 Gb/s NIC per GPU)",
        **_HOPPER,
    ),
    # NVIDIA HGX B200 (1,000 W): bf16 2.25 PFLOPS dense (the datasheet's 4.5 is with 2:4 sparsity), fp8
    # 4.5, 180 GB HBM3e at 7.7 TB/s (1.44 TB and 62 TB/s for 8 GPUs), NVLink 5 at 1.8 TB/s (both
    # directions); https://www.nvidia.com/en-us/data-center/hgx/. NIC: ConnectX-7 400 Gb/s per GPU (DGX B200).
    "b200": HardwareProfile(
        name="B200-SXM-180GB",
        peak_tflops=_peaks("B200"),
        hbm_bytes=180e9,
        hbm_bytes_per_s=7700e9,
        intra_node_bytes_per_s=900e9,
        inter_node_bytes_per_s=50e9,
        source="NVIDIA HGX B200 datasheet; DGX B200 (400 Gb/s NIC per GPU)",
        **_HOPPER,
    ),
    # NVIDIA GB200 NVL72 (B200 at 1,200 W): bf16 2.5 PFLOPS dense, fp8 5, 186 GB HBM3e at 8 TB/s (13.4 TB
    # and 576 TB/s for 72 GPUs), NVLink 5 at 1.8 TB/s across all 72 GPUs of a rack, which is one NVLink
    # domain (a "node" here); https://www.nvidia.com/en-us/data-center/gb200-nvl72/. NIC: 400 Gb/s per GPU.
    # A pod: the DGX SuperPOD's scalable unit of 8 racks (https://docs.nvidia.com/dgx-superpod/reference-
    # architecture-scalable-infrastructure-gb200/latest/dgx-superpod-architecture.html).
    "gb200": HardwareProfile(
        name="GB200-NVL72",
        peak_tflops=_peaks("GB200"),
        hbm_bytes=186e9,
        hbm_bytes_per_s=8000e9,
        intra_node_bytes_per_s=900e9,
        inter_node_bytes_per_s=50e9,
        source="NVIDIA GB200 NVL72 datasheet (72 GPUs in one NVLink domain); 400 Gb/s NIC per GPU",
        **{**_HOPPER, "devices_per_node": 72, "nodes_per_pod": 8},
    ),
}
