"""The embedded default builds offline, deterministically, and the quickstart config validates."""
import json
from pathlib import Path

from maximus import Config
from maximus.builtin import materialize, resolve, reverse_words_records

ROOT = Path(__file__).resolve().parents[1]


def test_reverse_words_task_is_deterministic_and_correct():
    a, b = reverse_words_records(50, seed=3), reverse_words_records(50, seed=3)
    assert a == b
    for rec in a:
        words = rec["prompt"][len("Reverse: "):-len("\nAnswer:")].split()
        assert rec["completion"].split() == words[::-1] and 3 <= len(words) <= 5


def test_builtins_materialise_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXIMUS_CACHE", str(tmp_path))
    data = Path(materialize("builtin:reverse-words"))
    lines = (data / "train.jsonl").read_text().splitlines()
    assert len(lines) == 4000 and json.loads(lines[0]).keys() == {"prompt", "completion"}
    model = Path(materialize("builtin:tiny-llama"))
    assert (model / "model.safetensors").is_file() and (model / "tokenizer.json").is_file()
    stamp = (model / "model.safetensors").stat().st_mtime_ns
    assert Path(materialize("builtin:tiny-llama")) == model  # reused, not rebuilt
    assert (model / "model.safetensors").stat().st_mtime_ns == stamp


def test_quickstart_config_resolves(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXIMUS_CACHE", str(tmp_path))
    cfg = resolve(Config.from_yaml(ROOT / "examples" / "quickstart.yaml"))
    assert Path(cfg.model).is_dir() and Path(cfg.datasets[0].path).is_dir()
    assert cfg.eval.exact_match > 0 and cfg.training.max_steps >= 100


def test_quickstart_shows_the_planner(tmp_path, monkeypatch):
    """The embedded default has a budget the planner must work for: the 16-row step does not fit
    in one pass, so the plan (made from the data's rows) splits it and says why."""
    from maximus.memory import plan_run
    from maximus.train.order import read_lengths

    monkeypatch.setenv("MAXIMUS_CACHE", str(tmp_path))
    cfg = resolve(Config.from_yaml(ROOT / "examples" / "quickstart.yaml"))
    plan = plan_run(cfg, device="cpu", lengths=read_lengths(cfg))
    assert plan.budget_bytes == 72 * 10**6 and plan.peak_bytes + plan.margin_bytes <= plan.budget_bytes
    assert (plan.micro_batch_size, plan.grad_accum) == (8, 2) and plan.effective_batch == 16
    assert "micro-batch 8 x gradient accumulation 2 x 1 rank(s) keeps the effective batch of 16" in plan.notes
    one_pass = plan_run(Config.from_dict({**cfg.to_dict(), "training": {**cfg.training.model_dump(),
                                                                         "micro_batch_size": 16}}),
                        device="cpu", lengths=read_lengths(cfg), budget_bytes=None)
    assert one_pass.peak_bytes > plan.budget_bytes
