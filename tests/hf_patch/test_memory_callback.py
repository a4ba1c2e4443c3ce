"""`maximus.MemoryCallback` in a real `transformers.Trainer`: memory per step in the logs, and a
budget that stops the run with one line."""
from __future__ import annotations

import pytest
from conftest import lora_model
from test_patch_trainers import _hf_rows, _hf_trainer

import maximus
from maximus.config import format_bytes
from maximus.memory.meter import unique_storage_bytes


def test_memory_logged_per_step(tiny_llama, tmp_path):
    callback = maximus.MemoryCallback()
    model = lora_model(tiny_llama)
    trainer = _hf_trainer(model, tmp_path / "run", _hf_rows(tiny_llama), max_steps=3)
    trainer.add_callback(callback)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2, 3]
    held, _ = unique_storage_bytes(list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
                                   + [t for s in trainer.optimizer.state.values() for t in s.values()])
    for h in logs:
        assert h["peak_memory_bytes"] >= h["memory_bytes"] > 0
        assert "budget_bytes" not in h
    assert logs[-1]["memory_bytes"] >= held  # weights, gradients and AdamW state at least


def test_budget_stops_the_run(tiny_llama, tmp_path, capsys):
    first = maximus.MemoryCallback()
    trainer = _hf_trainer(lora_model(tiny_llama), tmp_path / "a", _hf_rows(tiny_llama), max_steps=1)
    trainer.add_callback(first)
    trainer.train()
    peak = trainer.state.log_history[0]["peak_memory_bytes"]
    budget = peak - 1024
    callback = maximus.MemoryCallback(budget=budget)
    trainer = _hf_trainer(lora_model(tiny_llama), tmp_path / "b", _hf_rows(tiny_llama), max_steps=4)
    trainer.add_callback(callback)
    trainer.train()
    assert trainer.state.global_step == 1
    got = trainer.state.log_history[0]
    assert got["budget_bytes"] == budget and got["peak_memory_bytes"] > budget
    assert callback.stopped_message == (f"maximus.MemoryCallback: step 1 peaked at {format_bytes(got['peak_memory_bytes'])}, "
                                        f"over the budget of {format_bytes(budget)}; stopping the run")
    assert callback.stopped_message in capsys.readouterr().err
