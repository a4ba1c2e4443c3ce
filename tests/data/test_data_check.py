"""The data check (`maximus.data.check`, `maximus data check`, the start of every run): planted
problems found at their rows, the real example clean and fully leaked when pasted, deduplication
that changes nothing else, and the one-line errors."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from maximus.config import Config, DatasetSpec
from maximus.data import build_datasets, build_run_datasets
from maximus.data.check import CHECKS, check_data, check_run
from maximus.data.templates import CHATML_TEMPLATE
from maximus.data.tiny_tokenizer import build_tiny_tokenizer
from maximus.errors import DataError
from planted_data import CHAT_CLASSES, PAIR_CLASSES, plant_chat, plant_pairs

REPO = Path(__file__).resolve().parents[2]


def chitchat_rows(n: int) -> list[list[dict]]:
    """Two-turn chats from the Chit Chat Challenge dataset (the `chitchat-dataset` package): each
    conversation's messages in pairs, the first as the user's, the second as the assistant's."""
    import chitchat_dataset

    data = json.loads((Path(chitchat_dataset.__file__).parent / "dataset.json").read_text(encoding="utf-8"))
    rows = []
    for conversation in data.values():
        turns = [" ".join(u["text"] for u in message) for message in conversation["messages"]]
        rows.extend([{"role": "user", "content": turns[i]}, {"role": "assistant", "content": turns[i + 1]}]
                    for i in range(0, len(turns) - 1, 2))
        if len(rows) >= n:
            return rows[:n]
    return rows


@pytest.fixture(scope="module")
def chat_tok():
    return build_tiny_tokenizer(chat_template=CHATML_TEMPLATE)


def _sft_config(train: Path, eval_path: Path | None = None, **data) -> Config:
    cfg = {"model": "unused", "dataset": {"path": str(train), "format": "chat"}, "training": {"seq_len": 1024},
           "data": data}
    cfg["eval"] = {"split": 0.0} if eval_path is None else {"dataset": {"path": str(eval_path), "format": "chat"}}
    return Config.from_dict(cfg)


def test_planted_chat_problems_are_found_at_their_rows(tmp_path, chat_tok):
    planted = plant_chat(chitchat_rows(1500), tmp_path, seed=3, per_class=12, eval_clean=60)
    cfg = _sft_config(planted.train, planted.eval)
    report = check_run(cfg, build_run_datasets(cfg, chat_tok), chat_tok).to_dict()
    assert [c["name"] for c in report["checks"]] == list(CHECKS)
    scores = planted.score(report)
    assert set(scores) == set(CHAT_CLASSES)
    for name, (recall, false_positives) in scores.items():
        assert recall >= 0.95, (name, recall)
        assert false_positives <= 0.01, (name, false_positives)
    assert planted.false_positive_share(report) <= 0.01


def test_planted_pair_problems_are_found_at_their_rows(tmp_path, chat_tok):
    pairs = [json.loads(line) for line in (REPO / "examples/data/dpo_pairs.jsonl").read_text().splitlines()[:400]]
    planted = plant_pairs(pairs, tmp_path, seed=1, per_class=10)
    splits = build_datasets(DatasetSpec(path=str(planted.train)), chat_tok, seq_len=128, objective="dpo", eval_split=0)
    report = check_data(splits, seq_len=128, objective="dpo").to_dict()
    for name in PAIR_CLASSES:
        recall, false_positives = planted.score(report)[name]
        assert recall == 1.0 and false_positives == 0.0, (name, recall, false_positives)
    bias = next(c for c in report["checks"] if c["name"] == "length_bias")
    assert bias["count"] == 10 and bias["over"]  # the chosen answer is the shorter one in 97 % of the pairs


def _real_chat_config(train: str) -> Config:
    return Config.from_yaml(REPO / "examples/real_chat.yaml", [f"dataset.path={train}", "model=unused"])


def test_real_example_is_clean_and_pasting_its_eval_file_leaks_all_of_it(tmp_path, chat_tok, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = _real_chat_config("examples/data/official_names_train.jsonl")
    report = check_run(cfg, build_run_datasets(cfg, chat_tok))
    assert (report.records, report.eval_rows) == (125, 40)
    assert {c.name: c.count for c in report.checks} == dict.fromkeys(CHECKS, 0)
    assert report.lines() == ["data check: 125 records, 40 eval rows, seq_len 192: clean"]

    pasted = tmp_path / "pasted.jsonl"
    pasted.write_text((REPO / "examples/data/official_names_train.jsonl").read_text()
                      + (REPO / "examples/data/official_names_eval.jsonl").read_text())
    cfg = _real_chat_config(str(pasted))
    leakage = check_run(cfg, build_run_datasets(cfg, chat_tok)).check("leakage")
    assert (leakage.count, leakage.share, leakage.detail) == (40, 1.0, {"exact": 40, "near": 0})
    assert sorted(r.line for r in leakage.rows) == list(range(1, 41))
    assert {r.file for r in leakage.rows} == {"examples/data/official_names_eval.jsonl"}


def _chat(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def test_dedupe_drops_copies_after_the_first_and_keeps_everything_else(tmp_path, chat_tok, write_jsonl):
    rows = [_chat(f"Question number {i} about the {w} river and the {w} stone", f"Answer {i}: the {w} one, of course")
            for i, w in enumerate("red green blue gold north south east west".split())]
    data = write_jsonl(rows + [rows[2], _chat(rows[5]["messages"][0]["content"] + " please", rows[5]["messages"][1]["content"])])
    splits = {mode: build_run_datasets(_sft_config(data, dedupe=mode), chat_tok) for mode in ("off", "exact", "near")}
    assert [splits[m].stats["documents"] for m in ("off", "exact", "near")] == [10, 9, 8]
    deduped = {m: sorted(r.line for r in splits[m].records if r.split == "deduped") for m in ("exact", "near")}
    assert deduped == {"exact": [9], "near": [9, 10]}
    report = check_run(_sft_config(data), splits["off"]).to_dict()
    found = {c["name"]: c["rows"] for c in report["checks"] if c["count"]}
    assert found == {"exact_duplicates": [{"file": str(data), "line": 9}],
                     "near_duplicates": [{"file": str(data), "line": 10}]}

    assert Config.from_dict({"model": "m", "dataset": "d", "data": {"dedupe": False}}).data.dedupe == "off"  # YAML off

    clean = write_jsonl(rows, name="clean.jsonl")  # no duplicates: exact dedupe changes nothing
    off, exact = (build_run_datasets(_sft_config(clean, dedupe=m), chat_tok) for m in ("off", "exact"))
    assert (off.train, off.eval) == (exact.train, exact.eval)


def test_untrainable_truncated_and_drop_untrainable(tmp_path, chat_tok, write_jsonl):
    long_prompt = " ".join(["word"] * 400)
    data = write_jsonl([_chat("Hello there, how are you?", "Fine, thanks for asking."), _chat("Say nothing", ""),
                        _chat(long_prompt, "The answer after a long prompt."), _chat("Hi", "Hello to you too, friend.")])
    cfg = _sft_config(data)
    cfg.training.seq_len = 64
    report = check_run(cfg, build_run_datasets(cfg, chat_tok))
    truncated, untrainable = report.check("truncated"), report.check("untrainable")
    assert [r.line for r in truncated.rows] == [3] and truncated.detail["trained_part_cut_away"] == 1
    assert sorted(r.line for r in untrainable.rows) == [2, 3]
    assert untrainable.detail == {"no_trained_tokens": 0, "empty_answer": 1, "trained_part_cut_away": 1}
    cfg.data.drop_untrainable = True
    dropped = build_run_datasets(cfg, chat_tok)
    assert [r.line for r in dropped.records if r.split == "untrainable"] == [3]
    assert dropped.stats["untrainable_dropped"] == 1


def test_cli_json_lists_every_check_and_on_problem_error_is_one_line(tmp_path, chat_tok, write_jsonl, capsys):
    from maximus.cli import main

    chat_tok.save_pretrained(tmp_path / "tok")
    rows = [_chat(f"Tell me about the number {i} and its friends", f"The number {i} is a fine number indeed") for i in range(20)]
    data = write_jsonl(rows + rows[:3])
    config = tmp_path / "run.yaml"
    config.write_text(f"model: unused\ntokenizer: {tmp_path / 'tok'}\ndataset: {data}\ntraining:\n  seq_len: 128\n"
                      "eval:\n  split: 0.1\n")
    assert main(["data", "check", "--config", str(config), "--json", "--plot", str(tmp_path / "lengths.png")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in report["checks"]] == list(CHECKS)
    assert (tmp_path / "lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    duplicates = report["checks"][0]
    assert (duplicates["count"], duplicates["share"], duplicates["rows"]) == (
        3, 0.130435, [{"file": str(data), "line": line} for line in (21, 22, 23)])
    assert report["preview"][0]["segments"][-1]["trained"] is True

    assert main(["data", "check", "--config", str(config), "data.on_problem=error"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: data check: exact_duplicates in 13.0% of training records (3 of 23), over its threshold 1%; "
                   f"first row {data}:21 (hint: fix the data (maximus data check --config ... --json lists every row), "
                   "set data.dedupe / data.drop_untrainable, or data.on_problem: warn)"]


def test_unreadable_data_is_the_trainers_error(tmp_path, chat_tok, capsys):
    from maximus.cli import main

    chat_tok.save_pretrained(tmp_path / "tok")
    data = tmp_path / "broken.jsonl"
    data.write_text('{"messages": []}\n{"messages": [\n')
    config = tmp_path / "run.yaml"
    config.write_text(f"model: unused\ntokenizer: {tmp_path / 'tok'}\ndataset: {data}\n")
    with pytest.raises(DataError) as trainer_error:
        build_run_datasets(Config.from_yaml(config), chat_tok)
    assert main(["data", "check", "--config", str(config)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {trainer_error.value.one_line()}"
    assert trainer_error.value.message.startswith(f"{data}:2: malformed JSON")


def test_run_writes_the_report_dedupe_exact_is_bit_identical_and_on_problem_error_stops_early(tmp_path, tiny_llama,
                                                                                                write_jsonl):
    from tiny import tiny_config

    from maximus.train.trainer import Trainer

    rows = [{"prompt": f"Reverse: {a} {b}\nAnswer:", "completion": f" {b} {a}"}
            for a in "red green blue gold".split() for b in "stone river cloud tiger eagle".split()]
    rows[7]["completion"] = ""  # no answer: untrainable (it would train only the end-of-text token)
    data = write_jsonl(rows)  # no duplicates
    adapters = {}
    for mode in ("off", "exact"):
        raw = tiny_config(tiny_llama, data, tmp_path / mode, training={"max_steps": 1}, eval={"enabled": False})
        raw["data"] = {"dedupe": mode}
        summary = Trainer(Config.from_dict(raw)).train()
        adapters[mode] = (tmp_path / mode / "adapter" / "adapter_model.safetensors").read_bytes()
        assert summary["data_check"]["checks"]["untrainable"] == {"count": 1, "share": 0.05}
        assert summary["data_check"]["checks"]["exact_duplicates"] == {"count": 0, "share": 0.0}
        written = json.loads((tmp_path / mode / "data_report.json").read_text())
        assert next(c for c in written["checks"] if c["name"] == "untrainable")["rows"] == [{"file": str(data), "line": 8}]
        assert (tmp_path / mode / "data_lengths.png").stat().st_size > 0
    assert adapters["off"] == adapters["exact"]

    duplicated = write_jsonl(rows + rows[:2], name="duplicated.jsonl")
    raw = tiny_config(tiny_llama, duplicated, tmp_path / "stopped", eval={"enabled": False})
    raw["data"] = {"on_problem": "error"}
    trainer = Trainer(Config.from_dict(raw))
    with pytest.raises(DataError, match=r"^data check: exact_duplicates in 9.1% of training records \(2 of 22\), "
                                        rf"over its threshold 1%; first row {duplicated}:21 \(hint: fix the data"):
        trainer.train()
    assert not hasattr(trainer, "model") and not (tmp_path / "stopped").exists()
