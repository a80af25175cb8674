"""Documents read through Hugging Face `datasets`: Parquet, JSON Lines and Arrow files, and `save_to_disk`
folders.

Two ways in. `HFCorpus` is a corpus like corpus.py's for `prepare` (normal mode): the files are loaded as
one `datasets.Dataset` (Parquet and JSON are converted to Arrow once, in datasets' cache under
<data.cache_dir>/hf; Arrow files and `save_to_disk` folders are memory-mapped where they are) and read in
any order. `DocumentReader` reads a source in order from a place (file, row), in batches, through
`load_dataset(..., streaming=True)` (streaming mode): nothing is converted or cached, and a restart
seeks straight to its file and skips rows within it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from megascale.data.corpus import Corpus, safe_name
from megascale.data.sources import Source, files_identity, hf_files, import_datasets
from megascale.errors import DataError

READ_BATCH_DOCUMENTS = 256  # rows per read: one Arrow slice, then one tokenizer call


class HFCorpus(Corpus):
    """A `datasets` source as a corpus: rows numbered in file order, the text in column `text_field`.

    The identity (paths, sizes, modification times, field) is known without reading the data; the
    dataset itself is loaded on first use, so a cache hit in `prepare` costs a listing of the files."""

    def __init__(self, source: Source, text_field: str, cache_dir: Path, progress: bool = False):
        self.source, self.text_field = source, text_field
        self.cache_dir, self.progress = cache_dir, progress
        self.files = hf_files(source)
        self.kind, self.location = f"hf-{source.hf_kind}", source.text
        first = self.files[0]
        self.name = safe_name(first.name if first.is_dir() else first.stem)
        self.identity = {"kind": self.kind, "files": files_identity(self.files), "field": text_field}
        self._dataset: Any = None

    @property  # loaded on first use, not set in __init__
    def num_documents(self) -> int:  # type: ignore[override]
        return len(self.dataset())

    def dataset(self) -> Any:
        """The whole source as one `datasets.Dataset` holding only the text column."""
        if self._dataset is None:
            datasets = import_datasets(self.source)
            with _progress_bars(datasets, self.progress), _read_errors(self.source, self.files):
                if self.source.hf_kind == "hf-disk":
                    dataset = _train_split(self.source, datasets.load_from_disk(str(self.files[0])))
                else:
                    dataset = datasets.load_dataset(
                        self.source.hf_kind,
                        data_files=[str(path) for path in self.files],
                        split="train",
                        cache_dir=str(self.cache_dir),
                    )
            _check_column(self.source, self.text_field, dataset.column_names)
            self._dataset = dataset.select_columns([self.text_field])
        return self._dataset

    def texts(self, order: Iterable[int]) -> Iterator[str | None]:
        dataset = self.dataset()
        indices = iter(order)
        while chunk := [int(index) for index in itertools.islice(indices, READ_BATCH_DOCUMENTS)]:
            texts = dataset[chunk][self.text_field]
            for position, text in enumerate(texts):
                if not isinstance(text, str):
                    _not_text(self.source, self.text_field, text, f"row {chunk[position]}")
            yield from texts


class DocumentReader:
    """A `datasets` source read in order: its files one after another (a `save_to_disk` folder is one
    file), each row one document; `batches(file, row)` starts anywhere. `datasets` keeps only lock files
    in `cache_dir` (None: its own cache)."""

    def __init__(self, source: Source, text_field: str, cache_dir: Path | None = None):
        self.source, self.text_field = source, text_field
        self.cache_dir = None if cache_dir is None else str(cache_dir)
        self.files = hf_files(source)
        self._datasets = import_datasets(source)

    def batches(self, file: int, row: int) -> Iterator[tuple[int, int, list[str]]]:
        """(file index, row of the first text, texts) from row `row` of file `file` to the end of the last
        file, READ_BATCH_DOCUMENTS rows at a time (fewer at a file's end)."""
        for index in range(file, len(self.files)):
            path, first_row = self.files[index], row if index == file else 0
            with _read_errors(self.source, [path]):
                columns = self._open(path, first_row)
            while True:
                with _read_errors(self.source, [path]):
                    texts = next(columns, None)
                if texts is None:
                    break
                for position, text in enumerate(texts):
                    if not isinstance(text, str):
                        _not_text(self.source, self.text_field, text, f"row {first_row + position} of {path}")
                yield index, first_row, texts
                first_row += len(texts)

    def _open(self, path: Path, row: int) -> Iterator[list[Any]]:
        """The text column of file `path` from row `row` on, in batches."""
        if self.source.hf_kind == "hf-disk":
            dataset = _train_split(self.source, self._datasets.load_from_disk(str(path)))
            _check_column(self.source, self.text_field, dataset.column_names)
            column = dataset.select_columns([self.text_field])
            return (
                column[start : start + READ_BATCH_DOCUMENTS][self.text_field]
                for start in range(row, len(column), READ_BATCH_DOCUMENTS)
            )
        stream = self._datasets.load_dataset(
            self.source.hf_kind,
            data_files=[str(path)],
            split="train",
            streaming=True,
            cache_dir=self.cache_dir,
        )
        if stream.column_names is not None:  # known up front for Parquet and Arrow, not always for JSON
            _check_column(self.source, self.text_field, stream.column_names, path)
            stream = stream.select_columns([self.text_field])
        if row:
            stream = stream.skip(row)
        return self._column(stream.iter(batch_size=READ_BATCH_DOCUMENTS), path)

    def _column(self, batches: Iterator[dict[str, list]], path: Path) -> Iterator[list[Any]]:
        for batch in batches:
            if self.text_field not in batch:
                _check_column(self.source, self.text_field, list(batch), path)
            yield batch[self.text_field]


def _train_split(source: Source, loaded: Any) -> Any:
    """A `save_to_disk` folder holds a Dataset, or a DatasetDict whose 'train' split is taken."""
    if isinstance(loaded.column_names, dict):  # a DatasetDict: column names by split
        splits = list(loaded)
        if "train" not in splits:
            raise DataError(
                f"{source.where} holds the splits {', '.join(map(repr, splits))} and no 'train'; "
                "save the split to train on by itself"
            )
        return loaded["train"]
    return loaded


def _check_column(source: Source, field: str, columns: list[str], path: Path | None = None) -> None:
    if field not in columns:
        where = f" ({path})" if path is not None else ""
        raise DataError(
            f"data.text_field = {field!r} is not a field of {source.where}{where}; it has "
            f"{', '.join(map(repr, columns)) or 'none'}: set --data.text_field to the one holding the text"
        )


def _not_text(source: Source, field: str, value: Any, where: str) -> NoReturn:
    found = "nothing" if value is None else f"a {type(value).__name__}"
    raise DataError(
        f"{source.where}: {where} has {found} in field {field!r}, not text; fix the data, or set "
        "--data.text_field to the field holding the text"
    )


@contextlib.contextmanager
def _read_errors(source: Source, files: list[Path]) -> Iterator[None]:
    """A failure to parse the files (pyarrow's, json's and datasets' own exceptions) as a DataError."""
    try:
        yield
    except DataError:
        raise
    except Exception as err:  # readers of Parquet, JSON and Arrow raise many types for a bad file
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        named = str(files[0]) if len(files) == 1 else f"its {len(files)} files"
        raise DataError(
            f"{source.where}: cannot read {named} as {source.hf_kind} ({reason}); fix or remove the file"
        ) from err


@contextlib.contextmanager
def _progress_bars(datasets: Any, enabled: bool) -> Iterator[None]:
    """datasets' own progress bars (converting files to Arrow) on or off for a while."""
    was_enabled = datasets.is_progress_bar_enabled()
    _show_progress_bars(datasets, enabled)
    try:
        yield
    finally:
        _show_progress_bars(datasets, was_enabled)


def _show_progress_bars(datasets: Any, enabled: bool) -> None:
    if enabled:
        datasets.enable_progress_bars()
    else:
        datasets.disable_progress_bars()
