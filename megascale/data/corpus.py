"""Where training text comes from: the Python standard library, a directory, a glob or a .jsonl file.

A corpus is an ordered list of documents that can be read in any order (prepare shuffles them), plus an
identity: the facts that decide its content (paths, sizes, modification times), hashed into the
dataset cache key so that an edited corpus is prepared again instead of silently reusing stale shards.
The default corpus is the standard library's own source: it is on every machine that runs megascale,
needs no download, and is tens of megabytes of real text.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from megascale.errors import DataError

# Extensions read from a directory source; everything else (images, archives, .pyc) is ignored.
TEXT_SUFFIXES = frozenset(
    {
        ".txt",
        ".text",
        ".md",
        ".markdown",
        ".rst",
        ".tex",
        ".org",
        ".html",
        ".htm",
        ".xml",
        ".csv",
        ".tsv",
        ".py",
        ".pyi",
        ".c",
        ".h",
        ".cc",
        ".cpp",
        ".hpp",
        ".cu",
        ".java",
        ".js",
        ".ts",
        ".go",
        ".rs",
        ".rb",
        ".sh",
        ".toml",
        ".yaml",
        ".yml",
        ".ini",
        ".cfg",
    }
)
_GLOB_CHARS = re.compile(r"[*?\[]")


class Corpus:
    """Documents numbered 0..num_documents-1, read on demand in any order."""

    name: str  # short, filesystem-safe; the start of the dataset directory's name
    kind: str
    location: str
    identity: dict
    num_documents: int

    def texts(self, order: Iterable[int]) -> Iterator[str | None]:
        """Each document's text in `order`; None for a file that is binary or not UTF-8 (skipped)."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"kind": self.kind, "location": self.location, "documents": self.num_documents}


class FileCorpus(Corpus):
    """One document per file, in sorted relative-path order."""

    def __init__(self, kind: str, name: str, root: Path, relative_paths: list[str]):
        self.kind, self.name, self.location = kind, name, str(root)
        self.root = root
        self.relative_paths = relative_paths
        self.num_documents = len(relative_paths)
        listing = hashlib.sha256()
        for relative in relative_paths:
            stat = (root / relative).stat()
            listing.update(f"{relative}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        self.identity = {"kind": kind, "root": str(root.resolve()), "files": listing.hexdigest()}

    def texts(self, order: Iterable[int]) -> Iterator[str | None]:
        for index in order:
            yield decode_text((self.root / self.relative_paths[index]).read_bytes())


class JsonlCorpus(Corpus):
    """One document per non-blank line of a .jsonl file: the string in field `text_field`."""

    def __init__(self, path: Path, text_field: str):
        self.kind, self.name, self.location = "jsonl", safe_name(path.stem), str(path)
        self.path = path
        self.text_field = text_field
        self.line_offsets: list[int] = []
        self.line_numbers: list[int] = []
        offset = 0
        with open(path, "rb") as file:
            for line_number, line in enumerate(file, start=1):
                if line.strip():
                    self.line_offsets.append(offset)
                    self.line_numbers.append(line_number)
                offset += len(line)
        self.num_documents = len(self.line_offsets)
        stat = path.stat()
        self.identity = {
            "kind": "jsonl",
            "path": str(path.resolve()),
            "bytes": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "field": text_field,
        }

    def texts(self, order: Iterable[int]) -> Iterator[str | None]:
        with open(self.path, "rb") as file:
            for index in order:
                file.seek(self.line_offsets[index])
                yield self._parse(file.readline(), self.line_numbers[index])

    def _parse(self, line: bytes, line_number: int) -> str:
        where = f"data: {self.path} line {line_number}"
        try:
            record = json.loads(line)
        except UnicodeDecodeError:
            raise DataError(f"{where} is not UTF-8; re-encode the file as UTF-8") from None
        except ValueError as err:
            reason = getattr(err, "msg", str(err))
            raise DataError(f"{where} is not valid JSON ({reason}); fix or delete that line") from None
        text = record.get(self.text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            found = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
            raise DataError(
                f"{where} has no string field {self.text_field!r} (found: {found or 'nothing'});"
                " set --data.text_field to the field that holds the text"
            )
        return text


def open_corpus(source: str, jsonl_field: str = "text") -> Corpus:
    """The local corpus named by data.source: 'stdlib', a directory, a glob, a .jsonl file (text in field
    `jsonl_field`) or a text file. Sources read through `datasets` are hf.py's."""
    if source == "stdlib":
        return stdlib_corpus()
    expanded = os.path.expanduser(source)
    if _GLOB_CHARS.search(expanded) and not os.path.exists(expanded):
        return glob_corpus(source, expanded)
    path = Path(expanded)
    if not path.exists():
        raise DataError(
            f"data.source = {source!r} does not exist; give 'stdlib', a directory, a glob "
            "(quoted), a .jsonl file, or files for `datasets` as parquet:PATH, json:PATH, arrow:PATH "
            "or hf-disk:DIR"
        )
    if path.is_dir():
        files = _walk_text_files(path)
        if not files:
            raise DataError(
                f"data.source = {source!r} has no text files ({', '.join(sorted(TEXT_SUFFIXES))}"
                "); point it at a directory of text or use a glob, or name files for Hugging Face `datasets` "
                "by their format: parquet:PATH, json:PATH (JSON Lines), arrow:PATH or hf-disk:DIR"
            )
        return FileCorpus("directory", safe_name(path.resolve().name), path, files)
    if path.suffix == ".jsonl":
        corpus = JsonlCorpus(path, jsonl_field)
        if corpus.num_documents == 0:
            raise DataError(
                f"data.source = {source!r} has no lines; give a .jsonl file with one JSON object per line"
            )
        return corpus
    return FileCorpus("file", safe_name(path.stem), path.parent, [path.name])


def stdlib_corpus() -> FileCorpus:
    """Every *.py file of this interpreter's standard library, site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        name
        for name in _walk_files(root, skip_dirs={"site-packages", "dist-packages"})
        if name.endswith(".py")
    ]
    if not files:
        raise DataError(
            f"data.source = 'stdlib' found no .py files under {root} (is this Python installed "
            "without its source?); give a directory, a glob or a .jsonl file instead"
        )
    corpus = FileCorpus("stdlib", "stdlib", root, files)
    corpus.identity["python"] = sys.version
    return corpus


def glob_corpus(source: str, pattern: str) -> FileCorpus:
    """The files a (recursive, `**`-aware) glob matches, relative to the pattern's fixed prefix."""
    matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not matches:
        raise DataError(
            f"data.source = {source!r} matches no files; check the pattern (quote it so the "
            "shell does not expand it)"
        )
    root = Path(os.path.commonpath([str(p.parent) for p in matches]))
    corpus = FileCorpus("glob", "glob", root, [str(p.relative_to(root)) for p in matches])
    corpus.identity["pattern"] = pattern
    corpus.location = pattern
    return corpus


def decode_text(data: bytes) -> str | None:
    """The text of a file, or None when it is binary (has NUL bytes) or not valid UTF-8."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "data"


def _walk_text_files(root: Path) -> list[str]:
    return [
        name
        for name in _walk_files(root, skip_dirs=set())
        if os.path.splitext(name)[1].lower() in TEXT_SUFFIXES
    ]


def _walk_files(root: Path, skip_dirs: set[str]) -> list[str]:
    """Sorted POSIX paths relative to `root`; hidden entries and `skip_dirs` are left out, links not
    followed (so a link cycle cannot loop and the listing does not depend on link targets)."""
    found = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip_dirs]
        relative_dir = Path(directory).relative_to(root)
        for filename in filenames:
            full = Path(directory) / filename
            if not filename.startswith(".") and full.is_file():
                found.append((relative_dir / filename).as_posix())
    return sorted(found)
