"""The source syntax: `datasets` prefixes, mixtures with weights, the text field and its former name."""

from __future__ import annotations

import sys

import pytest

from megascale.config import DataConfig, load_config
from megascale.data.sources import (
    Source,
    data_sources,
    files_fingerprint,
    hf_files,
    import_datasets,
    text_field,
)
from megascale.errors import ConfigError, DataError


def test_a_prefix_names_a_datasets_source_and_anything_else_is_local():
    assert Source("parquet:/data/*.parquet").hf_kind == "parquet"
    assert Source("parquet:/data/*.parquet").path == "/data/*.parquet"
    assert Source("json:~/a.jsonl").path.endswith("/a.jsonl") and "~" not in Source("json:~/a.jsonl").path
    assert Source("hf-disk:/saved").hf_kind == "hf-disk"
    assert Source("arrow:x.arrow").hf_kind == "arrow"
    for local in ("stdlib", "/data/docs", "corpus.jsonl", "csv:/x.csv", "/a:b/c"):
        assert Source(local).hf_kind is None
        assert Source(local).path.endswith(local.rsplit("/", 1)[-1])


def test_files_only_datasets_reads_are_its_without_a_prefix(tmp_path):
    """A .parquet or .arrow file or glob, a glob of .jsonl files, a save_to_disk folder, and a folder of one
    such format's files with no text beside them; a single .jsonl file stays the local reader's."""
    assert (Source("/data/part-0.parquet").hf_kind, Source("/data/part-0.parquet").path) == (
        "parquet",
        "/data/part-0.parquet",
    )
    assert Source("/data/*.arrow").hf_kind == "arrow" and Source("/data/*.jsonl").hf_kind == "json"
    assert Source("corpus.jsonl").hf_kind is None and Source("/data/notes.txt").hf_kind is None
    for name in ("a.parquet", "sub/b.parquet", ".hidden/c.arrow"):
        (tmp_path / "pq" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pq" / name).write_bytes(b"PAR1")
    folder = Source(str(tmp_path / "pq"))
    assert (folder.hf_kind, folder.path) == ("parquet", f"{tmp_path / 'pq'}/**/*.parquet")
    assert hf_files(folder) == [tmp_path / "pq" / "a.parquet", tmp_path / "pq" / "sub" / "b.parquet"]
    (tmp_path / "pq" / "sub" / "c.arrow").write_bytes(b"x")
    assert Source(str(tmp_path / "pq")).hf_kind is None  # two formats: which one is meant is not clear
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.parquet").write_bytes(b"PAR1")
    (tmp_path / "mixed" / "notes.md").write_text("text")
    assert Source(str(tmp_path / "mixed")).hf_kind is None  # a folder of text, read as one
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_info.json").write_text("{}")
    (tmp_path / "saved" / "data-00000-of-00001.arrow").write_bytes(b"x")
    assert (Source(str(tmp_path / "saved")).hf_kind, Source(str(tmp_path / "saved")).path) == (
        "hf-disk",
        str(tmp_path / "saved"),
    )
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "meta.json").write_text("{}")
    (tmp_path / "prepared" / "x.parquet").write_bytes(b"PAR1")
    assert Source(str(tmp_path / "prepared")).hf_kind is None  # a prepared dataset is used as it is
    assert (
        Source(str(tmp_path / "pq" / "a.parquet")).where == f"data.source = '{tmp_path / 'pq' / 'a.parquet'}'"
    )


def test_a_mixture_is_sources_with_weights_by_commas_or_lines():
    cfg = DataConfig(mixture="parquet:/a/*.parquet=0.7, json:/b.jsonl = 0.3")
    assert [(s.text, s.weight, s.field) for s in data_sources(cfg)] == [
        ("parquet:/a/*.parquet", 0.7, "data.mixture"),
        ("json:/b.jsonl", 0.3, "data.mixture"),
    ]
    lines = DataConfig(mixture="\n  parquet:/a/*.parquet = 2\n  /texts = 1\n")
    assert [(s.text, s.weight) for s in data_sources(lines)] == [
        ("parquet:/a/*.parquet", 2.0),
        ("/texts", 1.0),
    ]
    assert [s.text for s in data_sources(DataConfig(source="json:/c.jsonl"))] == ["json:/c.jsonl"]
    assert Source("/texts", "data.mixture").where == "data.mixture entry '/texts'"


@pytest.mark.parametrize(
    ("mixture", "message"),
    [
        ("parquet:/a.parquet", r"has entry 'parquet:/a.parquet' without a weight; write SOURCE=WEIGHT"),
        ("a=0.5, b=0", r"gives 'b' the weight '0'; weights must be positive numbers"),
        ("a=-1", r"gives 'a' the weight '-1'; weights must be positive"),
        ("a=half", r"gives 'a' the weight 'half'"),
        ("a=nan", r"gives 'a' the weight 'nan'"),
        ("a=1, a=2", r"names 'a' twice"),
        (" , ", r"has no entries"),
    ],
)
def test_bad_mixtures_name_the_field_the_value_and_the_fix(mixture, message):
    with pytest.raises(ConfigError, match=r"^config: data\.mixture = .*" + message) as error:
        data_sources(DataConfig(mixture=mixture))
    assert "\n" not in str(error.value)


def test_the_text_field_and_its_former_name():
    assert text_field(DataConfig()) == "text"
    assert text_field(DataConfig(text_field="body")) == "body"
    assert text_field(DataConfig(jsonl_field="content")) == "content"  # old configs keep working
    assert text_field(DataConfig(text_field="body", jsonl_field="body")) == "body"
    with pytest.raises(ConfigError, match=r"data\.jsonl_field = 'content' disagrees with data\.text_field"):
        text_field(DataConfig(text_field="body", jsonl_field="content"))
    cfg = load_config(
        None, ["--data.mixture=json:/a.jsonl=1", "--data.streaming=true", "--data.text_field=t"]
    )
    assert (cfg.data.streaming, cfg.data.text_field) == (True, "t")


def test_files_of_a_source_and_what_it_refuses(tmp_path):
    for name in ("b.parquet", "a.parquet", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    assert hf_files(Source(f"parquet:{tmp_path}/*.parquet")) == [
        tmp_path / "a.parquet",
        tmp_path / "b.parquet",
    ]
    assert hf_files(Source(f"json:{tmp_path}/notes.txt")) == [tmp_path / "notes.txt"]
    with pytest.raises(DataError, match=r"^data\.source = 'parquet:.*/\*\.nothing' matches no files; check"):
        hf_files(Source(f"parquet:{tmp_path}/*.nothing"))
    with pytest.raises(DataError, match=r"^data\.mixture entry 'json:/no/such\.jsonl' matches no files"):
        hf_files(Source("json:/no/such.jsonl", "data.mixture", 0.5))
    with pytest.raises(DataError, match=r"is not a folder written by `save_to_disk`"):
        hf_files(Source(f"hf-disk:{tmp_path}"))
    before = files_fingerprint([tmp_path / "a.parquet"])
    (tmp_path / "a.parquet").write_bytes(b"longer")
    assert files_fingerprint([tmp_path / "a.parquet"]) != before


def test_without_datasets_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(DataError) as error:
        import_datasets(Source("parquet:/a.parquet"))
    message = str(error.value)
    assert message.endswith("pip install megascale[datasets]")
    assert message.startswith("data.source = 'parquet:/a.parquet' is read with Hugging Face `datasets`")
    assert "\n" not in message
