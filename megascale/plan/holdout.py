"""Hold-out tables: published runs checked after the validation set was fixed, never used to fit a
constant of the planner (docs/planning.md, "Hold-out tables", names the assumptions their errors led to,
each with its value from a source outside them).

llm-foundry's smaller-scale MPT tables (mosaicml/llm-foundry scripts/train/benchmarking/README.md: "H100
80GB BF16", "A100 80GB" and "A100 40GB with 1600 Gbps node-node interconnect (RoCE)"): FSDP alone
(FULL_SHARD) on 8-128 GPUs, sequences of 512 to 65,536, with and without activation checkpointing. Each
row is priced as the validation set's llm-foundry rows are (`megascale.plan.validation.LLM_FOUNDRY`: the
same FLOP convention, the same assumptions), on its own GPU; the A100 40 GB profile is the A100's with
40 GB. A row gives its tokens per second per GPU, its micro-batch and global batch, whether it
checkpoints every block, and its parameter count (which its FLOP formula uses).

torchtitan's H100 benchmark of December 2024 (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md,
Tables 1 and 3): Llama 3.1 8B under FSDP alone on 8 and 128 GPUs, uncompiled in bfloat16, compiled, and
compiled with torchao's float8 linear layers, priced as the validation set's torchtitan rows are
(`megascale.plan.validation.TORCHTITAN_A100`'s features and FLOP convention; compiled, each element-wise
operator one kernel) on an H100 with that benchmark's memory: 96 GB of HBM2e at 2.4 TB/s. Its GPUs ran at
a 500 W power limit, with a peak its authors place between the SXM's and the NVL's without knowing it; the
profile takes the middle of that range, and the MFU divides by the SXM's peak as the benchmark's own does.

The same benchmark's Tables 2 and 4-6: Llama 3.1 8B with context parallelism up to 262,144 tokens on 8
GPUs, 70B with FSDP and TP 8 (with and without async TP) on 256, and 405B with FSDP, TP 8 and PP 8 (1F1B
and interleaved; with context parallelism up to 262,144 tokens) on 512; all compiled, in float8, every
block checkpointed, each configured as torchtitan's code of that date configures it
(`TORCHTITAN_MULTI_D_ROWS`).

NVIDIA's own tables (NeMo's and Megatron-Bridge's, Megatron-Core with Transformer Engine): see
`megascale.plan.holdout_nvidia`.

`python -m megascale.plan.holdout` prints each table's errors and how often the search agrees with the
published layout (docs/planning.md, "Hold-out tables").
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import NamedTuple

from megascale.config import ModelConfig
from megascale.models.flops import num_params
from megascale.plan.hardware import GB, HardwareProfile
from megascale.plan.holdout_nvidia import LLAMA3_70B, LLAMA3_405B, NVIDIA_TABLES
from megascale.plan.job import Layout
from megascale.plan.validation import (
    A100,
    H100,
    LLAMA3_8B,
    LLM_FOUNDRY,
    MPT,
    TORCHTITAN_A100,
    Published,
    error_summary,
    gpt,
    palm_flops,
    published,
)

MPT_DIMS = {  # name: (d_model, heads, layers): MPT's yamls (scripts/train/yamls/pretrain)
    "125m": (768, 12, 12),
    "350m": (1024, 16, 24),
    "760m": (1536, 12, 24),
    **MPT,
}
A100_40GB = dataclasses.replace(A100, name="A100-SXM4-40GB", hbm_bytes=40 * GB)

# (model, sequence, GPUs, micro-batch, global batch, tokens/s per GPU, checkpointing, parameters)
H100_BF16_ROWS = [
    ("70b", 2048, 64, 8, 2048, 1039, True, 64862437376),
    ("70b", 2048, 32, 2, 1024, 882, True, 64862437376),
    ("30b", 8192, 8, 1, 168, 1384, True, 30019254272),
    ("30b", 4096, 8, 1, 168, 1802, True, 29989894144),
    ("30b", 2048, 32, 14, 1344, 2308, True, 29975214080),
    ("30b", 2048, 16, 10, 480, 2263, True, 29975214080),
    ("30b", 2048, 8, 3, 504, 2002, True, 29975214080),
    ("30b", 1024, 8, 6, 1008, 2084, True, 29967874048),
    ("13b", 32768, 8, 1, 24, 1976, True, 13011240960),
    ("13b", 16384, 8, 3, 72, 2985, True, 12927354880),
    ("13b", 4096, 8, 10, 240, 4717, True, 12864440320),
    ("13b", 2048, 64, 2, 128, 4800, False, 12853954560),
    ("13b", 2048, 32, 2, 64, 4811, False, 12853954560),
    ("13b", 2048, 16, 2, 32, 4767, False, 12853954560),
    ("13b", 2048, 8, 2, 16, 4792, False, 12853954560),
    ("13b", 1024, 8, 40, 960, 5502, True, 12848711680),
    ("7b", 65536, 8, 1, 16, 1956, True, 6918905856),
    ("7b", 32768, 8, 2, 32, 3318, True, 6784688128),
    ("7b", 8192, 8, 8, 128, 6935, True, 6684024832),
    ("7b", 4096, 8, 16, 256, 8611, True, 6667247616),
    ("7b", 2048, 8, 6, 48, 10643, False, 6658859008),
    ("7b", 1024, 8, 64, 1024, 10203, True, 6654664704),
    ("3b", 65536, 8, 1, 16, 3262, True, 2814366720),
    ("3b", 32768, 8, 3, 144, 5873, True, 2730480640),
    ("3b", 16384, 8, 1, 48, 11152, False, 2688537600),
    ("3b", 8192, 8, 3, 144, 16578, False, 2667566080),
    ("3b", 4096, 8, 5, 240, 20964, False, 2657080320),
    ("3b", 2048, 64, 6, 1152, 22525, False, 2651837440),
    ("3b", 2048, 32, 6, 576, 23021, False, 2651837440),
    ("3b", 2048, 16, 10, 480, 24142, False, 2651837440),
    ("3b", 1024, 8, 20, 960, 27046, False, 2649216000),
    ("3b", 512, 8, 40, 1920, 27965, False, 2647905280),
    ("1b", 65536, 8, 1, 16, 5506, True, 1445974016),
    ("1b", 32768, 8, 1, 32, 12025, False, 1378865152),
    ("1b", 16384, 8, 2, 64, 19649, False, 1345310720),
    ("1b", 8192, 8, 3, 96, 29157, False, 1328533504),
    ("1b", 4096, 8, 7, 224, 38535, False, 1320144896),
    ("1b", 2048, 64, 20, 1280, 44402, False, 1315950592),
    ("1b", 2048, 32, 20, 640, 45130, False, 1315950592),
    ("1b", 2048, 16, 20, 320, 46037, False, 1315950592),
    ("1b", 2048, 8, 14, 112, 45455, False, 1315950592),
    ("1b", 1024, 8, 18, 576, 48910, False, 1313853440),
    ("1b", 512, 8, 56, 1792, 52275, False, 1312804864),
    ("760m", 32768, 8, 1, 16, 16291, False, 807656448),
    ("760m", 16384, 8, 3, 48, 27815, False, 782490624),
    ("760m", 8192, 8, 6, 96, 41825, False, 769907712),
    ("760m", 4096, 8, 12, 192, 55459, False, 763616256),
    ("760m", 2048, 32, 24, 768, 67971, False, 760470528),
    ("760m", 2048, 16, 24, 384, 68551, False, 760470528),
    ("760m", 2048, 8, 24, 384, 63147, False, 760470528),
    ("760m", 1024, 8, 48, 768, 78581, False, 758897664),
    ("760m", 512, 8, 96, 1536, 83749, False, 758111232),
]
A100_80GB_ROWS = [
    ("70b", 2048, 64, 8, 2048, 410, True, 64862437376),
    ("70b", 2048, 32, 2, 1024, 373, True, 64862437376),
    ("30b", 8192, 8, 1, 168, 574, True, 30019254272),
    ("30b", 4096, 8, 1, 168, 814, True, 29989894144),
    ("30b", 2048, 8, 3, 504, 916, True, 29975214080),
    ("30b", 1024, 8, 6, 1008, 946, True, 29967874048),
    ("30b", 512, 8, 12, 2016, 967, True, 29964204032),
    ("13b", 32768, 8, 1, 24, 1016, True, 13011240960),
    ("13b", 16384, 8, 3, 72, 1431, True, 12927354880),
    ("13b", 8192, 8, 5, 120, 1795, True, 12885411840),
    ("13b", 4096, 8, 10, 240, 2060, True, 12864440320),
    ("13b", 2048, 8, 2, 48, 2262, False, 12853954560),
    ("13b", 1024, 8, 40, 960, 2330, True, 12848711680),
    ("7b", 65536, 8, 1, 16, 1013, True, 6918905856),
    ("7b", 32768, 8, 2, 32, 1672, True, 6784688128),
    ("7b", 16384, 8, 4, 64, 2453, True, 6717579264),
    ("7b", 8192, 8, 8, 128, 3206, True, 6684024832),
    ("7b", 4096, 8, 16, 256, 3684, True, 6667247616),
    ("7b", 2048, 8, 6, 96, 4641, False, 6658859008),
    ("7b", 1024, 8, 64, 1024, 4357, True, 6654664704),
    ("3b", 65536, 8, 1, 16, 1767, True, 2814366720),
    ("3b", 32768, 8, 3, 144, 3029, True, 2730480640),
    ("3b", 16384, 8, 1, 48, 5529, False, 2688537600),
    ("3b", 8192, 8, 3, 144, 7695, False, 2667566080),
    ("3b", 4096, 8, 5, 240, 9457, False, 2657080320),
    ("3b", 2048, 8, 10, 160, 10811, False, 2651837440),
    ("3b", 1024, 8, 20, 960, 11580, False, 2649216000),
    ("3b", 512, 8, 40, 1920, 12127, False, 2647905280),
    ("1b", 65536, 8, 1, 16, 3044, True, 1445974016),
    ("1b", 32768, 8, 1, 32, 6275, False, 1378865152),
    ("1b", 16384, 8, 2, 64, 9956, False, 1345310720),
    ("1b", 8192, 8, 3, 96, 13814, False, 1328533504),
    ("1b", 4096, 8, 7, 224, 17807, False, 1320144896),
    ("1b", 2048, 8, 14, 448, 20513, False, 1315950592),
    ("1b", 1024, 8, 18, 576, 22112, False, 1313853440),
    ("1b", 512, 8, 56, 1792, 23148, False, 1312804864),
    ("760m", 65536, 8, 1, 16, 4143, True, 857988096),
    ("760m", 32768, 8, 1, 16, 8802, False, 807656448),
    ("760m", 16384, 8, 3, 48, 14274, False, 782490624),
    ("760m", 8192, 8, 6, 96, 20933, False, 769907712),
    ("760m", 4096, 8, 12, 192, 27351, False, 763616256),
    ("760m", 2048, 8, 24, 384, 32434, False, 760470528),
    ("760m", 1024, 8, 48, 768, 29765, False, 758897664),
    ("760m", 512, 8, 96, 1536, 29446, False, 758111232),
    ("350m", 65536, 8, 1, 16, 7524, False, 420997120),
    ("350m", 32768, 8, 2, 32, 13652, False, 387442688),
    ("350m", 16384, 8, 4, 64, 23559, False, 370665472),
    ("350m", 8192, 8, 8, 128, 36569, False, 362276864),
    ("350m", 4096, 8, 16, 256, 49555, False, 358082560),
    ("350m", 2048, 8, 32, 512, 58782, False, 355985408),
    ("350m", 1024, 8, 64, 1024, 64813, False, 354936832),
    ("350m", 512, 8, 128, 2048, 69330, False, 354412544),
    ("125m", 65536, 8, 1, 16, 20368, False, 174070272),
    ("125m", 32768, 8, 2, 32, 36407, False, 148904448),
    ("125m", 16384, 8, 4, 64, 60040, False, 136321536),
    ("125m", 8192, 8, 8, 128, 90392, False, 130030080),
    ("125m", 4096, 8, 16, 256, 118396, False, 126884352),
    ("125m", 2048, 8, 40, 640, 142830, False, 125311488),
    ("125m", 2048, 8, 32, 512, 141737, False, 125311488),
    ("125m", 1024, 8, 64, 1024, 156468, False, 124525056),
    ("125m", 512, 8, 128, 2048, 165681, False, 124131840),
]
A100_40GB_ROWS = [
    ("70b", 2048, 128, 4, 512, 376, True, 64862437376),
    ("70b", 2048, 64, 2, 128, 276, True, 64862437376),
    ("30b", 2048, 128, 6, 768, 865, True, 29975214080),
    ("30b", 2048, 32, 4, 128, 857, True, 29975214080),
    ("13b", 8192, 8, 1, 128, 1407, True, 12885411840),
    ("13b", 4096, 8, 2, 256, 1603, True, 12864440320),
    ("13b", 2048, 128, 16, 2048, 1972, True, 12853954560),
    ("13b", 2048, 64, 16, 1024, 1976, True, 12853954560),
    ("13b", 2048, 32, 14, 448, 1998, True, 12853954560),
    ("13b", 2048, 16, 10, 160, 1993, True, 12853954560),
    ("13b", 2048, 8, 4, 512, 1668, True, 12853954560),
    ("13b", 1024, 8, 8, 1024, 1727, True, 12848711680),
    ("13b", 512, 8, 16, 2048, 1763, True, 12846090240),
    ("7b", 16384, 8, 1, 32, 2249, True, 6717579264),
    ("7b", 8192, 8, 3, 96, 2887, True, 6684024832),
    ("7b", 4096, 8, 6, 192, 3366, True, 6667247616),
    ("7b", 2048, 128, 18, 2304, 3623, True, 6658859008),
    ("7b", 2048, 64, 18, 1152, 3665, True, 6658859008),
    ("7b", 2048, 32, 18, 576, 3725, True, 6658859008),
    ("7b", 2048, 16, 16, 256, 3645, True, 6658859008),
    ("7b", 2048, 8, 12, 384, 3679, True, 6658859008),
    ("7b", 1024, 8, 24, 768, 3854, True, 6654664704),
    ("7b", 512, 8, 48, 1536, 3895, True, 6652567552),
    ("3b", 32768, 8, 1, 32, 2955, True, 2730480640),
    ("3b", 16384, 8, 2, 128, 4465, True, 2688537600),
    ("3b", 8192, 8, 1, 64, 7149, False, 2667566080),
    ("3b", 4096, 8, 2, 128, 8777, False, 2657080320),
    ("3b", 2048, 128, 6, 768, 9538, False, 2651837440),
    ("3b", 2048, 64, 6, 384, 9736, False, 2651837440),
    ("3b", 2048, 32, 6, 192, 9914, False, 2651837440),
    ("3b", 2048, 16, 5, 80, 9750, False, 2651837440),
    ("3b", 2048, 8, 5, 320, 10065, False, 2651837440),
    ("3b", 1024, 8, 10, 640, 10731, False, 2649216000),
    ("3b", 512, 8, 20, 1280, 11324, False, 2647905280),
    ("1b", 32768, 8, 1, 32, 5095, True, 1378865152),
    ("1b", 16384, 8, 1, 64, 9715, False, 1345310720),
    ("1b", 8192, 8, 2, 128, 13474, False, 1328533504),
    ("1b", 4096, 8, 4, 256, 16856, False, 1320144896),
    ("1b", 2048, 128, 10, 1280, 18647, False, 1315950592),
    ("1b", 2048, 64, 10, 640, 19001, False, 1315950592),
    ("1b", 2048, 32, 10, 320, 15555, False, 1315950592),
    ("1b", 2048, 16, 8, 128, 19085, False, 1315950592),
    ("1b", 2048, 8, 8, 512, 19271, False, 1315950592),
    ("1b", 1024, 8, 16, 1024, 20959, False, 1313853440),
    ("1b", 512, 8, 32, 2048, 21782, False, 1312804864),
    ("760m", 32768, 8, 1, 32, 7183, True, 807656448),
    ("760m", 16384, 8, 1, 32, 13914, False, 782490624),
    ("760m", 8192, 8, 3, 96, 20106, False, 769907712),
    ("760m", 4096, 8, 6, 192, 25863, False, 763616256),
    ("760m", 2048, 128, 12, 1536, 28940, False, 760470528),
    ("760m", 2048, 64, 12, 768, 29344, False, 760470528),
    ("760m", 2048, 32, 12, 384, 29648, False, 760470528),
    ("760m", 2048, 16, 12, 192, 29607, False, 760470528),
    ("760m", 2048, 8, 12, 384, 30173, False, 760470528),
    ("760m", 1024, 8, 24, 768, 33422, False, 758897664),
    ("760m", 512, 8, 48, 1536, 34938, False, 758111232),
    ("350m", 32768, 8, 1, 32, 13416, False, 387442688),
    ("350m", 16384, 8, 2, 64, 22896, False, 370665472),
    ("350m", 8192, 8, 4, 128, 34933, False, 362276864),
    ("350m", 4096, 8, 8, 256, 46833, False, 358082560),
    ("350m", 2048, 128, 18, 2304, 51934, False, 355985408),
    ("350m", 2048, 64, 18, 1152, 52689, False, 355985408),
    ("350m", 2048, 32, 18, 576, 53811, False, 355985408),
    ("350m", 2048, 16, 18, 288, 55413, False, 355985408),
    ("350m", 2048, 8, 16, 512, 55995, False, 355985408),
    ("350m", 1024, 8, 32, 1024, 62523, False, 354936832),
    ("350m", 512, 8, 64, 2048, 66284, False, 354412544),
    ("125m", 32768, 8, 1, 32, 32651, False, 148904448),
    ("125m", 16384, 8, 2, 48, 55484, False, 136321536),
    ("125m", 8192, 8, 5, 120, 86858, False, 130030080),
    ("125m", 4096, 8, 13, 312, 115162, False, 126884352),
    ("125m", 2048, 128, 26, 3328, 123936, False, 125311488),
    ("125m", 2048, 64, 26, 1664, 125234, False, 125311488),
    ("125m", 2048, 32, 26, 832, 127122, False, 125311488),
    ("125m", 2048, 16, 26, 416, 130535, False, 125311488),
    ("125m", 2048, 8, 26, 624, 136334, False, 125311488),
    ("125m", 1024, 8, 52, 1248, 148289, False, 124525056),
    ("125m", 512, 8, 104, 2496, 156735, False, 124131840),
]

FOUNDRY_TABLES: dict[str, tuple[HardwareProfile, list[tuple]]] = {
    "H100 80GB BF16": (H100, H100_BF16_ROWS),
    "A100 80GB": (A100, A100_80GB_ROWS),
    "A100 40GB": (A100_40GB, A100_40GB_ROWS),
}


# Meta's Grand Teton H100s (torchtitan docs/performance.md): 96 GB of HBM2e at 2.4 TB/s, run at a 500 W
# power limit, whose peak the source puts "between SXM and NVL" (989 and 835 TFLOP/s in bf16, 1979 and
# 1671 in float8) without knowing it: taken as the middle of that range.
H100_GRAND_TETON = dataclasses.replace(
    H100,
    name="H100-96GB-HBM2e at 500 W",
    hbm_bytes=96 * GB,
    hbm_bytes_per_s=2400 * GB,
    peak_tflops={**H100.peak_tflops, "bfloat16": (989 + 835) / 2, "float8": (1979 + 1671) / 2},
)
# Llama 3.1 8B, sequence 8,192, selective (per-operator) checkpointing, local batch 2 (its Tables 1 and 3):
# tokens/s per GPU on 8 and on 128 GPUs with each set of techniques.
TECHNIQUES = ("FSDP", "FSDP + torch.compile", "FSDP + torch.compile + Float8")
TORCHTITAN_H100_ROWS = {8: (5762, 6667, 8532), 128: (5605, 6514, 8380)}
TORCHTITAN_H100 = "torchtitan H100, FSDP"
# Compiled per block, each element-wise operator (an RMSNorm, SwiGLU, a residual add) runs as one kernel
# instead of its composite operators' passes.
TORCHTITAN_COMPILED = dataclasses.replace(TORCHTITAN_A100.features, elementwise="kernels")


TORCHTITAN_H100_EAGER = dataclasses.replace(
    TORCHTITAN_A100,
    name=TORCHTITAN_H100,
    where="pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3",
    convention="6N + 12 L h s (N with the embeddings), % of 989 TFLOP/s (the SXM's peak, as the "
    "source's own MFU divides by)",
    profile=H100_GRAND_TETON,
    mfu_peak_tflops=989,
    assumed="the devices' bf16 and float8 peaks in the middle of the range the source gives (between "
    "the H100 SXM's and NVL's); 'selective op' recomputation as torchtitan's policy (every second "
    "matmul and the element-wise operators recomputed)",
)
TORCHTITAN_H100_COMPILED = dataclasses.replace(
    TORCHTITAN_H100_EAGER,
    features=TORCHTITAN_COMPILED,
    assumed=f"{TORCHTITAN_H100_EAGER.assumed}; Float8 as torchtitan documents its recipe (docs/float8.md): "
    "tensorwise, with FSDP's float8 all-gather (the benchmark does not say)",
)


def torchtitan_h100_rows() -> list[Published]:
    source, compiled = TORCHTITAN_H100_EAGER, TORCHTITAN_H100_COMPILED
    rows = []
    for gpus, per_technique in TORCHTITAN_H100_ROWS.items():
        layout = Layout(1, 1, gpus, 1, 2, 3, "op", False)
        job = (LLAMA3_8B, 8192, 2 * gpus)
        for techniques, tokens_per_s in zip(TECHNIQUES, per_technique, strict=True):
            float8 = "Float8" in techniques
            rows.append(
                published(
                    compiled if "compile" in techniques else source,
                    f"Llama 3.1 8B on {gpus}, {techniques}",
                    job,
                    layout,
                    palm_flops(8.03e9),
                    tokens_per_s_per_gpu=tokens_per_s,
                    fp8=float8,
                    fp8_all_gather=float8,
                )
            )
    return rows


class TorchtitanRun(NamedTuple):
    """One run of torchtitan's Tables 2 and 4-6; `local_batch` is each data-parallel rank's sequences."""

    label: str
    model: ModelConfig
    seq_len: int
    gpus: int
    local_batch: int
    tp: int
    pp: int
    cp: int
    chunks: int  # pipeline stages a rank
    async_tp: bool
    tokens_per_s: float  # per GPU, as published


# torchtitan's Tables 2 and 4-6 (the same benchmark): compiled, float8, full activation checkpointing,
# beyond FSDP. Without a pipeline the local batch is one micro-batch (no gradient accumulation); with one,
# torchtitan cuts it into pp micro-batches, gives an interleaved schedule 2 stages a rank, splits the layers
# unevenly (`pipelining_utils.generate_split_points`) and keeps FSDP's weights gathered through the step
# (`parallelize_llama.apply_fsdp`: no resharding after the forward under PP), ZeRO-2 here.
TORCHTITAN_MULTI_D = "torchtitan H100, FSDP with TP, PP and CP"
TORCHTITAN_MULTI_D_ROWS = [
    TorchtitanRun("8B, FSDP 8, CP 1", LLAMA3_8B, 32768, 8, 1, 1, 1, 1, 1, False, 3890),
    TorchtitanRun("8B, FSDP 4, CP 2", LLAMA3_8B, 65536, 8, 1, 1, 1, 2, 1, False, 2540),
    TorchtitanRun("8B, FSDP 2, CP 4", LLAMA3_8B, 131072, 8, 1, 1, 1, 4, 1, False, 1071),
    TorchtitanRun("8B, FSDP 1, CP 8", LLAMA3_8B, 262144, 8, 1, 1, 1, 8, 1, False, 548),
    TorchtitanRun("70B, FSDP 32, TP 8", LLAMA3_70B, 8192, 256, 16, 8, 1, 1, 1, False, 829),
    TorchtitanRun("70B, FSDP 32, TP 8, async TP", LLAMA3_70B, 8192, 256, 16, 8, 1, 1, 1, True, 876),
    TorchtitanRun("405B, FSDP 8, TP 8, PP 8, 1F1B", LLAMA3_405B, 8192, 512, 32, 8, 8, 1, 1, True, 100),
    TorchtitanRun("405B, FSDP 8, TP 8, PP 8, interleaved", LLAMA3_405B, 8192, 512, 32, 8, 8, 1, 2, True, 128),
    TorchtitanRun("405B, FSDP 8, TP 8, PP 8, CP 1", LLAMA3_405B, 32768, 512, 8, 8, 8, 1, 1, True, 76),
    TorchtitanRun("405B, FSDP 4, TP 8, PP 8, CP 2", LLAMA3_405B, 65536, 512, 8, 8, 8, 2, 1, True, 47),
    TorchtitanRun("405B, FSDP 2, TP 8, PP 8, CP 4", LLAMA3_405B, 131072, 512, 8, 8, 8, 4, 1, True, 31),
    TorchtitanRun("405B, FSDP 1, TP 8, PP 8, CP 8", LLAMA3_405B, 262144, 512, 8, 8, 8, 8, 1, True, 16),
]
# torch's pipelining interleaves from pp 2 and cuts layers unevenly; its context parallelism sends the next
# ring step's keys and values while the current one computes.
TORCHTITAN_PARALLEL = dataclasses.replace(
    TORCHTITAN_COMPILED, model_parallel=True, uneven_stages=True, interleaved_min_pp=2, cp_overlap=True
)


def torchtitan_multi_d_rows() -> list[Published]:
    source = dataclasses.replace(
        TORCHTITAN_H100_COMPILED,
        name=TORCHTITAN_MULTI_D,
        where="pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 2, 4, 5 and 6",
        features=TORCHTITAN_PARALLEL,
        assumed=f"{TORCHTITAN_H100_COMPILED.assumed}; async TP as tensor-parallel overlap (each linear "
        "layer's all-gather and reduce-scatter in chunks behind its GEMM)",
    )
    rows = []
    for run in TORCHTITAN_MULTI_D_ROWS:
        dp = run.gpus // (run.tp * run.pp * run.cp)
        micro = run.local_batch // run.pp
        zero = 2 if run.pp > 1 else 3
        layout = Layout(run.tp, run.pp, dp, run.chunks, micro, zero, "full", run.tp > 1, cp=run.cp)
        features = dataclasses.replace(
            source.features, tp_overlap=run.async_tp, tp_overlap_attention=run.async_tp
        )
        runs_as = dataclasses.replace(source, features=features)
        job = (dataclasses.replace(run.model, max_seq_len=run.seq_len), run.seq_len, run.local_batch * dp)
        rows.append(
            published(
                runs_as,
                f"Llama 3.1 {run.label}, sequence {run.seq_len:,}",
                job,
                layout,
                palm_flops(num_params(run.model)),
                tokens_per_s_per_gpu=run.tokens_per_s,
                fp8=True,
                fp8_all_gather=True,
            )
        )
    return rows


def foundry_rows(table: str) -> list[Published]:
    profile, rows = FOUNDRY_TABLES[table]
    source = dataclasses.replace(LLM_FOUNDRY, name=f"llm-foundry {table}", profile=profile)
    published_rows = []
    for name, seq_len, gpus, micro, batch, tokens_per_s, checkpointing, params in rows:
        dim, heads, layers = MPT_DIMS[name]
        model = gpt(dim, layers, heads, 50368, seq_len)
        layout = Layout(1, 1, gpus, 1, micro, 3, "full" if checkpointing else "none", False)
        label = f"MPT-{name} at {seq_len:,} on {gpus}, micro-batch {micro}"
        job = (model, seq_len, batch)
        published_rows.append(
            published(source, label, job, layout, palm_flops(params), tokens_per_s_per_gpu=tokens_per_s)
        )
    return published_rows


# Every hold-out table by name, and how its rows are made.
HOLDOUT_TABLES: dict[str, Callable[[], list[Published]]] = {
    **{table: functools.partial(foundry_rows, table) for table in FOUNDRY_TABLES},
    TORCHTITAN_H100: torchtitan_h100_rows,
    TORCHTITAN_MULTI_D: torchtitan_multi_d_rows,
    **NVIDIA_TABLES,
}


def holdout_rows(table: str) -> list[Published]:
    return HOLDOUT_TABLES[table]()


def render_markdown() -> str:
    """Each table's row count, errors and search agreement (`Published.search_agrees`), and the same
    split at sequence 8,192 where a table has both (docs/planning.md)."""
    lines = [
        "| table | rows | mean absolute error | mean signed error | worst | search agrees |",
        "|---|---|---|---|---|---|",
    ]
    for table, make_rows in HOLDOUT_TABLES.items():
        rows = make_rows()
        agrees = {id(row): row.search_agrees() for row in rows}  # searched once, counted in every split
        short = [row for row in rows if row.seq_len <= 4096]
        splits = [("", rows)]
        if short and len(short) < len(rows):
            long = [row for row in rows if row.seq_len > 4096]
            splits += [(", sequences up to 4,096", short), (", sequences of 8,192 and more", long)]
        for label, chosen in splits:
            mean_abs, mean, worst = error_summary(chosen)
            errors = f"{mean_abs:.1f} | {mean:+.1f} | {worst:+.1f}"
            agreeing = sum(agrees[id(row)] for row in chosen)
            lines.append(f"| {table}{label} | {len(chosen)} | {errors} | {agreeing} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
