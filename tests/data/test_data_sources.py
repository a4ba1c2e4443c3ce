"""Reading records from files, folders and the hub, with file:line locations and one-line errors."""
from __future__ import annotations

import json

import pytest

from maximus.data.sources import read_source
from maximus.errors import DataError


def _texts(read):
    return [r.fields["text"] for r in read.records]


def test_jsonl_records_and_lines(tmp_path, spec):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n', encoding="utf-8")
    read = read_source(spec(path))
    assert _texts(read) == ["a", "b"]
    assert [r.where for r in read.records] == [f"{path}:1", f"{path}:3"]


def test_json_list_and_data_object_keep_line_numbers(tmp_path, spec):
    listed = tmp_path / "list.json"
    listed.write_text('[\n  {"text": "a"},\n  {"text": "b"}\n]\n', encoding="utf-8")
    read = read_source(spec(listed))
    assert _texts(read) == ["a", "b"]
    assert [r.where for r in read.records] == [f"{listed}:2", f"{listed}:3"]

    wrapped = tmp_path / "obj.json"
    wrapped.write_text('{"version": [1, 2],\n "data": [\n  {"text": "x"},\n\n  {"text": "y"}]}', encoding="utf-8")
    read = read_source(spec(wrapped))
    assert _texts(read) == ["x", "y"]
    assert [r.where for r in read.records] == [f"{wrapped}:3", f"{wrapped}:5"]


def test_csv_rows_and_json_cells(tmp_path, spec):
    path = tmp_path / "d.csv"
    chat = json.dumps([{"role": "user", "content": "hi"}]).replace('"', '""')
    path.write_text(f'prompt,completion,messages\n"multi\nline",ok,"{chat}"\nq,a,plain\n', encoding="utf-8")
    read = read_source(spec(path))
    assert [r.fields["prompt"] for r in read.records] == ["multi\nline", "q"]
    assert read.records[0].fields["messages"] == [{"role": "user", "content": "hi"}]
    assert read.records[1].fields["messages"] == "plain"
    assert [r.where for r in read.records] == [f"{path}:2", f"{path}:4"]


def test_parquet_rows(tmp_path, spec):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a", "b", "c"]}), path)
    read = read_source(spec(path))
    assert _texts(read) == ["a", "b", "c"]
    assert read.records[2].where == f"{path}: row 3"


def test_txt_paragraphs(tmp_path, spec):
    path = tmp_path / "d.txt"
    path.write_text("first line\nsecond line\n\n\nnext paragraph\n", encoding="utf-8")
    read = read_source(spec(path))
    assert _texts(read) == ["first line\nsecond line", "next paragraph"]
    assert [r.where for r in read.records] == [f"{path}:1", f"{path}:5"]


def test_folder_reads_split_files_or_everything(tmp_path, spec):
    (tmp_path / "train.jsonl").write_text('{"text": "t"}\n', encoding="utf-8")
    (tmp_path / "test.jsonl").write_text('{"text": "e"}\n', encoding="utf-8")
    assert _texts(read_source(spec(tmp_path))) == ["t"]
    assert _texts(read_source(spec(tmp_path, split="test"))) == ["e"]
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    (other / "b.txt").write_text("two", encoding="utf-8")
    (other / "sub" / "a.jsonl").write_text('{"text": "one"}\n', encoding="utf-8")
    (other / "notes.bin").write_bytes(b"\0")
    assert _texts(read_source(spec(other))) == ["two", "one"]  # sorted paths: b.txt < sub/a.jsonl


def test_missing_path_error(tmp_path, spec):
    with pytest.raises(DataError) as err:
        read_source(spec(tmp_path / "nope.jsonl"))
    assert str(err.value) == (f"dataset not found: {tmp_path / 'nope.jsonl'} (hint: check the path "
                              "(relative paths are resolved from the current directory))")


def test_malformed_jsonl_line_error_and_skip(tmp_path, spec):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b" oops}\n[1]\n{"text": "c"}\n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_source(spec(path))
    assert err.value.message == f"{path}:2: malformed JSON: Expecting ',' delimiter at column 14"
    read = read_source(spec(path, on_error="skip"))
    assert _texts(read) == ["a", "c"]
    assert read.skipped == 2


def test_malformed_json_file_names_the_line(tmp_path, spec):
    path = tmp_path / "d.json"
    path.write_text('[\n {"text": "a"},\n {"text": }\n]', encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_source(spec(path))
    assert err.value.message == f"{path}:3: malformed JSON: Expecting value at column 11"


def test_malformed_csv_row(tmp_path, spec):
    path = tmp_path / "d.csv"
    path.write_text("text\na\nb,c\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_source(spec(path))
    assert err.value.message == f"{path}:3: malformed CSV row: expected 1 fields, got 2"
    assert _texts(read_source(spec(path, on_error="skip"))) == ["a"]


def test_unknown_hub_dataset_offline_is_one_line(monkeypatch, spec):
    import datasets
    import huggingface_hub.constants

    # No network here; offline mode makes the hub fail fast instead of retrying for ~25 s.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as err:
        read_source(spec("someone/no-such-dataset"))
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("dataset not found: someone/no-such-dataset (not a local file or folder, and Hugging "
                           "Face datasets could not load it: ")
    assert text.endswith("(hint: check the path or hub name, the `split:` and `name:` keys, and network access "
                         "(or download the dataset and point `path:` at the files))")
