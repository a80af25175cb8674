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

GB = 1e9


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
    host_cores: int  # cores the devices of a node share (a CPU's processes); 0: each device computes alone
    # Calibration constants (documented in docs/planning.md), the same for every GPU profile:
    gemm_efficiency: float  # fraction of peak a large GEMM reaches
    gemm_half_flops: float  # GEMM size (FLOPs) at which it reaches half of gemm_efficiency
    # Fraction of peak of the device's fastest fused attention kernel (FlashAttention-2 on Ampere, cuDNN's
    # on Hopper), and its work (FLOPs, forward + backward) at half that fraction; 0: any size.
    attention_efficiency: float
    attention_half_flops: float
    # FlashAttention-2's rate as a fraction of that kernel's: 1 where it is that kernel (Ampere), 0.62 on
    # Hopper (the FlashAttention-3 paper's H100 figures, against cuDNN's fused attention).
    flash2_attention_speed: float
    # An MoE layer's experts as one grouped GEMM per projection: the fraction it reaches of the rate the
    # GEMM curve above gives a GEMM of one expert's shape, and what the layer's other operators (router,
    # sort, gather, scatter) add to its time, as a fraction of the grouped GEMMs' (plan/experts.py).
    grouped_gemm_efficiency: float
    moe_operator_overhead: float
    # A float8 GEMM's fraction of the float8 peak, as a share of the fraction the GEMM curve above gives
    # a bf16 GEMM of the same shape of the bf16 peak.
    float8_gemm_efficiency: float
    network_efficiency: float  # fraction of the link bandwidth a collective achieves (bus bandwidth)
    # Host time per block per micro-batch the device cannot hide (0: launches run ahead):
    layer_overhead_s: float
    model_overhead_s: float  # the same for the rest of the model (embedding, output layer, loss)
    tp_layer_overhead_s: float  # the same, added by tensor parallelism's operator dispatch
    # ... and what it adds per byte of a micro-batch's activations (tokens x hidden) beyond its share of
    # the compute: its copies and transfers where they take the cores that compute (gloo on a CPU).
    # A profile that measures it has its TP communication inside these host times (tp_comm_measured).
    tp_layer_overhead_s_per_byte: float
    tp_comm_measured: bool
    dp_layer_overhead_s: float  # the same, added by sharded data parallelism's per-block hooks
    tp_model_overhead_s: float  # what tensor parallelism adds to the rest of the model
    dp_model_overhead_s: float  # what sharded data parallelism adds to the rest of the model
    # Host time of the step's update (gradient norm, clipping, optimizer step) per block a device holds,
    # for the rest of the model, and what DTensor tensor parallelism and FSDP add to each:
    update_layer_overhead_s: float
    update_model_overhead_s: float
    tp_update_layer_overhead_s: float
    dp_update_layer_overhead_s: float
    tp_update_model_overhead_s: float
    dp_update_model_overhead_s: float
    source: str

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


# Calibration constants shared by the GPU profiles (docs/planning.md, "Calibration constants"):
# - A large bf16 GEMM: 0.68 of the tensor-core peak, the one constant fitted on the MegaScale paper's
#   tables (Table 2, Figure 9; nothing else is fitted), inside the 70-80% a lone large GEMM reaches
#   (the step's GEMMs run beside communication kernels and at a lower clock under sustained load); GEMMs
#   under ~1 GFLOP fall off.
# - FlashAttention-2 reaches 50-73% of peak forward+backward on A100 (Dao 2023, arXiv 2307.08691, Fig. 6).
# - NCCL ring collectives reach about 80% of the link rate as bus bandwidth (nccl-tests' busbw definition).
# - Causal attention (torch's SDPA) forward + backward at sequence 8192, head size 128 on one H100 in bf16:
#   0.24 of peak with 4 heads (one of 8 ranks' share of 32) and 0.40 with 32, which the attention curve
#   e(f) = 0.45 f / (f + 1.7e11) passes through (Hopper profiles; bench/kernel_efficiency.py). That is above
#   what FlashAttention-2 reaches on an H100 (its causal forward at most 335 TFLOP/s): a Hopper-native
#   kernel, as cuDNN's fused attention (Transformer Engine's) is.
# - FlashAttention-2 on an H100 SXM5 runs at 0.61-0.63 of cuDNN's fused attention, causal, head size 128,
#   forward, sequences 512 to 16k (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, Fig. 5: 191-335
#   against 315-539 TFLOP/s): flash2_attention_speed 0.62 on Hopper (torch's SDPA ran it there in late 2024,
#   pytorch/pytorch#141133); on Ampere FlashAttention-2 is the fastest kernel (1.0).
# - An MoE layer's grouped GEMMs, at the two shapes of plan/paper_moe.py on one H100 in bf16 (768 slots per
#   expert; bench/kernel_efficiency.py, bench/results/h100/kernel_efficiency.json; docs/gpu.md), ran at
#   0.48 and 0.41 of peak: 0.63 and 0.54 of the 0.76 the largest GEMM measured reached, which is what
#   gemm_efficiency stands for. The curve gives a GEMM of one expert's shape 0.98 and 0.85 of that rate
#   (these thin GEMMs measured 0.85 and 0.71 of it), so the grouped GEMMs reached 0.64 and 0.63 of the
#   curve's rate: grouped_gemm_efficiency 0.64 (0.74-0.76 of a measured same-shape GEMM's). The layer's
#   other operators added 0.22-0.29 of the grouped GEMMs' time.
# - Float8 GEMMs (cuBLAS through `torch._scaled_mm`, e4m3 operands, e5m2 gradients, per-tensor scales) at
#   the forward and backward shapes of 8 linear layers of published float8 runs, on one H200: 0.56-0.71 of
#   the float8 peak (mean 0.62) where bf16 reached 0.64-0.76 of its own (0.69), 1.66-2.01 times the bf16
#   GEMM's rate (mean 1.81); against the curve's bf16 fraction at each shape, 0.83-1.05, mean 0.92
#   (bench/fp8_linear.py, docs/gpu.md): float8_gemm_efficiency 0.92.
# - NCCL small-message latency: a few microseconds over NVLink, about 10 us across RDMA.
_GPU_CONSTANTS: dict[str, Any] = dict(
    gemm_efficiency=0.68,
    gemm_half_flops=2e9,
    attention_efficiency=0.55,
    attention_half_flops=0.0,
    flash2_attention_speed=1.0,
    grouped_gemm_efficiency=0.64,
    moe_operator_overhead=0.25,
    float8_gemm_efficiency=0.92,
    network_efficiency=0.80,
    layer_overhead_s=0.0,
    model_overhead_s=0.0,
    tp_layer_overhead_s=0.0,
    tp_layer_overhead_s_per_byte=0.0,
    tp_comm_measured=False,
    dp_layer_overhead_s=0.0,
    tp_model_overhead_s=0.0,
    dp_model_overhead_s=0.0,
    update_layer_overhead_s=0.0,
    update_model_overhead_s=0.0,
    tp_update_layer_overhead_s=0.0,
    dp_update_layer_overhead_s=0.0,
    tp_update_model_overhead_s=0.0,
    dp_update_model_overhead_s=0.0,
    host_cores=0,
    intra_node_latency_s=5e-6,
    inter_node_latency_s=12e-6,
    devices_per_node=8,
    nodes_per_pod=64,  # 64 servers share one set of ToR switches (paper §3.6)
)

# Measured on one H100 (above): what the Hopper profiles (H100, H800, H200) use in place of the A100 figure.
_HOPPER_CONSTANTS: dict[str, Any] = {
    **_GPU_CONSTANTS,
    "attention_efficiency": 0.45,
    "attention_half_flops": 1.7e11,
    "flash2_attention_speed": 0.62,
}

# Blackwell has no measurement of its own here: the Hopper figures stand in for its attention kernel.
_BLACKWELL_CONSTANTS = _HOPPER_CONSTANTS

PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA Tesla V100 datasheet (SXM2 32GB): fp16 tensor cores 125 TFLOPS, fp32 15.7, HBM2 900 GB/s,
    # NVLink 300 GB/s (both directions); no bf16, so plans default to float16. Node: DGX-2H (Megatron-LM's
    # 2019 runs): 16 GPUs on NVSwitch, 8 x 100 Gb/s InfiniBand EDR for the 16 (50 Gb/s per GPU).
    "v100": HardwareProfile(
        name="V100-SXM2-32GB",
        peak_tflops=_peaks("V100"),
        hbm_bytes=32 * GB,
        hbm_bytes_per_s=900 * GB,
        intra_node_bytes_per_s=150 * GB,
        inter_node_bytes_per_s=6.25 * GB,
        source="NVIDIA V100 datasheet; DGX-2H (16 GPUs, 8 x 100 Gb/s EDR)",
        **{**_GPU_CONSTANTS, "devices_per_node": 16},
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): bf16 312 TFLOPS dense, HBM2e 2,039 GB/s, NVLink
    # 600 GB/s (both directions); https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
    # nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf. NIC: 200 Gb/s per GPU, as in the paper (§3.6).
    "a100": HardwareProfile(
        name="A100-SXM4-80GB",
        peak_tflops=_peaks("A100"),
        hbm_bytes=80 * GB,
        hbm_bytes_per_s=2039 * GB,
        intra_node_bytes_per_s=300 * GB,
        inter_node_bytes_per_s=25 * GB,
        source="NVIDIA A100 datasheet; 200 Gb/s NIC per GPU (MegaScale paper §3.6)",
        **_GPU_CONSTANTS,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): bf16 989 TFLOPS dense, 80 GB HBM3 at 3.35 TB/s, NVLink
    # 900 GB/s; https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet. NIC:
    # ConnectX-7 400 Gb/s per GPU (NVIDIA DGX H100 datasheet).
    "h100": HardwareProfile(
        name="H100-SXM5-80GB",
        peak_tflops=_peaks("H100"),
        hbm_bytes=80 * GB,
        hbm_bytes_per_s=3350 * GB,
        intra_node_bytes_per_s=450 * GB,
        inter_node_bytes_per_s=50 * GB,
        source="NVIDIA H100 datasheet; DGX H100 datasheet (400 Gb/s NIC per GPU)",
        **_HOPPER_CONSTANTS,
    ),
    # NVIDIA H800 SXM5 (export variant of H100): same tensor cores and HBM3 as H100 SXM5, NVLink limited to
    # 400 GB/s; NVIDIA H800 product brief (https://www.nvidia.cn/data-center/h800/). NIC: 400 Gb/s per GPU.
    "h800": HardwareProfile(
        name="H800-SXM5-80GB",
        peak_tflops=_peaks("H800"),
        hbm_bytes=80 * GB,
        hbm_bytes_per_s=3350 * GB,
        intra_node_bytes_per_s=200 * GB,
        inter_node_bytes_per_s=50 * GB,
        source="NVIDIA H800 product brief; 400 Gb/s NIC per GPU",
        **_HOPPER_CONSTANTS,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): bf16 989 TFLOPS dense, 141 GB HBM3e at 4.8 TB/s, NVLink
    # 900 GB/s; https://www.nvidia.com/en-us/data-center/h200/. NIC: 400 Gb/s per GPU (DGX H200).
    "h200": HardwareProfile(
        name="H200-SXM-141GB",
        peak_tflops=_peaks("H200"),
        hbm_bytes=141 * GB,
        hbm_bytes_per_s=4800 * GB,
        intra_node_bytes_per_s=450 * GB,
        inter_node_bytes_per_s=50 * GB,
        source="NVIDIA H200 datasheet; DGX H200 (400 Gb/s NIC per GPU)",
        **_HOPPER_CONSTANTS,
    ),
    # NVIDIA HGX B200 (1,000 W): bf16 2.25 PFLOPS dense (the datasheet's 4.5 is with 2:4 sparsity), fp8
    # 4.5, 180 GB HBM3e at 7.7 TB/s (1.44 TB and 62 TB/s for 8 GPUs), NVLink 5 at 1.8 TB/s (both
    # directions); https://www.nvidia.com/en-us/data-center/hgx/. NIC: ConnectX-7 400 Gb/s per GPU (DGX B200).
    "b200": HardwareProfile(
        name="B200-SXM-180GB",
        peak_tflops=_peaks("B200"),
        hbm_bytes=180 * GB,
        hbm_bytes_per_s=7700 * GB,
        intra_node_bytes_per_s=900 * GB,
        inter_node_bytes_per_s=50 * GB,
        source="NVIDIA HGX B200 datasheet; DGX B200 (400 Gb/s NIC per GPU)",
        **_BLACKWELL_CONSTANTS,
    ),
    # NVIDIA GB200 NVL72 (B200 at 1,200 W): bf16 2.5 PFLOPS dense, fp8 5, 186 GB HBM3e at 8 TB/s (13.4 TB
    # and 576 TB/s for 72 GPUs), NVLink 5 at 1.8 TB/s across all 72 GPUs of a rack, which is one NVLink
    # domain (a "node" here); https://www.nvidia.com/en-us/data-center/gb200-nvl72/. NIC: 400 Gb/s per GPU.
    "gb200": HardwareProfile(
        name="GB200-NVL72",
        peak_tflops=_peaks("GB200"),
        hbm_bytes=186 * GB,
        hbm_bytes_per_s=8000 * GB,
        intra_node_bytes_per_s=900 * GB,
        inter_node_bytes_per_s=50 * GB,
        source="NVIDIA GB200 NVL72 datasheet (72 GPUs in one NVLink domain); 400 Gb/s NIC per GPU",
        **{**_BLACKWELL_CONSTANTS, "devices_per_node": 72, "nodes_per_pod": 16},
    ),
}
