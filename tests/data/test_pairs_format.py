"""The `pairs` data format (query, positive) for `objective: contrastive`: detection, renamed
fields, tokenization identical to `maximus.embed`, truncation, collation, and the errors."""
from __future__ import annotations

import pytest
import torch

from maximus.config import DatasetSpec
from maximus.data import build_datasets, collate
from maximus.data.formats import PairExample, detect_format, to_example
from maximus.data.pairs import embedding_ids
from maximus.errors import DataError

RECORDS = [{"query": f"how to sort list {i}", "positive": f"def sort_{i}(xs): return sorted(xs)"} for i in range(10)]


def test_auto_detection_renamed_fields_and_conversion():
    spec = DatasetSpec(path="x")
    assert detect_format({"query": "q", "positive": "p"}, spec, "f") == "pairs"
    renamed = DatasetSpec(path="x", query_field="question", positive_field="answer")
    assert detect_format({"question": "q", "answer": "p"}, renamed, "f") == "pairs"
    assert to_example({"question": "q", "answer": "p"}, "pairs", renamed, "f:1") == PairExample("q", "p", "f:1")
    with pytest.raises(DataError) as err:
        to_example({"question": "q"}, "pairs", renamed, "f:3")
    assert str(err.value) == ("f:3: missing field 'answer' for format pairs (record has ['question']) (hint: fix the "
                              "record, rename fields in the dataset entry (e.g. text_field:), or set `on_error: skip`)")


def test_rows_are_embed_tokenization_cut_to_seq_len(tok, write_jsonl, spec):
    path = write_jsonl(RECORDS)
    splits = build_datasets(spec(path), tok, seq_len=8, eval_split=0.2, objective="contrastive")
    assert len(splits.train) == 8 and len(splits.eval) == 2
    expected = set()
    for r in RECORDS:
        q, p = embedding_ids(tok, [r["query"], r["positive"]])
        expected.add((tuple(q[:8]), tuple(p[:8])))
    got = [(tuple(row["query_input_ids"]), tuple(row["positive_input_ids"])) for row in splits.train + splits.eval]
    assert all(set(row) == {"query_input_ids", "positive_input_ids"} for row in splits.train + splits.eval)
    assert set(got) == expected and len(got) == 10
    longest = sum(any(len(x) > 8 for x in embedding_ids(tok, [r["query"], r["positive"]])) for r in RECORDS)
    assert splits.stats["truncated"] == longest > 0
    assert splits.stats["sources"][0]["format"] == "pairs"


def test_embedding_ids_equal_the_tokenizer_with_special_tokens(tok):
    text = "def f(x): return x + 1"
    assert embedding_ids(tok, [text]) == [tok(text, add_special_tokens=True)["input_ids"]]
    assert embedding_ids(tok, [text], max_length=3) == [tok(text, add_special_tokens=True)["input_ids"][:3]]


def test_collate_pads_both_sides_to_one_length():
    rows = [{"query_input_ids": [5, 6], "positive_input_ids": [7, 8, 9, 10]},
            {"query_input_ids": [11, 12, 13], "positive_input_ids": [14]}]
    batch = collate(rows, pad_token_id=1)
    assert sorted(batch) == ["positive_input_ids", "positive_position_ids", "query_input_ids", "query_position_ids"]
    assert batch["query_input_ids"].tolist() == [[5, 6, 1, 1], [11, 12, 13, 1]]
    assert batch["positive_input_ids"].tolist() == [[7, 8, 9, 10], [14, 1, 1, 1]]
    assert batch["query_position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 2, 0]]
    assert batch["positive_position_ids"].dtype == torch.long


def test_objective_and_format_must_agree(tok, write_jsonl, spec):
    pairs = write_jsonl(RECORDS, "pairs.jsonl")
    text = write_jsonl([{"text": "hello world"}] * 3, "text.jsonl")
    with pytest.raises(DataError) as err:
        build_datasets(spec(text), tok, seq_len=8, objective="contrastive")
    assert str(err.value) == (f"objective contrastive needs pairs records (query, positive); {text} has format text "
                              "(hint: use a dataset with query/positive fields, or set `format: pairs`, query_field "
                              "and positive_field)")
    with pytest.raises(DataError) as err:
        build_datasets(spec(pairs), tok, seq_len=8, objective="sft")
    assert str(err.value) == (f"format pairs (query, positive) is for objective contrastive; {pairs} is used with "
                              "objective sft (hint: set `objective: contrastive` to train an embedding model)")


def test_blank_side_is_dropped_as_empty(tok, write_jsonl, spec):
    path = write_jsonl(RECORDS[:3] + [{"query": "  ", "positive": "x"}])
    splits = build_datasets(spec(path), tok, seq_len=64, eval_split=0.0, objective="contrastive")
    assert len(splits.train) == 3 and splits.stats["empty"] == 1
