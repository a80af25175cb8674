"""Small synthetic corpora for the data tests (a uniquely named module, importable from any test)."""

from __future__ import annotations

import json
from pathlib import Path


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Distinct documents of varied length (some non-ASCII) so every document can be recognised."""
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "eta", "θeta", "iota", "kappa"]
    documents = []
    for index in range(count):
        length = 5 + (index * 7 + seed) % 40
        body = " ".join(words[(index + k * 3 + seed) % len(words)] for k in range(length))
        documents.append(f"document {index}: {body}\n")
    return documents


def write_text_dir(directory: Path, documents: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for index, text in enumerate(documents):
        (directory / f"doc-{index:04d}.txt").write_text(text, encoding="utf-8")
    return directory


def write_jsonl(path: Path, documents: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: text, "id": i}) + "\n" for i, text in enumerate(documents)))
    return path


def write_parquet_parts(directory: Path, documents: list[str], parts: int, field: str = "text") -> list[Path]:
    """The documents split over `parts` Parquet files part-0.parquet, ... in order (needs `datasets`)."""
    from datasets import Dataset

    directory.mkdir(parents=True, exist_ok=True)
    size = -(-len(documents) // parts)
    paths = []
    for part in range(parts):
        chunk = documents[part * size : (part + 1) * size]
        path = directory / f"part-{part}.parquet"
        Dataset.from_dict({field: chunk, "id": list(range(len(chunk)))}).to_parquet(str(path))
        paths.append(path)
    return paths
