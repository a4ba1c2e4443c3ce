"""The embedded default builds offline, deterministically, and the quickstart config validates, plans on
the CPU and on CUDA, and is resolved by every command that reads a config."""
import json
from pathlib import Path

import pytest

from maximus import Config
from maximus.builtin import materialize, resolve, reverse_words_records
from maximus.cli import main

ROOT = Path(__file__).resolve().parents[2]


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


def test_a_foreign_folder_in_the_cache_is_refused_untouched(tmp_path, monkeypatch):
    from maximus.builtin import builtin_dir
    from maximus.errors import ConfigError

    monkeypatch.setenv("MAXIMUS_CACHE", str(tmp_path))
    foreign = builtin_dir("reverse-words")
    foreign.mkdir(parents=True)
    (foreign / "mine.txt").write_text("mine")
    with pytest.raises(ConfigError) as err:
        materialize("builtin:reverse-words")
    assert str(err.value) == (f"{foreign} exists and holds no complete build of the embedded default (no .complete) "
                              "(hint: move it away, or set MAXIMUS_CACHE to another directory; nothing was changed)")
    assert [p.name for p in foreign.iterdir()] == ["mine.txt"]


def test_quickstart_config_resolves(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXIMUS_CACHE", str(tmp_path))
    cfg = resolve(Config.from_yaml(ROOT / "examples" / "quickstart.yaml"))
    assert Path(cfg.model).is_dir() and Path(cfg.datasets[0].path).is_dir()
    assert cfg.eval.exact_match > 0 and cfg.training.max_steps >= 100


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_quickstart_shows_the_planner(tmp_path, monkeypatch, device):
    """The embedded default has a budget the planner must work for, on the CPU and on CUDA (where
    64 MiB of workspace counts too): the 16-row step does not fit in one pass, so the plan (made
    from the data's rows) splits it and says why; on CUDA it also recomputes layers."""
    from maximus.memory import plan_run
    from maximus.train.order import read_lengths

    monkeypatch.setenv("MAXIMUS_CACHE", str(tmp_path))
    cfg = resolve(Config.from_yaml(ROOT / "examples" / "quickstart.yaml"))
    plan = plan_run(cfg, device=device, lengths=read_lengths(cfg))
    assert plan.budget_bytes == 100 * 10**6 and plan.peak_bytes + plan.margin_bytes <= plan.budget_bytes
    assert (plan.micro_batch_size, plan.grad_accum) == (8, 2) and plan.effective_batch == 16
    assert "micro-batch 8 x gradient accumulation 2 x 1 rank(s) keeps the effective batch of 16" in plan.notes
    assert set(plan.recompute) == {"none"} if device == "cpu" else "full" in plan.recompute
    one_pass = plan_run(Config.from_dict({**cfg.to_dict(), "training": {**cfg.training.model_dump(),
                                                                         "micro_batch_size": 16}}),
                        device=device, lengths=read_lengths(cfg), budget_bytes=None)
    assert one_pass.peak_bytes > plan.budget_bytes


@pytest.fixture(scope="module")
def builtin_cache(tmp_path_factory):
    """One cache for the tests below: the builtins are built once."""
    return tmp_path_factory.mktemp("cache")


def test_plan_and_its_probe_read_the_embedded_default(tmp_path, builtin_cache, monkeypatch, capsys):
    """`maximus plan --config` (here with `--measure`: the probe trains the run) plans the builtin:
    model on its data, as maximus-train does; the report names the model as the config does."""
    monkeypatch.setenv("MAXIMUS_CACHE", str(builtin_cache))
    config = tmp_path / "quickstart.yaml"  # the quickstart on 200 of its rows: a quicker probe
    text = (ROOT / "examples" / "quickstart.yaml").read_text()
    config.write_text(text.replace("  format: prompt_completion\n", "  format: prompt_completion\n  max_samples: 200\n"))
    assert main(["plan", "--config", str(config), "--measure", "--probe-steps", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "builtin:tiny-llama" and "data_note" not in report
    assert report["budget"]["fits"] and report["budget"]["plan"]["micro_batch_size"] == 8
    probe = report["measure"]["probe"]
    assert (probe["device"], probe["steps"], probe["probe_tokens"]) == ("cpu", 1, 128) and probe["measured_peak_bytes"] > 0


def test_the_ui_takes_the_embedded_default(tmp_path, builtin_cache, monkeypatch):
    """A builtin: name is no path to confine; the UI's planner (`maximus plan --model`) resolves it."""
    from maximus.plan_command import plan_json
    from maximus.ui.confine import Roots, confine_config

    monkeypatch.setenv("MAXIMUS_CACHE", str(builtin_cache))
    roots = Roots.of(tmp_path / "data", tmp_path / "models", tmp_path / "runs")
    data, _ = confine_config((ROOT / "examples" / "quickstart.yaml").read_text(), roots,
                             overrides=[f"output_dir={tmp_path / 'runs' / 'qs'}"])
    assert (data["model"], data["dataset"]["path"]) == ("builtin:tiny-llama", "builtin:reverse-words")
    report = plan_json(["--model", "builtin:tiny-llama", "--seq", "128", "--batch", "16"])
    assert report["model"] == "builtin:tiny-llama" and report["requested"]["seq_len"] == 128


def test_a_run_of_the_embedded_default_evaluates_and_exports_after_the_cache_is_cleared(tmp_path, monkeypatch, capsys):
    """run.json records `builtin:` names as written; `maximus eval` and `maximus export` resolve
    them (the cache rebuilt, the same base: eval reproduces the run's own held-out loss)."""
    import shutil

    monkeypatch.setenv("MAXIMUS_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    assert main(["train", "--config", str(ROOT / "examples" / "quickstart.yaml"), f"output_dir={run}",
                 "dataset.max_samples=200", "training.max_steps=2", "training.batch_size=4", "training.micro_batch_size=4", "training.packing=false",
                 "training.save_every=null", "optimization.target_vram=null", "eval.before=false", "eval.exact_match=0",
                 "eval.prompts=[]", "logging.progress=none"]) == 0
    recorded = json.loads((run / "run.json").read_text())
    assert (recorded["config"]["model"], recorded["config"]["dataset"][0]["path"]) == ("builtin:tiny-llama",
                                                                                        "builtin:reverse-words")
    shutil.rmtree(tmp_path / "cache")
    monkeypatch.setenv("MAXIMUS_CACHE", str(tmp_path / "other-cache"))
    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0
    after = json.loads(capsys.readouterr().out)["after"]
    assert after["loss"] == pytest.approx(recorded["eval"]["after"]["loss"], rel=1e-5)
    assert main(["export", str(run), "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file()
