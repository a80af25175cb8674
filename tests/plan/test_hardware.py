"""Hardware profiles: one table with sources, the MFU table's peaks, and the CPU only once measured."""

import json

import pytest

from megascale.errors import ConfigError
from megascale.observe.peak import PEAK_TFLOPS, calibrate
from megascale.plan import profiles as plan_profiles
from megascale.plan.command import HARDWARE
from megascale.plan.hardware import PROFILES
from megascale.plan.profiles import profile_named


def test_every_gpu_profile_cites_its_datasheet_and_uses_the_mfu_peaks():
    assert list(HARDWARE) == [*PROFILES, "cpu"]
    for key, profile in PROFILES.items():
        assert "datasheet" in profile.source or "product brief" in profile.source
        for dtype, tflops in profile.peak_tflops.items():
            assert tflops == PEAK_TFLOPS[(key.upper(), dtype)]
        assert profile.peak_tflops["float16"] >= profile.peak_tflops["float32"]
        assert profile.inter_node_bytes_per_s < profile.intra_node_bytes_per_s < profile.hbm_bytes_per_s


@pytest.mark.parametrize(
    ("name", "bfloat16"),
    [("NVIDIA GB200", 2500.0), ("NVIDIA B200", 2250.0), ("Tesla V100-SXM2-32GB", None)],
)
def test_a_device_name_finds_its_own_peak_not_a_substring_of_it(monkeypatch, name, bfloat16):
    """GB200 contains B200: the MFU table matches the longer name first; V100 has no bfloat16."""
    import torch

    from megascale.observe import peak

    monkeypatch.setattr(peak, "device_name", lambda device: name)
    found = peak.peak_for(torch.device("cuda"), "bfloat16", 1, None)
    assert (found.tflops if found else None) == bfloat16


def test_an_unknown_profile_is_refused_by_name():
    with pytest.raises(
        ConfigError,
        match=r"--hardware 'tpu' is unknown; choose one of v100, a100, h100, h800, h200, b200, gb200, cpu",
    ):
        profile_named("tpu")


def test_the_cpu_profile_refuses_to_exist_before_calibration():
    with pytest.raises(ConfigError, match=r"run `megascale calibrate --dtype float32 --threads 1` first"):
        profile_named("cpu")


def test_the_cpu_profile_is_built_from_the_measurements(monkeypatch):
    monkeypatch.setattr("megascale.observe.peak.measure_matmul_tflops", lambda dtype, threads: 0.1)
    calibrate("float32", 1)
    measured = {
        "small_gemm_flops_per_s": 0.05e12,
        "memory_bytes_per_s": 4e9,
        "block_host_s": 0.002,
        "model_host_s": 0.001,
        "sized_block_host_s": 0.006,  # 4 ms of compute, 2 ms of it on each of two TP ranks
        "tp_sized_block_host_s": 0.054,  # 2 ms of compute and 2 ms more, over 130,560 more bytes
        "update_block_host_s": 0.001,
        "update_model_host_s": 0.002,
        "collective_latency_s": 3e-4,
        "gather_bytes_per_s": 3e8,
        "scatter_bytes_per_s": 2e8,
        "tp_block_host_s": 0.05,
        "fsdp_block_host_s": 0.015,
        "tp_model_host_s": 0.021,
        "fsdp_model_host_s": 0.006,
        "tp_update_block_host_s": 0.004,
        "fsdp_update_block_host_s": 0.003,
        "tp_update_model_host_s": 0.005,
        "fsdp_update_model_host_s": 0.001,  # less than without FSDP: counted as nothing added
    }
    path = plan_profiles.profile_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({plan_profiles.cache_key(1): measured}))
    profile = profile_named("cpu")
    assert profile.peak_flops("float32") == pytest.approx(0.1e12)
    assert profile.intra_node_bytes_per_s == pytest.approx(2 / (1 / 3e8 + 1 / 2e8))
    assert profile.tp_layer_overhead_s == pytest.approx(0.048)
    assert profile.tp_layer_overhead_s_per_byte == pytest.approx(0.002 / (4 * 128 * 64 * 4 - 4 * 16 * 8))
    assert profile.tp_comm_measured
    assert profile.dp_layer_overhead_s == pytest.approx(0.013)
    assert profile.tp_update_layer_overhead_s == pytest.approx(0.003)
    assert profile.dp_update_layer_overhead_s == pytest.approx(0.002)
    assert profile.tp_model_overhead_s == pytest.approx(0.020)
    assert profile.tp_update_model_overhead_s == pytest.approx(0.003)
    assert profile.dp_update_model_overhead_s == 0.0
    # the small GEMM ran at half the peak, so a GEMM of its size earns half the efficiency
    small = 2 * 256 * 128 * 384
    assert profile.gemm_efficiency * small / (small + profile.gemm_half_flops) == pytest.approx(0.5)
    with pytest.raises(ConfigError, match=r"has no bfloat16 peak \(asked by --dtype"):
        profile.peak_flops("bfloat16")
    del measured["fsdp_update_block_host_s"]  # a cache written before the update was measured
    path.write_text(json.dumps({plan_profiles.cache_key(1): measured}))
    with pytest.raises(ConfigError, match=r"predates fsdp_update_block_host_s; run `megascale calibrate"):
        profile_named("cpu")
