"""Corpus sources: stdlib, directory, glob, .jsonl, and the errors a user can fix."""

from __future__ import annotations

import sysconfig

import pytest
from data_helpers import make_documents, write_jsonl, write_text_dir

from megascale.data.corpus import open_corpus, stdlib_corpus
from megascale.data.prepare import prepare_dataset
from megascale.data.shards import TokenShards
from megascale.errors import DataError


def test_stdlib_corpus_is_sorted_python_without_site_packages():
    corpus = stdlib_corpus()
    assert corpus.num_documents > 500
    assert corpus.relative_paths == sorted(corpus.relative_paths)
    assert all(path.endswith(".py") for path in corpus.relative_paths)
    assert not any("site-packages" in path.split("/") for path in corpus.relative_paths)
    assert "os.py" in corpus.relative_paths
    assert str(corpus.root) == sysconfig.get_paths()["stdlib"]


def test_directory_reads_text_files_and_skips_binary(tmp_path):
    root = write_text_dir(tmp_path / "corpus", ["one\n", "two\n"])
    (root / "sub").mkdir()
    (root / "sub" / "notes.md").write_text("# three\n")
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))  # not UTF-8
    (root / "nul.txt").write_bytes(b"abc\0def")  # binary
    (root / "image.png").write_bytes(b"\x89PNG")  # not a text suffix
    (root / ".hidden").mkdir()
    (root / ".hidden" / "secret.txt").write_text("hidden\n")
    corpus = open_corpus(str(root))
    assert corpus.relative_paths == ["doc-0000.txt", "doc-0001.txt", "latin1.txt", "nul.txt", "sub/notes.md"]
    assert list(corpus.texts(range(corpus.num_documents))) == ["one\n", "two\n", None, None, "# three\n"]


def test_directory_prepare_counts_skipped_files(tmp_path, cfg_for):
    root = write_text_dir(tmp_path / "corpus", make_documents(5))
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    shards = TokenShards.open(prepare_dataset(cfg_for(root), progress=False))
    assert shards.num_documents == 5
    assert shards.meta["source"]["skipped_documents"] == 1


def test_glob_matches_files(tmp_path, cfg_for):
    root = write_text_dir(tmp_path / "corpus", ["a\n", "b\n"])
    (root / "deep").mkdir()
    (root / "deep" / "c.txt").write_text("c\n")
    (root / "other.md").write_text("not matched\n")
    corpus = open_corpus(str(root / "**" / "*.txt"))
    assert corpus.kind == "glob"
    assert sorted(corpus.texts(range(corpus.num_documents))) == ["a\n", "b\n", "c\n"]
    shards = TokenShards.open(prepare_dataset(cfg_for(root / "**" / "*.txt"), progress=False))
    assert shards.num_documents == 3
    with pytest.raises(DataError, match=r"matches no files"):
        open_corpus(str(root / "*.nothing"))


def test_jsonl_documents(tmp_path, cfg_for):
    documents = make_documents(7)
    path = write_jsonl(tmp_path / "docs.jsonl", documents, field="content")
    with open(path, "a") as file:
        file.write("\n")  # blank lines are not documents
    corpus = open_corpus(str(path), jsonl_field="content")
    assert corpus.num_documents == 7
    assert list(corpus.texts([6, 0])) == [documents[6], documents[0]]
    shards = TokenShards.open(prepare_dataset(cfg_for(path, jsonl_field="content"), progress=False))
    assert shards.num_documents == 7
    assert shards.num_tokens == sum(len(d.encode()) + 1 for d in documents)


def test_jsonl_bad_line_names_the_line(tmp_path, cfg_for):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "broken"\n')
    with pytest.raises(DataError, match=r"docs\.jsonl line 3 is not valid JSON.*fix or delete that line"):
        prepare_dataset(cfg_for(path), progress=False)
    path.write_text('{"text": "fine"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"line 2 has no string field 'text' \(found: 'body'\).*text_field"):
        prepare_dataset(cfg_for(path), progress=False)
    assert not (tmp_path / "cache" / "datasets").exists() or not any(
        p for p in (tmp_path / "cache" / "datasets").iterdir() if not p.name.endswith(".lock")
    )


def test_missing_source_says_what_to_give(tmp_path):
    with pytest.raises(DataError) as error:
        open_corpus("/nope")
    message = str(error.value)
    assert message.startswith("data.source = '/nope' does not exist; give 'stdlib'")
    assert "\n" not in message
