"""Sources read through Hugging Face `datasets`: prepared into token shards (normal mode), read in order from
any row (streaming), and their errors: a missing text field, a value that is not text, an unreadable file."""

from __future__ import annotations

import json

import pytest
from data_helpers import make_documents, write_jsonl, write_parquet_parts

from megascale.data.hf import READ_BATCH_DOCUMENTS, DocumentReader, HFCorpus
from megascale.data.prepare import prepare_dataset
from megascale.data.shards import TokenShards
from megascale.data.sources import Source
from megascale.errors import DataError

datasets = pytest.importorskip("datasets")


def shard_documents(directory) -> list[str]:
    """Every document of a prepared dataset (byte tokenizer), EOS dropped, in stored order."""
    shards = TokenShards.open(directory)
    starts = [0, *shards.doc_ends[:-1]]
    return [
        bytes(shards.tokens(int(a), int(b) - 1).astype("uint8")).decode()
        for a, b in zip(starts, shards.doc_ends)
    ]


def test_parquet_files_are_prepared_into_shards_like_any_corpus(tmp_path, cfg_for):
    documents = make_documents(50)
    write_parquet_parts(tmp_path / "pq", documents, parts=3)
    directory = prepare_dataset(cfg_for(f"parquet:{tmp_path / 'pq'}/*.parquet"), progress=False)
    assert sorted(shard_documents(directory)) == sorted(documents)
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["source"]["kind"] == "hf-parquet" and meta["source"]["documents"] == 50
    assert directory.name.startswith("part-0-byte-")
    again = prepare_dataset(cfg_for(f"parquet:{tmp_path / 'pq'}/*.parquet"), progress=False)
    assert again == directory  # a cache hit: same files, same key


def test_parquet_named_without_its_prefix_is_read_by_datasets(tmp_path, cfg_for):
    """`--data.source=/path/file.parquet` once read the file as text, skipped it as binary and asked for text
    files; a file, and a folder of them, are Parquet by their name."""
    documents = make_documents(20)
    first, second = write_parquet_parts(tmp_path / "pq", documents, parts=2)
    one = prepare_dataset(cfg_for(first), progress=False)
    assert sorted(shard_documents(one)) == sorted(documents[:10])
    both = prepare_dataset(cfg_for(tmp_path / "pq"), progress=False)
    assert sorted(shard_documents(both)) == sorted(documents)
    assert json.loads((both / "meta.json").read_text())["source"]["kind"] == "hf-parquet"


def test_a_source_with_nothing_readable_names_the_prefixes_of_datasets_formats(tmp_path, cfg_for):
    (tmp_path / "table.feather").write_bytes(b"ARROW1\0\0")
    with pytest.raises(DataError) as error:
        prepare_dataset(cfg_for(tmp_path / "table.feather"), progress=False)
    assert "has no readable documents (1 skipped as binary or not UTF-8)" in str(error.value)
    assert str(error.value).endswith("parquet:PATH, json:PATH (JSON Lines), arrow:PATH or hf-disk:DIR")


@pytest.mark.parametrize("kind", ["json", "arrow", "hf-disk"])
def test_json_lines_arrow_files_and_saved_folders_give_the_same_documents(tmp_path, cfg_for, kind):
    documents = make_documents(30)
    if kind == "json":
        source = f"json:{write_jsonl(tmp_path / 'docs.jsonl', documents, field='body')}"
    else:
        datasets.Dataset.from_dict({"body": documents}).save_to_disk(str(tmp_path / "saved"))
        source = f"arrow:{tmp_path}/saved/*.arrow" if kind == "arrow" else f"hf-disk:{tmp_path / 'saved'}"
    directory = prepare_dataset(cfg_for(source, text_field="body"), progress=False)
    assert sorted(shard_documents(directory)) == sorted(documents)


def test_a_saved_dataset_dict_trains_on_its_train_split(tmp_path):
    splits = {"train": ["a", "b"], "test": ["c"]}
    dataset_dict = datasets.DatasetDict(
        {name: datasets.Dataset.from_dict({"text": v}) for name, v in splits.items()}
    )
    dataset_dict.save_to_disk(str(tmp_path / "dd"))
    corpus = HFCorpus(Source(f"hf-disk:{tmp_path / 'dd'}"), "text", tmp_path / "hf")
    assert list(corpus.texts([1, 0])) == ["b", "a"]
    only_test = datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["c"]})})
    only_test.save_to_disk(str(tmp_path / "test-only"))
    with pytest.raises(DataError, match=r"holds the splits 'test' and no 'train'"):
        HFCorpus(Source(f"hf-disk:{tmp_path / 'test-only'}"), "text", tmp_path / "hf").dataset()


def test_reading_in_order_starts_at_any_file_and_row(tmp_path):
    documents = make_documents(2 * READ_BATCH_DOCUMENTS + 20)
    write_parquet_parts(tmp_path / "pq", documents, parts=2)
    reader = DocumentReader(Source(f"parquet:{tmp_path / 'pq'}/*.parquet"), "text", tmp_path / "hf")
    read = [
        (file, row + i, text) for file, row, texts in reader.batches(0, 0) for i, text in enumerate(texts)
    ]
    assert [text for _, _, text in read] == documents
    half = READ_BATCH_DOCUMENTS + 10
    assert read[half + 3][:2] == (1, 3)
    later = [text for _, _, texts in reader.batches(1, 3) for text in texts]
    assert later == documents[half + 3 :]
    json_reader = DocumentReader(
        Source(f"json:{write_jsonl(tmp_path / 'd.jsonl', documents)}"), "text", tmp_path / "hf"
    )
    assert [text for _, _, texts in json_reader.batches(0, 7) for text in texts] == documents[7:]


def test_a_missing_text_field_names_the_fields_the_data_has(tmp_path, cfg_for):
    write_parquet_parts(tmp_path / "pq", make_documents(5), parts=1, field="content")
    source = f"parquet:{tmp_path / 'pq'}/*.parquet"
    with pytest.raises(DataError) as error:
        prepare_dataset(cfg_for(source), progress=False)
    message = str(error.value)
    assert message.startswith(f"data.text_field = 'text' is not a field of data.source = '{source}'")
    assert "it has 'content', 'id': set --data.text_field" in message and "\n" not in message
    with pytest.raises(DataError, match=r"it has 'content', 'id': set --data.text_field"):
        list(DocumentReader(Source(source), "text", tmp_path / "hf").batches(0, 0))


def test_a_value_that_is_not_text_and_an_unreadable_file_are_named(tmp_path, cfg_for):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"text": null}\n')
    with pytest.raises(DataError, match=r"json:.*d\.jsonl'.*: row 1 .*has nothing in field 'text', not text"):
        list(DocumentReader(Source(f"json:{path}"), "text", tmp_path / "hf").batches(0, 0))
    with pytest.raises(DataError, match=r"row 1 has nothing in field 'text', not text"):
        prepare_dataset(cfg_for(f"json:{path}"), progress=False)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(
        DataError, match=r"cannot read .*broken\.parquet as parquet \(.*\); fix or remove the file"
    ):
        list(DocumentReader(Source(f"parquet:{broken}"), "text", tmp_path / "hf").batches(0, 0))
