"""Validation the article's way: your own eval file, task metrics, and the base model prompted with
K solved examples as a third column, with a verdict.

Oracles: `rouge-score` and `sacrebleu` themselves for the metrics; the tokenizer's
`apply_chat_template` for the K-shot prompt; Transformers' own loss (labels=) for the prompted
held-out loss; the pipeline's held-out rows for "never an eval row"."""
from __future__ import annotations

import json

import pytest
import torch
from tiny import one_thread, tiny_config  # noqa: F401 (one_thread: a fixture)

import maximus
from maximus.data import build_run_datasets
from maximus.errors import ConfigError, DataError
from maximus.evaluate.metrics import chrf, exact_match, load_metrics, rouge_l, score_all
from maximus.evaluate.report import summary_lines, verdict
from maximus.evaluate.tasks import TaskEval
from maximus.models import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "red green blue gold stone river cloud tiger eagle maple north south".split()


def _pc(path, n, start=0):
    with open(path, "w", encoding="utf-8") as f:
        for i in range(start, start + n):
            a, b = WORDS[i % 12], WORDS[(i * 5 + 1) % 12]
            f.write(json.dumps({"prompt": f"{i}. Swap {a} {b}:", "completion": f" {b} {a}", "n": i}) + "\n")
    return path


def _chat(path, n):
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            a, b = WORDS[i % 12], WORDS[(i * 5 + 1) % 12]
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Swap {a} {b}"},
                                             {"role": "assistant", "content": f"{b} {a}"}]}) + "\n")
    return path


def _tasks(cfg: dict):
    cfg = maximus.Config.from_dict(cfg)
    tok = load_tokenizer(cfg)
    data = build_run_datasets(cfg, tok)
    return TaskEval(cfg, tok, data), data, tok


# ------------------------------------------------------------------------------------------ metrics
PREDICTIONS = ["the cat sat on the mat", "Paris", "a quick brown fox", "  42 "]
REFERENCES = ["the cat is on the mat", "Paris", "the quick brown fox jumps", "42"]


def test_metrics_equal_the_libraries_own():
    from rouge_score import rouge_scorer
    from sacrebleu import corpus_chrf

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    assert exact_match(PREDICTIONS, REFERENCES) == 0.5
    assert rouge_l(PREDICTIONS, REFERENCES) == pytest.approx(
        sum(scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(PREDICTIONS, REFERENCES)) / 4, abs=1e-12)
    assert rouge_l(["the cat sat on the mat"], ["the cat is on the mat"]) == pytest.approx(5 / 6)  # LCS 5 of 6 and 6
    assert chrf(PREDICTIONS, REFERENCES) == pytest.approx(corpus_chrf(PREDICTIONS, [REFERENCES]).score, abs=1e-12)
    assert chrf(["Paris"], ["Paris"]) == 100.0


def test_unknown_metric_says_did_you_mean():
    with pytest.raises(ConfigError) as err:
        maximus.Config.from_dict({"model": "m", "dataset": "d", "eval": {"metrics": ["exact_match", "rougel"]}})
    assert err.value.one_line() == "config: eval.metrics: unknown metric 'rougel' (hint: did you mean 'rouge_l'?)"


def test_a_raising_custom_metric_is_recorded_as_failed(tmp_path):
    mod = tmp_path / "my_metrics.py"
    mod.write_text("def lengths(predictions, references, **columns):\n"
                   "    return sum(columns['n']) / len(predictions)\n"
                   "def broken(predictions, references, **columns):\n"
                   "    raise ValueError('no answer column\\nsecond line')\n")
    metrics = load_metrics(["exact_match", f"{mod}:lengths", f"{mod}:broken"])
    values, failed = score_all(metrics, PREDICTIONS, REFERENCES, {"n": [1, 2, 3, 4]})
    assert values == {"exact_match": 0.5, "lengths": 2.5, "broken": None}
    assert failed == {"broken": f"{mod}:broken: ValueError: no answer column"}
    with pytest.raises(ConfigError, match=r"^eval.metrics: metric file not found: nope.py"):
        load_metrics(["nope.py:f"])


# ------------------------------------------------------------------------------------------ data
def test_eval_dataset_is_not_split_from_training_and_bad_files_are_one_line(tiny_llama, tmp_path):
    train, held = _pc(tmp_path / "train.jsonl", 20), _pc(tmp_path / "eval.jsonl", 6, start=100)
    cfg = tiny_config(tiny_llama, train, tmp_path / "run", eval={"dataset": str(held), "split": 0.5})
    tasks, data, _ = _tasks({**cfg, "eval": {**cfg["eval"], "metrics": ["exact_match"]}})
    assert data.stats["train_documents"] == 20 and data.stats["eval_documents"] == 6
    assert sorted(data.eval_where) == sorted(f"{held}:{i}" for i in range(1, 7))
    assert {x.columns["n"] for x in tasks.held_out} == set(range(100, 106))

    for bad, message in ((tmp_path / "missing.jsonl", f"eval.dataset: dataset not found: {tmp_path / 'missing.jsonl'}"),
                         (tmp_path / "empty.jsonl", "eval.dataset: dataset is empty after filtering: "
                                                    f"{tmp_path / 'empty.jsonl'} (0 records read")):
        if bad.name == "empty.jsonl":
            bad.write_text("")
        run = tmp_path / f"run_{bad.stem}"
        with pytest.raises(DataError) as err:
            maximus.Trainer(maximus.Config.from_dict(tiny_config(tiny_llama, train, run, eval={"dataset": str(bad)}))).train()
        assert err.value.message.startswith(message)
        assert not run.exists()  # before any training: the run directory is not even made


# ------------------------------------------------------------------------------------------ few-shot
def test_few_shot_examples_are_never_eval_rows_and_fixed_by_seed(tiny_llama, tmp_path):
    train = _pc(tmp_path / "train.jsonl", 24)
    # Your own eval file that repeats three training records: those may not be shown as solved examples.
    overlap = tmp_path / "eval.jsonl"
    lines = train.read_text().splitlines()
    overlap.write_text("\n".join(lines[:3] + _pc(tmp_path / "more.jsonl", 3, start=50).read_text().splitlines()) + "\n")
    for extra in ({"dataset": str(overlap)}, {"split": 0.25}):
        cfg = tiny_config(tiny_llama, train, tmp_path / "run", eval={**extra, "few_shot": 8, "metrics": ["chrf"]},
                          training={"seq_len": 512})
        tasks, data, _ = _tasks(cfg)
        again, _, _ = _tasks(cfg)
        held = {x.key() for x in tasks.held_out}
        assert len(tasks.shots) == 8 and [s.id for s in tasks.shots] == [s.id for s in again.shots]
        assert not {s.id for s in tasks.shots} & set(data.eval_where)
        assert not {s.key() for s in tasks.shots} & held
        assert {s.id for s in tasks.shots} <= set(data.train_where)
    other, _, _ = _tasks({**cfg, "training": {**cfg["training"], "seed": 1}})
    assert [s.id for s in other.shots] != [s.id for s in tasks.shots]


def test_k_shot_prompt_is_the_chat_template_applied_to_those_turns(tiny_llama, tmp_path):
    data = _chat(tmp_path / "chat.jsonl", 16)
    cfg = tiny_config(tiny_llama, data, tmp_path / "run", dataset={"path": str(data), "format": "chat"},
                      eval={"split": 0.25, "few_shot": 3, "system_prompt": "Swap the two words."}, training={"seq_len": 512})
    tasks, _, tok = _tasks(cfg)
    x = tasks.held_out[0]
    turns = [{"role": "system", "content": "Swap the two words."}]
    for s in tasks.shots:
        turns += [*s.turns, {"role": "assistant", "content": s.reference}]
    turns += x.turns
    text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert tasks.prompter.chat_text(tasks.prompter.chat_messages(x, tasks.shots, "Swap the two words.")) == text
    assert tasks.prompter.prompt_ids(x, tasks.shots, "Swap the two words.") == tok(text, add_special_tokens=False).input_ids
    assert text.count("### Assistant:") == 4 and text.startswith("### System:\nSwap the two words.")
    # prompt/completion: the format's own prompt, each solved example followed by a blank line.
    pc = _pc(tmp_path / "pc.jsonl", 16)
    tasks, _, tok = _tasks(tiny_config(tiny_llama, pc, tmp_path / "run", eval={"split": 0.25, "few_shot": 2},
                                       training={"seq_len": 512}))
    x, (a, b) = tasks.held_out[0], tasks.shots
    want = f"{a.prompt}{a.reference}\n\n{b.prompt}{b.reference}\n\n{x.prompt}"
    assert tasks.prompter.prompt_ids(x, tasks.shots) == tasks.prompter.encoder.prefix_ids + tok(
        want, add_special_tokens=False).input_ids


def test_too_many_or_too_long_few_shot_says_the_longest_that_fits(tiny_llama, tmp_path):
    train = _pc(tmp_path / "train.jsonl", 12)
    cfg = tiny_config(tiny_llama, train, tmp_path / "run", eval={"split": 0.25, "few_shot": 20})
    with pytest.raises(ConfigError) as err:
        _tasks(cfg)
    assert err.value.one_line() == ("eval.few_shot: 20 is more than the 9 training examples that can be shown (with a "
                                    "prompt and an answer, not held out) (hint: the longest that fits is eval.few_shot: 1)")
    with pytest.raises(ConfigError) as err:
        _tasks({**cfg, "eval": {"split": 0.25, "few_shot": 2}})
    assert err.value.one_line().endswith("more than training.seq_len 64 (hint: the longest that fits is "
                                         "eval.few_shot: 1 (or raise training.seq_len))")
    assert err.value.one_line().startswith("eval.few_shot: 2 solved examples make held-out example ")
    tasks, _, _ = _tasks({**cfg, "eval": {"split": 0.25, "few_shot": 1}})  # the one it named fits
    assert max(tasks.prompter.length(x, tasks.shots, None) for x in tasks.held_out) <= 64


# ------------------------------------------------------------------------------------------ verdict
def test_verdict_lines():
    assert verdict({"exact_match": 0.71, "loss": 0.61}, {"few_shot": 4, "exact_match": 0.38, "loss": 1.92},
                   ["exact_match"])["text"] == "fine-tuned beats 4-shot prompting: exact match 71 % vs 38 %, held-out loss 0.61 vs 1.92"
    tie = verdict({"exact_match": 0.71, "rouge_l": 0.5, "loss": 0.61}, {"few_shot": 4, "exact_match": 0.705,
                                                                         "rouge_l": 0.495, "loss": 0.7},
                  ["exact_match", "rouge_l"])
    assert tie["text"] == "4-shot prompting is within 1 point of the fine-tune: you may not need it (held-out loss 0.61 vs 0.70)"
    assert tie["winner"] == "tie"
    lost = verdict({"chrf": 40.0, "loss": 0.9}, {"few_shot": 2, "chrf": 55.5, "loss": 0.8}, ["chrf"])
    assert lost["text"] == "2-shot prompting beats the fine-tune: chrF 40.0 vs 55.5, held-out loss 0.90 vs 0.80: you may not need it"
    assert verdict({"loss": 1.0}, {"few_shot": 1, "loss": 2.0}, [])["text"] == \
        "fine-tuned beats 1-shot prompting: held-out loss 1.00 vs 2.00"


def test_summary_table_without_generations_does_not_index_past_them():
    """Two eval.prompts and no generations (eval off, DPO before this fix): the old table raised IndexError."""
    lines = summary_lines({}, {}, None, None, metrics=[], prompts=["a", "b"])
    assert lines == [f"{'':<26}{'base (before)':>16}{'tuned (after)':>16}", "prompt: 'a'", "prompt: 'b'"]


# ------------------------------------------------------------------------------------------ end to end
def test_prompted_baseline_in_the_run_the_table_and_maximus_eval(tiny_llama, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from maximus.cli import main

    train, held = _pc(tmp_path / "train.jsonl", 24), _pc(tmp_path / "eval.jsonl", 4, start=200)
    mod = tmp_path / "m.py"
    mod.write_text("def broken(predictions, references, **columns):\n    raise KeyError('answer')\n")
    cfg = tiny_config(tiny_llama, train, tmp_path / "run", training={"max_steps": 2, "seq_len": 128},
                      eval={"dataset": str(held), "metrics": ["exact_match", "rouge_l", "chrf", f"{mod}:broken"],
                            "few_shot": 2, "max_new_tokens": 4})
    trainer = maximus.Trainer(maximus.Config.from_dict(cfg))
    summary = trainer.train()
    out = capsys.readouterr().out.splitlines()
    ev = json.loads((tmp_path / "run" / "run.json").read_text())["eval"]
    assert ev == json.loads(json.dumps(summary["eval"]))
    prompted = ev["prompted"]
    assert prompted["few_shot"] == 2 and prompted["examples"] == [s.id for s in trainer.tasks.shots]
    assert set(prompted) >= {"loss", "perplexity", "exact_match", "rouge_l", "chrf", "seconds"}
    assert ev["after"]["metrics_failed"] == {"broken": f"{mod}:broken: KeyError: 'answer'"}
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()  # the run finished
    # Oracle for the prompted loss: Transformers' own mean loss (labels=) on each K-shot row, token-weighted.
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    total = count = 0
    for x in trainer.tasks.held_out:
        row = trainer.tasks.prompter.loss_row(x, trainer.tasks.shots, None, 128)
        n = sum(label != -100 for label in row["labels"][1:])
        with torch.no_grad():
            total += float(base(input_ids=torch.tensor([row["input_ids"]]), labels=torch.tensor([row["labels"]])).loss) * n
        count += n
    assert prompted["loss"] == pytest.approx(total / count, rel=1e-5)
    header = next(line for line in out if "base (before)" in line)
    assert header == f"{'':<26}{'base (before)':>16}{'base + 2-shot':>16}{'tuned (after)':>16}"
    assert f"verdict: {ev['verdict']['text']}" in out
    assert any(line.startswith("held-out chrF") for line in out)
    assert any(line.startswith("prompting baseline: ") for line in out)

    # maximus eval RUN --dataset FILE: the same three columns on another file.
    other = _pc(tmp_path / "other.jsonl", 3, start=300)
    assert main(["eval", str(tmp_path / "run"), "--dataset", str(other), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompted"]["few_shot"] == 2 and result["verdict"]["text"]
    assert result["after"]["scored"] == result["before"]["scored"] == 3
    assert result["prompted"]["examples"] == prompted["examples"]  # the same solved examples, from the run's data


# ------------------------------------------------------------------------------------------ other objectives
def test_eval_keys_other_objectives_cannot_honour_are_refused_by_name():
    base = {"model": "m", "dataset": "d"}
    for objective, key, value, own in (("dpo", "exact_match", 4, "its held-out rewards/accuracy and chosen-answer perplexity"),
                                       ("grpo", "metrics", ["rouge_l"], "its held-out greedy reward (the exact_answer "
                                                                        "reward for exact match)"),
                                       ("contrastive", "prompts", ["hi"], "its held-out recall@k (embed texts with maximus embed)"),
                                       ("dpo", "few_shot", 2, "its held-out rewards/accuracy and chosen-answer perplexity")):
        with pytest.raises(ConfigError) as err:
            maximus.Config.from_dict({**base, "objective": objective, "eval": {key: value}})
        assert err.value.one_line() == f"config: eval.{key} does not apply to objective {objective} (hint: remove it; objective {objective} reports {own})"


def test_dpo_generates_for_eval_prompts_and_eval_off_runs_finish(tiny_llama, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Say {w}:", "chosen": f" {w}", "rejected": " no"}) + "\n"
                             for w in WORDS * 2))
    prompts = ["Say red:", "Say blue:"]
    cfg = tiny_config(tiny_llama, pairs, tmp_path / "dpo", dataset={"path": str(pairs), "format": "preference"},
                      objective="dpo", training={"max_steps": 1, "seq_len": 32},
                      eval={"prompts": prompts, "max_new_tokens": 3, "before": False})
    summary = maximus.Trainer(maximus.Config.from_dict(cfg)).train()
    assert len(summary["eval"]["after"]["generations"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[out.index("prompt: 'Say blue:'") + 1] == f"  after:  {summary['eval']['after']['generations'][1]!r}"
    # Evaluation off, two prompts: the run finishes (the table used to index generations that never came).
    pc = _pc(tmp_path / "pc.jsonl", 12)
    off = tiny_config(tiny_llama, pc, tmp_path / "off", training={"max_steps": 1}, eval={"enabled": False, "prompts": prompts})
    assert maximus.Trainer(maximus.Config.from_dict(off)).train()["eval"]["after"] == {}


def test_batched_greedy_completions_equal_one_at_a_time(tiny_llama):
    """Left-padded batches (what the metrics decode with) give the one-prompt-at-a-time completions."""
    from transformers import AutoModelForCausalLM

    from maximus.evaluate import greedy_texts

    tok = load_tokenizer(maximus.Config.from_dict({"model": str(tiny_llama), "dataset": "-"}))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    prompts = [tok(t, add_special_tokens=False).input_ids for t in ("red", "green blue gold stone", "river cloud tiger",
                                                                    "eagle maple north south red green blue")]
    one = greedy_texts(model, tok, prompts, device=torch.device("cpu"), max_new_tokens=6)
    assert greedy_texts(model, tok, prompts, device=torch.device("cpu"), max_new_tokens=6, batch_size=3) == one
    assert len(set(one)) > 1


def test_eval_max_examples_generates_exactly_that_many_completions(tiny_llama, tmp_path, monkeypatch):
    """`eval.max_examples: N` with more held-out examples: exactly N greedy completions, scored."""
    from transformers import AutoModelForCausalLM

    import maximus.evaluate as evaluate

    train, held = _pc(tmp_path / "train.jsonl", 20), _pc(tmp_path / "eval.jsonl", 6, start=100)
    cfg = tiny_config(tiny_llama, train, tmp_path / "run", eval={"dataset": str(held), "max_new_tokens": 2})
    tasks, _, _ = _tasks({**cfg, "eval": {**cfg["eval"], "metrics": ["exact_match"], "max_examples": 4}})
    assert len(tasks.held_out) == 6
    generated = []
    real = evaluate.greedy_texts

    def counting(model, tokenizer, prompts, **kw):
        out = real(model, tokenizer, prompts, **kw)
        generated.append(len(out))
        return out

    monkeypatch.setattr(evaluate, "greedy_texts", counting)
    result = tasks.score(AutoModelForCausalLM.from_pretrained(str(tiny_llama)).eval(), device="cpu")
    assert generated == [4] and result["scored"] == 4
    assert [x.columns["n"] for x in tasks.examples] == [x.columns["n"] for x in tasks.held_out[:4]]
