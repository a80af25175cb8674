"""What `data.source` and `data.mixture` name: the source syntax, the text field, and the `datasets` import.

A source is a local text source of corpus.py (`stdlib`, a directory, a glob, a `.jsonl` file, a prepared
dataset, a Megatron pair) or files that Hugging Face `datasets` reads, named by a prefix: `parquet:PATH`,
`json:PATH` (JSON Lines), `arrow:PATH` (each a path or a glob) or `hf-disk:DIR` (a folder written by
`save_to_disk`). Without a prefix, a source whose files can only be meant for `datasets` is read so too
(`Source.hf_kind`): a `.parquet` or `.arrow` file or glob, a glob of `.jsonl` files (one `.jsonl` file is read
locally), a folder written by `save_to_disk`, and a folder whose data files are all of one of those formats,
with no text files beside them. A mixture is several sources with weights, `SOURCE=WEIGHT` entries separated
by commas or new lines. `datasets` is an optional dependency: it is imported only when such a source is read.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from megascale.config import DataConfig, fail
from megascale.data.corpus import TEXT_SUFFIXES
from megascale.errors import DataError

HF_KINDS = ("parquet", "json", "arrow", "hf-disk")
# The file formats that say, without a prefix, that a source is for `datasets` (a single .jsonl file is the
# local reader's), and the files that mark a `save_to_disk` folder.
SUFFIX_KINDS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json"}
SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json")
PREPARED_MARKER = "meta.json"  # a dataset `megascale prepare` wrote (data/shards.py's META_FILE)
DEFAULT_TEXT_FIELD = "text"
_GLOB_CHARS = re.compile(r"[*?\[]")
_ENTRY_SEPARATORS = re.compile(r"[,\n]")


@dataclass(frozen=True)
class Source:
    """One source as written in the config, with its weight in the mixture (1.0 alone)."""

    text: str
    field: str = "data.source"  # the config field it was written in, for messages
    weight: float = 1.0

    @property
    def where(self) -> str:
        """How messages name it: `data.source = '...'` or `data.mixture entry '...'`."""
        if self.field == "data.source":
            return f"data.source = {self.text!r}"
        return f"{self.field} entry {self.text!r}"

    @property
    def hf_kind(self) -> str | None:
        """'parquet', 'json', 'arrow' or 'hf-disk' for a source read by `datasets` (by its prefix, else by
        what its files are), else None."""
        return self._read_as[0] if self._read_as else None

    @property
    def path(self) -> str:
        """The path or glob after the prefix, `~` expanded (the whole text for a local source; for a folder
        of one format's files, a glob of them)."""
        return self._read_as[1] if self._read_as else os.path.expanduser(self.text.strip())

    @functools.cached_property
    def _read_as(self) -> tuple[str, str] | None:
        """(kind, path or glob) of a `datasets` source; None for a local one."""
        kind, sep, rest = self.text.partition(":")
        if sep and kind in HF_KINDS:
            return kind, os.path.expanduser(rest.strip())
        return None if self.text == "stdlib" else _kind_of_files(os.path.expanduser(self.text.strip()))


def _kind_of_files(path: str) -> tuple[str, str] | None:
    """What an unprefixed `path` is when only `datasets` can read it: a .parquet or .arrow file or glob, a
    glob of .jsonl files, a `save_to_disk` folder, or a folder of one such format's files and no text
    files (read as a recursive glob of them); None otherwise."""
    suffix = os.path.splitext(path)[1].lower()
    is_glob = bool(_GLOB_CHARS.search(path)) and not os.path.exists(path)
    if suffix in SUFFIX_KINDS and (suffix != ".jsonl" or is_glob):
        return SUFFIX_KINDS[suffix], path
    if is_glob or not os.path.isdir(path) or os.path.isfile(os.path.join(path, PREPARED_MARKER)):
        return None
    if any(os.path.isfile(os.path.join(path, name)) for name in SAVED_MARKERS):
        return "hf-disk", path
    formats = set()
    for _, dirnames, filenames in os.walk(path):
        dirnames[:] = [
            name for name in dirnames if not name.startswith(".")
        ]  # hidden: as the globs leave them
        for name in filenames:
            file_suffix = os.path.splitext(name)[1].lower()
            if name.startswith("."):
                continue
            if file_suffix in TEXT_SUFFIXES:
                return None  # a folder of text, whatever else it holds
            if file_suffix in SUFFIX_KINDS:
                formats.add(file_suffix)
    if len(formats) != 1:
        return None
    (only,) = formats
    return SUFFIX_KINDS[only], os.path.join(path, "**", f"*{only}")


def data_sources(cfg: DataConfig) -> list[Source]:
    """The sources to train on: data.mixture's entries when it is set, else data.source alone."""
    if not cfg.mixture.strip():
        return [Source(cfg.source)]
    sources: list[Source] = []
    for entry in filter(None, (part.strip() for part in _ENTRY_SEPARATORS.split(cfg.mixture))):
        text, sep, weight_text = entry.rpartition("=")
        text = text.strip()
        if not sep or not text:
            fail(
                "data.mixture",
                cfg.mixture,
                f"has entry {entry!r} without a weight; write SOURCE=WEIGHT, e.g. '{entry}=0.5'",
            )
        try:
            weight = float(weight_text)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            fail(
                "data.mixture",
                cfg.mixture,
                f"gives {text!r} the weight {weight_text.strip()!r}; weights must be positive numbers "
                "(they are taken relative to their sum)",
            )
        if any(source.text == text for source in sources):
            fail("data.mixture", cfg.mixture, f"names {text!r} twice; give each source once, with its weight")
        sources.append(Source(text, "data.mixture", weight))
    if not sources:
        fail("data.mixture", cfg.mixture, "has no entries; write SOURCE=WEIGHT entries, or leave it empty")
    return sources


def text_field(cfg: DataConfig) -> str:
    """data.text_field, or the value of its former name data.jsonl_field when only that one is set."""
    if cfg.text_field == DEFAULT_TEXT_FIELD:
        return cfg.jsonl_field
    if cfg.jsonl_field not in (DEFAULT_TEXT_FIELD, cfg.text_field):
        fail(
            "data.jsonl_field",
            cfg.jsonl_field,
            f"disagrees with data.text_field = {cfg.text_field!r}; set data.text_field alone "
            "(data.jsonl_field is its former name)",
        )
    return cfg.text_field


def import_datasets(source: Source) -> ModuleType:
    """The `datasets` module, or a one-line DataError saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{source.where} is read with Hugging Face `datasets`, which is not installed; "
            "pip install megascale[datasets]"
        ) from None
    return datasets


def hf_files(source: Source) -> list[Path]:
    """The files of a `datasets` source, sorted (for hf-disk, its folder); a DataError when there are none."""
    if source.hf_kind == "hf-disk":
        folder = Path(source.path)
        if not any((folder / name).is_file() for name in ("dataset_info.json", "dataset_dict.json")):
            raise DataError(
                f"{source.where} is not a folder written by `save_to_disk` (it has no dataset_info.json "
                "or dataset_dict.json); give such a folder, or name the files with parquet:, json: or arrow:"
            )
        return [folder]
    pattern = source.path
    if _GLOB_CHARS.search(pattern) and not os.path.exists(pattern):
        files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    else:
        files = [Path(pattern)] if os.path.isfile(pattern) else []
    if not files:
        raise DataError(
            f"{source.where} matches no files; check the path (quote a glob so the shell leaves it alone)"
        )
    return files


def files_identity(files: list[Path], with_times: bool = True) -> list[list]:
    """Each file's resolved path and size (and modification time): what says its content is unchanged.
    A folder counts as all the files below it."""
    listing = []
    for path in files:
        members = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for member in members:
            stat = member.stat()
            listing.append([str(member.resolve()), stat.st_size] + ([stat.st_mtime_ns] if with_times else []))
    return listing


def files_fingerprint(files: list[Path]) -> str:
    """A short hash of the files' paths and sizes, stored with a stream's position to notice other files."""
    blob = repr(files_identity(files, with_times=False)).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
