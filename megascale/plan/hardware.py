"""Hardware profiles for the cost model: one table of accelerators with their sources, and this CPU.

A profile holds what the step model (`megascale.plan.step`) needs to turn FLOPs and bytes into seconds:
peak FLOP/s per dtype, HBM size and bandwidth, intra- and inter-node bandwidth and latency per device, and
devices per node. The GPU figures are vendor datasheet numbers, not measurements (docs/gpu.md holds what
one H100 measured; no link between GPUs has been); the CPU profile is built only from what `megascale
calibrate` measured on this machine and refuses to exist before that. Peak FLOP/s come from the same table
MFU uses (`megascale.observe.peak`), so a planned MFU and a measured one divide by the same number.
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
    attention_efficiency: float  # fraction of peak of the device's fastest fused attention kernel
    attention_half_flops: float  # ... and its work (FLOPs) at half that fraction; 0: any size
    flash2_attention_speed: float  # FlashAttention-2's rate as a fraction of that kernel's
    grouped_gemm_efficiency: float  # an MoE layer's grouped GEMMs against the curve's one-expert GEMM
    moe_operator_overhead: float  # the MoE layer's router, sort, gather, scatter: a share of those GEMMs'
    float8_gemm_efficiency: float  # a float8 GEMM's fraction of its peak, over bf16's of its own
    network_efficiency: float  # fraction of the link bandwidth a collective achieves (bus bandwidth)
    source: str
    # What only a CPU profile measures (`megascale.plan.profiles`, from `megascale calibrate`); a GPU's
    # launches run ahead of the device, so none of it is on a GPU's critical path.
    host_cores: int = 0  # cores the devices of a node share (a CPU's processes); 0: each computes alone
    layer_overhead_s: float = 0.0  # host time per block per micro-batch the device cannot hide
    model_overhead_s: float = 0.0  # the same for the rest of the model (embedding, output layer, loss)
    tp_layer_overhead_s: float = 0.0  # the same, added by tensor parallelism's operator dispatch
    # ... and per byte of a micro-batch's activations, its transfers taking the cores that compute (gloo);
    # a profile that measures it has its TP communication inside these host times (tp_comm_measured).
    tp_layer_overhead_s_per_byte: float = 0.0
    tp_comm_measured: bool = False
    dp_layer_overhead_s: float = 0.0  # the same, added by sharded data parallelism's per-block hooks
    tp_model_overhead_s: float = 0.0  # what tensor parallelism adds to the rest of the model
    dp_model_overhead_s: float = 0.0  # what sharded data parallelism adds to the rest of the model
    # The update's host time (norm, clipping, optimizer step) a block and for the rest; what TP, FSDP add:
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


# The calibration constants of every GPU profile (docs/planning.md, "Calibration constants"). A large bf16
# GEMM's fraction of the tensor-core peak: the one constant fitted, on MegaScale's Table 2 and Figure 9
# (arXiv:2402.15627); lone large GEMMs on one H100 reached 0.73-0.76
# (docs/gpu.md#6-kernel-efficiency-at-the-planners-shapes), a step's share the device with communication.
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
# FLOPs), docs/gpu.md#6-kernel-efficiency-at-the-planners-shapes; an H200 measured 0.48-0.50 at 16,384-
# 65,536 tokens, docs/gpu.md#9-attention-beyond-sequence-8192-on-an-h200.
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


def _gpu(
    name: str, device: str, memory: tuple[float, float, float, float], source: str, **kind
) -> HardwareProfile:
    """A GPU profile: its peaks from the MFU table, (HBM bytes, HBM, NVLink and NIC bytes/s per direction)."""
    hbm, hbm_rate, nvlink, nic = memory
    return HardwareProfile(
        name, _peaks(device), hbm, hbm_rate, nvlink, nic, source=source, **{**_GPU, **kind}
    )


# Each profile's figures are its vendor's, from the datasheet its `source` names. NVLink is per direction
# (half the datasheet's both-ways figure); the NIC is one per GPU, wired multi-rail (MegaScale,
# arXiv:2402.15627 §3.6), 200 Gb/s on the A100s of the paper and 400 Gb/s on the DGX H100, H200 and B200
# (ConnectX-7). V100: a DGX-2H, Megatron-LM's 2019 servers, 16 GPUs on NVSwitch and 8 x 100 Gb/s EDR for
# them; no bf16, so plans default to float16. H800: the H100's tensor cores and HBM3, NVLink limited to
# 400 GB/s. B200 (1,000 W) and GB200 (1,200 W): dense bf16 and fp8 (the datasheets' larger figures are
# with 2:4 sparsity); a GB200 NVL72 rack is one NVLink domain of 72 GPUs, and a pod the DGX SuperPOD's
# scalable unit of 8 racks (https://docs.nvidia.com/dgx-superpod/reference-architecture-scalable-
# infrastructure-gb200/latest/dgx-superpod-architecture.html).
PROFILES: dict[str, HardwareProfile] = {
    "v100": _gpu(
        "V100-SXM2-32GB", "V100", (32e9, 900e9, 150e9, 6.25e9),
        "NVIDIA V100 datasheet; NVIDIA DGX-2H datasheet", devices_per_node=16,
    ),
    "a100": _gpu(
        "A100-SXM4-80GB", "A100", (80e9, 2039e9, 300e9, 25e9),
        "NVIDIA A100 datasheet (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
        "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf); 200 Gb/s NIC per GPU (MegaScale paper §3.6)",
    ),
    "h100": _gpu(
        "H100-SXM5-80GB", "H100", (80e9, 3350e9, 450e9, 50e9),
        "NVIDIA H100 datasheet (https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-"
        "datasheet); NVIDIA DGX H100 datasheet (400 Gb/s NIC per GPU)",
        **_HOPPER,
    ),
    "h800": _gpu(
        "H800-SXM5-80GB", "H800", (80e9, 3350e9, 200e9, 50e9),
        "NVIDIA H800 product brief (https://www.nvidia.cn/data-center/h800/); 400 Gb/s NIC per GPU",
        **_HOPPER,
    ),
    "h200": _gpu(
        "H200-SXM-141GB", "H200", (141e9, 4800e9, 450e9, 50e9),
        "NVIDIA H200 datasheet (https://www.nvidia.com/en-us/data-center/h200/); 400 Gb/s NIC per GPU",
        **_HOPPER,
    ),
    "b200": _gpu(
        "B200-SXM-180GB", "B200", (180e9, 7700e9, 900e9, 50e9),
        "NVIDIA HGX B200 datasheet (https://www.nvidia.com/en-us/data-center/hgx/); 400 Gb/s NIC per GPU",
        **_HOPPER,
    ),
    "gb200": _gpu(
        "GB200-NVL72", "GB200", (186e9, 8000e9, 900e9, 50e9),
        "NVIDIA GB200 NVL72 datasheet (https://www.nvidia.com/en-us/data-center/gb200-nvl72/; 72 GPUs in one "
        "NVLink domain); 400 Gb/s NIC per GPU",
        **{**_HOPPER, "devices_per_node": 72, "nodes_per_pod": 8},
    ),
}  # fmt: skip
