"""Peak FLOP/s for MFU: the table, the config, the measured CPU peak, and refusing to guess."""

import json

import pytest
import torch

from megascale.cli import main
from megascale.observe import peak
from megascale.observe.metrics import read_metrics
from megascale.observe.peak import Peak, peak_for


def test_configured_peak_wins():
    assert peak_for(torch.device("cpu"), "float32", 2, 1.5) == Peak(1.5, "config")


def test_table_lookup_by_device_name(monkeypatch):
    monkeypatch.setattr(peak, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert peak_for(torch.device("cpu"), "bfloat16", 2, None) == Peak(989.0, "table")


def test_unknown_device_is_refused_not_guessed(monkeypatch):
    monkeypatch.setattr(peak, "device_name", lambda device: "Mystery Accelerator 9000")
    assert peak_for(torch.device("meta"), "bfloat16", 2, None) is None


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """A calibration cache of each test's own: what another test calibrated must not show here."""
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path / "cache"))


def test_cpu_without_calibration_has_no_peak():
    assert peak_for(torch.device("cpu"), "float32", 2, None) is None  # the cache is empty in tests


def test_calibrate_measures_caches_and_is_then_used(capsys, monkeypatch):
    monkeypatch.setattr(peak, "measure_matmul_tflops", lambda dtype, threads: 0.123)
    monkeypatch.setattr("megascale.calibrate.ROUNDS", 1)  # one round of measurement is enough here
    monkeypatch.setattr("megascale.calibrate.MAX_ROUNDS", 1)  # even on a busy host

    def not_here():
        raise AssertionError("calibrate measured in the calling process: its heap is not a fresh run's")

    monkeypatch.setattr("megascale.calibrate.measure_local", not_here)  # fresh processes measure
    assert main(["calibrate", "--dtype", "float32", "--threads", "2"]) == 0
    assert "cpu_matmul_peak_float32_tflops 0.1230" in capsys.readouterr().out
    cached = json.loads(peak.calibration_cache().read_text())
    assert list(cached.values()) == [0.123]
    assert peak_for(torch.device("cpu"), "float32", 2, None) == Peak(0.123, "measured")
    assert peak_for(torch.device("cpu"), "float32", 1, None) is None  # another thread count: not measured


def test_measured_matmul_peak_is_plausible():
    tflops = peak.measure_matmul_tflops("float32", 1, size=256, seconds=0.2)
    assert 1e-4 < tflops < 10


def test_calibrate_on_a_machine_too_busy_to_finish_says_so_and_caches_nothing(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(peak, "measure_matmul_tflops", lambda dtype, threads: 0.001)  # measured while busy
    monkeypatch.setattr("megascale.calibrate.PROBE_TIMEOUT_S", 0.01)
    assert main(["calibrate", "--dtype", "float32", "--threads", "1"]) == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith("error: calibrate: a measuring process ran past 0 s") and "\n" not in said
    assert not peak.calibration_cache().exists()  # not the low peak either


def test_mfu_above_100_percent_is_never_shown_and_a_contradicted_measured_peak_is_measured_again(
    tiny_config, monkeypatch, tmp_path
):
    from megascale.trainer import Trainer

    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path / "cache"))
    peak.store_calibration("float32", torch.get_num_threads(), 1e-9)  # far below any real step
    trainer = Trainer(tiny_config("--training.peak_tflops=none"))
    try:
        trainer.train()
    finally:
        trainer.close()
    records = read_metrics(trainer.run_dir)
    assert records and not any("mfu" in record for record in records)
    assert "MFU not shown: this run computes" in (trainer.run_dir / "train.log").read_text()
    assert peak.cached_calibration("float32", torch.get_num_threads()) is None
