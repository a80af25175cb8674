"""Each planner test sees a calibration cache of its own: whether the CPU profile exists is what several of
them test, and a calibration made by another test would otherwise fill the session's shared cache."""

import pytest


@pytest.fixture(autouse=True)
def _own_calibration_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path / "cache"))
