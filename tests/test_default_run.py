"""The README's first command: `megascale train` with no flags, on CPU, reaches validation loss < 2.0."""

import shutil
import subprocess
import time

import pytest

from megascale.observe.metrics import read_metrics


@pytest.mark.slow
def test_default_training_reaches_target_loss(tmp_path):
    executable = shutil.which("megascale") or pytest.fail("the megascale console script is not installed")
    started = time.monotonic()
    result = subprocess.run([executable, "train"], cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    wall_s = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "runs" / "default")
    val_losses = [r["val_loss"] for r in records if "val_loss" in r]
    print(f"default run: {wall_s:.0f} s wall, validation losses {val_losses}")
    assert records[-1]["step"] == 360
    assert val_losses[-1] < 2.0
