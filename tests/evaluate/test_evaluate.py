"""Evaluation details a user reads in run.json: task metrics score only examples with a prompt."""
from __future__ import annotations

import json

import pytest
from tiny import one_thread, tiny_config, write_prompt_completion  # noqa: F401 (one_thread: a fixture)

import maximus
from maximus.data import build_run_datasets
from maximus.evaluate.tasks import NO_PROMPT_NOTE, TaskEval
from maximus.models import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def _write_text(path, n=40):
    words = "red green blue gold stone river cloud tiger eagle maple".split()
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"text": " ".join(words[(i + k) % len(words)] for k in range(6))}) + "\n")
    return path


def _tokenizer(model_dir):
    return load_tokenizer(maximus.Config.from_dict({"model": str(model_dir), "dataset": "-"}))


def _tasks(cfg: dict):
    cfg = maximus.Config.from_dict(cfg)
    tok = _tokenizer(cfg.model)
    data = build_run_datasets(cfg, tok)
    return TaskEval(cfg, tok, data), data, tok


def test_plain_text_documents_have_no_prompt_to_score(tiny_llama, tmp_path):
    data = _write_text(tmp_path / "t.jsonl")
    tasks, splits, _ = _tasks(tiny_config(tiny_llama, data, tmp_path / "run", dataset={"path": str(data), "format": "text"},
                                          eval={"metrics": ["exact_match"], "split": 0.5}))
    assert len(splits.eval) > 0 and tasks.held_out == []


def test_held_out_examples_are_the_held_out_documents_prompted_as_in_training(tiny_llama, tmp_path):
    """Oracle: the pipeline's own held-out documents; each example's prompt ids + answer ids + EOS
    are that document's tokens, as packed into the held-out rows."""
    path = write_prompt_completion(tmp_path / "pc.jsonl", n=16)
    tasks, splits, tok = _tasks(tiny_config(tiny_llama, path, tmp_path / "run", eval={"metrics": ["exact_match"],
                                                                                      "split": 0.25}))
    records = {f"{path}:{i + 1}": json.loads(line) for i, line in enumerate(path.read_text().splitlines())}
    assert [x.id for x in tasks.held_out] == splits.eval_where and len(splits.eval_where) == 4
    documents = []
    for row in splits.eval:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        documents += [row["input_ids"][a:b] for a, b in zip(starts, starts[1:]) if b - a > 1]
    for x in tasks.held_out:
        assert (x.prompt, x.reference) == (records[x.id]["prompt"], records[x.id]["completion"])
        ids = tasks.prompter.prompt_ids(x) + tok(x.reference, add_special_tokens=False).input_ids + [tok.eos_token_id]
        assert ids in documents


def test_metrics_on_plain_text_are_null_with_a_note(tiny_llama, tmp_path, capsys):
    data = _write_text(tmp_path / "t.jsonl")
    cfg = tiny_config(tiny_llama, data, tmp_path / "run", dataset={"path": str(data), "format": "text"},
                      eval={"exact_match": 4, "split": 0.25}, training={"max_steps": 1})
    maximus.Trainer(maximus.Config.from_dict(cfg)).train()
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    for when in ("before", "after"):
        assert info["eval"][when]["exact_match"] is None
        assert info["eval"][when]["metrics_note"] == NO_PROMPT_NOTE
    assert f"held-out metrics: none scored: {NO_PROMPT_NOTE}" in capsys.readouterr().out.splitlines()


def _write_chat(path, n=24):
    words = "red green blue gold stone river cloud tiger".split()
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            a, b = words[i % 8], words[(i * 3 + 1) % 8]
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Say {a} {b}"},
                                             {"role": "assistant", "content": f"{a} {b}"}]}) + "\n")
    return path


def test_chat_runs_generate_through_the_chat_template(tiny_llama, tmp_path, capsys):
    """Oracle: Transformers' apply_chat_template(add_generation_prompt=True) on one user turn."""
    import torch

    data = _write_chat(tmp_path / "chat.jsonl")
    prompt = "Say red blue"
    cfg = tiny_config(tiny_llama, data, tmp_path / "run", dataset={"path": str(data), "format": "chat"},
                      eval={"prompts": [prompt], "max_new_tokens": 6, "before": False}, training={"max_steps": 1})
    trainer = maximus.Trainer(maximus.Config.from_dict(cfg))
    summary = trainer.train()
    tok, model = trainer.tokenizer, trainer.model.eval()
    assert tok.chat_template  # the fallback template training used, kept on the tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    raw = tok(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] > raw.shape[1]  # the template adds the role header and generation prompt
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    assert summary["eval"]["after"]["generations"] == [tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)]
    # `maximus generate RUN` on the saved run does the same (it reads the run's data formats from run.json).
    from maximus.cli import main

    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "-p", prompt, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == prompt + summary["eval"]["after"]["generations"][0] + "\n"
    # Text and prompt/completion runs keep the raw prompt.
    from maximus.evaluate import generate_text

    with torch.no_grad():
        plain = model.generate(input_ids=raw, attention_mask=torch.ones_like(raw), max_new_tokens=6, do_sample=False,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    raw_text = tok.decode(plain[0, raw.shape[1]:], skip_special_tokens=True)
    assert generate_text(model, tok, [prompt], device=torch.device("cpu"), max_new_tokens=6) == [raw_text]
    assert raw_text != summary["eval"]["after"]["generations"][0]  # so the first check can tell them apart
