"""loss.png: train loss with held-out points (before, every eval.every steps, after), and the
measured peak memory per step against the budget and the planner's prediction."""
from __future__ import annotations

import json

import pytest
from tiny import tiny_config

from maximus import Config, Trainer
from maximus.train.progress import read_metrics, run_figure

MIB = 2 ** 20


def _lines(ax) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_figure_series_come_from_the_metrics_and_the_summary():
    rows = [{"step": 1, "loss": 3.0, "peak_memory_bytes": 10 * MIB}, {"step": 2, "loss": 2.5, "peak_memory_bytes": 12 * MIB},
            {"step": 2, "eval_loss": 2.7}, {"step": 3, "loss": None, "skipped": True, "peak_memory_bytes": 11 * MIB},
            {"step": 4, "loss": 2.0, "peak_memory_bytes": 12 * MIB}]
    summary = {"steps": 4, "eval": {"before": {"loss": 3.1}, "after": {"loss": 2.2}},
               "memory": {"budget_bytes": 16 * MIB}, "plan": {"peak_bytes": 14 * MIB}}
    fig = run_figure(rows, summary, "tiny")
    top, bottom = fig.axes
    lines = _lines(top)
    assert lines["train loss"] == ([1, 2, 4], [3.0, 2.5, 2.0])
    assert lines["held-out loss (exact)"] == ([0, 2, 4], [3.1, 2.7, 2.2])
    mem = _lines(bottom)
    assert mem["measured peak per step"] == ([1, 2, 3, 4], [10.0, 12.0, 11.0, 12.0])
    assert mem["budget 16.00 MiB"][1] == [16.0, 16.0]
    assert mem["planner prediction 14.00 MiB"][1] == [14.0, 14.0]
    assert bottom.get_ylabel() == "memory (MiB)" and top.get_title() == "tiny"


def test_a_run_without_budget_or_eval_draws_what_it_has():
    fig = run_figure([{"step": 1, "loss": 3.0, "peak_memory_bytes": MIB}], {"steps": 1, "eval": {"before": {}, "after": {}},
                                                                           "memory": {"budget_bytes": None}, "plan": {}})
    assert set(_lines(fig.axes[0])) == {"train loss"}
    assert set(_lines(fig.axes[1])) == {"measured peak per step"}


def test_a_budgeted_run_writes_both_panels(tiny_llama, pc_data, tmp_path):
    cfg = tiny_config(tiny_llama, pc_data, tmp_path / "run", optimization={"target_vram": "2GB"},
                      eval={"every": 2, "before": True})
    Trainer(Config.from_dict(cfg)).train()
    run = tmp_path / "run"
    summary = json.loads((run / "run.json").read_text())
    rows = read_metrics(run / "metrics.jsonl")
    assert (run / "loss.png").stat().st_size > 1000
    top, bottom = run_figure(rows, summary).axes
    held_out = _lines(top)["held-out loss (exact)"]
    assert held_out[0] == [0, 2, 4]
    assert held_out[1][0] == summary["eval"]["before"]["loss"] and held_out[1][-1] == summary["eval"]["after"]["loss"]
    mem = _lines(bottom)
    measured = mem["measured peak per step"]
    assert measured[0] == [1, 2, 4]  # the CPU meter's default `sampled`: first two steps, the last
    assert measured[1] == pytest.approx([r["peak_memory_bytes"] / MIB for r in rows if "peak_memory_bytes" in r])
    assert max(r["peak_memory_bytes"] for r in rows if "peak_memory_bytes" in r) == summary["memory"]["peak_bytes"]
    budget = [k for k in mem if k.startswith("budget ")]
    predicted = [k for k in mem if k.startswith("planner prediction ")]
    assert mem[budget[0]][1][0] == pytest.approx(2e9 / MIB)
    assert mem[predicted[0]][1][0] == pytest.approx(summary["plan"]["peak_bytes"] / MIB)
