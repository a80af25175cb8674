"""The README's first command: `megascale train` with no flags, on CPU, reaches validation loss < 2.0."""

import os
import shutil
import subprocess
import time

import pytest

from megascale.observe.metrics import read_metrics


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_default_training_reaches_target_loss(tmp_path):
    executable = shutil.which("megascale") or pytest.fail("the megascale console script is not installed")
    started = time.monotonic()
    # As a user would run it: all cores (the suite pins OMP_NUM_THREADS=1 for its small multi-process tests).
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    result = subprocess.run(
        [executable, "train"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500
    )
    wall_s = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "runs" / "default")
    val_losses = [r["val_loss"] for r in records if "val_loss" in r]
    print(f"default run: {wall_s:.0f} s wall, validation losses {val_losses}")
    assert records[-1]["step"] == 240
    assert val_losses[-1] < 2.0
