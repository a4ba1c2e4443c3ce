"""build_datasets end to end: shuffling, held-out split, max_samples, several sources, stats, errors."""
from __future__ import annotations


import pytest

from maximus.config import Config
from maximus.data import DataSplits, IGNORE_INDEX, build_datasets, build_tiny_tokenizer
from maximus.errors import DataError


def documents_of(rows) -> list[tuple[int, ...]]:
    """The documents in rows (split at position resets)."""
    out = []
    for row in rows:
        current: list[int] = []
        for token, pos in zip(row["input_ids"], row["position_ids"]):
            if pos == 0 and current:
                out.append(tuple(current))
                current = []
            current.append(token)
        out.append(tuple(current))
    return out


@pytest.fixture
def numbers(write_jsonl):
    return write_jsonl([{"text": f"number {i} is here"} for i in range(40)], "numbers.jsonl")


def test_deterministic_split_without_leakage(numbers, spec, tok):
    a = build_datasets([spec(numbers)], tok, seq_len=32, seed=3, eval_split=0.1)
    b = build_datasets([spec(numbers)], tok, seq_len=32, seed=3, eval_split=0.1)
    assert isinstance(a, DataSplits) and a.train == b.train and a.eval == b.eval
    train_docs, eval_docs = documents_of(a.train), documents_of(a.eval)
    assert len(eval_docs) == 4 and len(train_docs) == 36 and not set(train_docs) & set(eval_docs)
    texts = {tok.decode(d[:-1]) for d in train_docs + eval_docs}
    assert texts == {f"number {i} is here" for i in range(40)}  # every record once, EOS-terminated
    c = build_datasets([spec(numbers)], tok, seq_len=32, seed=4, eval_split=0.1)
    assert set(documents_of(c.eval)) != set(eval_docs)
    s = a.stats
    assert (s["records"], s["skipped"], s["documents"], s["train_documents"], s["eval_documents"]) == (40, 0, 40, 36, 4)
    assert s["rows"] == len(a.train) and s["eval_rows"] == len(a.eval)
    assert s["tokens"] == sum(len(r["input_ids"]) for r in a.train)
    assert s["loss_tokens"] == sum(l != IGNORE_INDEX for r in a.train for l in r["labels"])
    assert all(len(r["input_ids"]) <= 32 for r in a.train)


@pytest.mark.parametrize("n, split, expected", [(2, 0.05, 1), (1, 0.5, 0), (40, 0.0, 0), (3, 0.9, 2), (100, 0.05, 5)])
def test_eval_split_sizes(write_jsonl, spec, tok, n, split, expected):
    path = write_jsonl([{"text": f"t {i}"} for i in range(n)])
    assert build_datasets([spec(path)], tok, seq_len=16, eval_split=split).stats["eval_documents"] == expected


def test_max_samples_takes_a_seeded_sample_and_sources_concatenate(numbers, write_jsonl, spec, tok):
    other = write_jsonl([{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(5)], "pc.jsonl")
    splits = build_datasets([spec(other), spec(numbers, max_samples=7)], tok, seq_len=64, eval_split=0, seed=1)
    assert splits.stats["documents"] == 12
    assert [(s["format"], s["documents"]) for s in splits.stats["sources"]] == [("prompt_completion", 5), ("text", 7)]
    picked = {tok.decode(d[:-1]) for d in documents_of(splits.train) if tok.decode(d).startswith("number")}
    assert len(picked) == 7 and picked != {f"number {i} is here" for i in range(7)}  # shuffled, not the first 7
    again = build_datasets([spec(numbers, max_samples=7)], tok, seq_len=64, eval_split=0, seed=1)
    assert {tok.decode(d[:-1]) for d in documents_of(again.train)} == picked  # other sources do not change the sample


def test_no_packing_gives_one_document_per_row(numbers, spec, tok):
    splits = build_datasets([spec(numbers)], tok, seq_len=4, packing=False, eval_split=0)
    assert len(splits.train) == 40 and splits.stats["truncated"] == 40
    assert all(r["position_ids"] == [0, 1, 2, 3] for r in splits.train)


def test_config_dataset_entries_feed_build_datasets(numbers, tmp_path, tok):
    txt = tmp_path / "notes.txt"
    txt.write_text("alpha beta\n\ngamma delta\n", encoding="utf-8")
    cfg = Config.from_dict({"model": "m", "dataset": [str(numbers), {"path": str(txt), "max_samples": 1}]})
    splits = build_datasets(cfg.datasets, tok, seq_len=cfg.training.seq_len, eval_split=cfg.eval.split)
    assert splits.stats["documents"] == 41 and splits.stats["sources"][1]["format"] == "text"


def test_empty_dataset_errors(write_jsonl, spec, tok, tmp_path):
    blank = write_jsonl([{"text": "  "}, {"text": ""}], "blank.jsonl")
    with pytest.raises(DataError) as err:
        build_datasets([spec(blank)], tok, seq_len=16)
    assert str(err.value) == (f"dataset is empty after filtering: {blank} (2 records read, 0 skipped as malformed, "
                              "2 with nothing to learn) (hint: check the files, the format and field names, and max_samples)")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        build_datasets([spec(bad, on_error="skip")], tok, seq_len=16)
    assert err.value.message == (f"dataset is empty after filtering: {bad} (1 records read, 1 skipped as malformed, "
                                 "0 with nothing to learn)")
    prompts_only = write_jsonl([{"messages": [{"role": "user", "content": "hi"}]}], "chat.jsonl")
    with pytest.raises(DataError) as err:
        build_datasets([spec(prompts_only)], tok, seq_len=16)
    assert "1 with nothing to learn" in err.value.message


def test_bad_arguments(numbers, spec, tok):
    with pytest.raises(DataError, match="unknown objective 'ppo'"):
        build_datasets([spec(numbers)], tok, seq_len=16, objective="ppo")
    with pytest.raises(DataError, match=r"eval_split must be in \[0, 1\), got 1.0"):
        build_datasets([spec(numbers)], tok, seq_len=16, eval_split=1.0)
    tok.eos_token = None
    with pytest.raises(DataError, match="the tokenizer has no EOS token"):
        build_datasets([spec(numbers)], tok, seq_len=16)


def test_tiny_tokenizer_is_deterministic_and_round_trips(tmp_path):
    from transformers import AutoTokenizer

    a = build_tiny_tokenizer(vocab_size=400)
    assert a.get_vocab() == build_tiny_tokenizer(vocab_size=400).get_vocab() and len(a) == 400
    assert (a.eos_token_id, a.pad_token_id, a.bos_token) == (0, 1, None)
    text = "Hello, wörld! 123 ### Response:\n"
    assert a.decode(a(text)["input_ids"]) == text
    a.save_pretrained(tmp_path)
    b = AutoTokenizer.from_pretrained(tmp_path)
    assert b(text)["input_ids"] == a(text)["input_ids"] and b.eos_token_id == 0
    custom = build_tiny_tokenizer(["aaaa bbbb"] * 10, vocab_size=300)
    assert len(custom("aaaa bbbb")["input_ids"]) == 2  # the corpus words became single tokens
