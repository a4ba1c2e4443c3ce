"""`training.memory_meter`: on the CPU, `sampled` meters only the steps that can set a new peak,
and loses neither the run's peak nor a single loss value."""
import json

import pytest

from maximus import Config, Trainer
from maximus.train.metering import EVERY, MeterPolicy, meter_mode

from tiny import tiny_config


def test_auto_meters_every_step_on_cuda_only():
    assert meter_mode("auto", "cuda") == "every_step"
    assert meter_mode("auto", "cpu") == "sampled"
    assert meter_mode("every_step", "cpu") == "every_step"
    assert meter_mode("sampled", "cuda") == "sampled"


def test_sampled_meters_the_steps_that_can_set_a_peak():
    plan, replanned = object(), object()
    policy = MeterPolicy("sampled", total_steps=2 * EVERY + 3)
    lengths = {3: [10, 12], 4: [12, 12], 5: [13, 1], 6: [5, 5], 7: [10, 10]}
    metered = [step for step in range(1, 2 * EVERY + 4)
               if policy.decide(step, replanned if step >= 9 else plan, lengths.get(step, [4, 4]))]
    # 1-2 first; 3 more tokens; 4 more tokens; 5 a longer row; 9 a new plan; every 25th; the last
    assert metered == [1, 2, 3, 4, 5, 9, EVERY, 2 * EVERY, 2 * EVERY + 3]


def test_every_step_and_own_batches_are_always_metered():
    plan = object()
    every = MeterPolicy("every_step", total_steps=10)
    assert all(every.decide(s, plan, [4]) for s in range(1, 11))
    sampled = MeterPolicy("sampled", total_steps=10)
    assert all(sampled.decide(s, plan, None) for s in range(1, 11))  # GRPO: sizes known once sampled


def _rows(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]


def test_sampled_run_has_the_every_step_runs_losses_and_peak(tiny_llama, pc_data, tmp_path):
    runs = {}
    for mode in ("every_step", "sampled"):
        cfg = tiny_config(tiny_llama, pc_data, tmp_path / mode, eval={"enabled": False},
                          training={"max_steps": 6, "packing": False, "memory_meter": mode})
        Trainer(Config.from_dict(cfg)).train()
        runs[mode] = (_rows(tmp_path / mode), json.loads((tmp_path / mode / "run.json").read_text()))
    (every, every_info), (sampled, sampled_info) = runs["every_step"], runs["sampled"]
    assert [r["loss"] for r in sampled] == [r["loss"] for r in every]
    assert all("peak_memory_bytes" in r for r in every)
    metered = [r["step"] for r in sampled if "peak_memory_bytes" in r]
    assert metered[:2] == [1, 2] and metered[-1] == 6 and len(metered) < 6
    assert all("memory_bytes" not in r for r in sampled if r["step"] not in metered)
    # a metered step measures what it measures under every_step, and the highest step is metered
    by_step = {r["step"]: r["peak_memory_bytes"] for r in every}
    assert {r["step"]: r["peak_memory_bytes"] for r in sampled if r["step"] in metered} == \
        {s: by_step[s] for s in metered}
    assert sampled_info["memory"]["peak_bytes"] == every_info["memory"]["peak_bytes"] == max(by_step.values())


def test_memory_meter_key_is_checked(tiny_llama, pc_data, tmp_path):
    from maximus.errors import ConfigError

    with pytest.raises(ConfigError, match="training.memory_meter"):
        Config.from_dict(tiny_config(tiny_llama, pc_data, tmp_path, training={"memory_meter": "never"}))
