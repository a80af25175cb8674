"""Fixtures shared by the data tests: a config factory and a small directory corpus."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_helpers import make_documents, write_text_dir

from megascale.config import DataConfig


@pytest.fixture
def cfg_for(tmp_path):
    """A DataConfig caching under tmp_path, with any fields overridden."""

    def build(source: str | Path, **overrides) -> DataConfig:
        fields = {
            "source": str(source),
            "cache_dir": str(tmp_path / "cache"),
            "seq_len": 16,
            "val_fraction": 0.1,
        }
        return DataConfig(**(fields | overrides))

    return build


@pytest.fixture
def text_dir(tmp_path) -> tuple[Path, list[str]]:
    documents = make_documents(40)
    return write_text_dir(tmp_path / "corpus", documents), documents
