"""Each planner test sees a calibration cache of its own: whether the CPU profile exists is what several of
them test, and a calibration made by another test would otherwise fill the session's shared cache."""

import pytest

from megascale.plan.validation import Table, load_tables


@pytest.fixture(autouse=True)
def _own_calibration_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def published_tables() -> list[Table]:
    """The published tables, read once for the session: each row searches once (`searched_plans`), and
    the docs' tables and the search's own test both read every row's search."""
    return load_tables()
