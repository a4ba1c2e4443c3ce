"""Our training loss is Transformers' loss; the adapter PEFT loads gives our logits; gradient
accumulation equals one big batch; every method trains on real models."""
import json
from dataclasses import replace

import pytest
import torch

from maximus import Config, Trainer, load_model
from maximus.data import collate
from maximus.memory import plan_run
from maximus.train.objectives.base import SFTObjective

from tiny import ARCHS, tiny_config


@pytest.mark.parametrize("arch", ARCHS)
def test_exact_loss_equals_transformers_loss(arch, tiny_model_dirs, pc_data, tmp_path):
    cfg = Config.from_dict(tiny_config(tiny_model_dirs[arch], pc_data, tmp_path / "run"))
    model, tok = load_model(cfg)
    torch.manual_seed(0)
    ids = torch.randint(2, len(tok), (2, 24))
    labels = ids.clone()
    labels[:, :5] = -100
    batch = {"input_ids": ids, "labels": labels}
    for mode in ("exact", "naive"):
        obj = SFTObjective(cfg, replace(plan_run(cfg, device="cpu"), loss_mode=mode), tok.pad_token_id)
        ours, _ = obj.loss_sum(model, batch)
        ours = ours / obj.count(batch)
        ref = model(input_ids=ids, labels=labels).loss
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_packed_boundary_targets_are_ignored(tiny_llama, pc_data, tmp_path):
    from maximus.forward import shift_labels

    labels = torch.tensor([[10, 11, 12, 20, 21, 22]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert shift_labels(labels, pos).tolist() == [[11, 12, -100, 21, 22, -100]]


def _run(cfg_dict):
    cfg = Config.from_dict(cfg_dict)
    return Trainer(cfg).train(), cfg


def test_adapter_loads_in_peft_with_identical_logits(tiny_llama, pc_data, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    summary, cfg = _run(tiny_config(tiny_llama, pc_data, tmp_path / "run"))
    run = tmp_path / "run"
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert (run / "adapter" / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(run / "adapter")).eval()
    from maximus.export import load_tuned

    ours, _ = load_tuned(run)
    ids = torch.randint(2, 200, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=0, atol=0)
    # the adapter moved away from the base
    with torch.no_grad(), peft_model.disable_adapter():
        assert not torch.allclose(peft_model(input_ids=ids).logits, ours(input_ids=ids).logits)
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {"loss", "lr", "tokens_per_s"} <= set(r)
    # the CPU meter's default `sampled`: the first two steps and the last (equal packed rows)
    assert [r["step"] for r in rows if "peak_memory_bytes" in r] == [1, 2, 4]
    info = json.loads((run / "run.json").read_text())
    assert info["eval"]["before"]["loss"] > info["eval"]["after"]["loss"]
    assert info["memory"]["peak_bytes"] > 0 and (run / "loss.png").stat().st_size > 1000


def test_gradient_accumulation_equals_one_big_batch(tiny_llama, pc_data, tmp_path):
    from safetensors.torch import load_file

    outs = []
    for micro in (1, 4):
        cfg = tiny_config(tiny_llama, pc_data, tmp_path / f"m{micro}", training={"micro_batch_size": micro, "max_steps": 2},
                          eval={"enabled": False})
        _run(cfg)
        outs.append(load_file(str(tmp_path / f"m{micro}" / "adapter" / "adapter_model.safetensors")))
    for k in outs[0]:
        torch.testing.assert_close(outs[0][k], outs[1][k], rtol=1e-3, atol=2e-5)


@pytest.mark.parametrize("method", ["full", "qlora"])
def test_other_methods_train(method, tiny_llama, pc_data, tmp_path):
    summary, _ = _run(tiny_config(tiny_llama, pc_data, tmp_path / "run", method=method,
                                  training={"max_steps": 3, "learning_rate": 3e-3 if method == "full" else 1e-2}))
    assert summary["eval"]["after"]["loss"] < summary["eval"]["before"]["loss"]
    produced = "model" if method == "full" else "adapter"
    assert (tmp_path / "run" / produced / ("model.safetensors" if method == "full" else "adapter_model.safetensors")).is_file()
    assert summary["method"] == method


def test_out_of_memory_replans_and_redoes_the_step(tiny_llama, pc_data, tmp_path):
    """The runtime guard: an OOM (simulated by a hook, as CUDA would raise it) halves the
    micro-batch and redoes the same rows, so the run equals one planned that way from the start."""
    from safetensors.torch import load_file

    raised = []

    def oom_once(trainer, step):
        if step == 2 and not raised:
            raised.append(step)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    base = tiny_config(tiny_llama, pc_data, tmp_path / "a", training={"micro_batch_size": 4, "max_steps": 3},
                       eval={"enabled": False})
    summary = Trainer(Config.from_dict(base), hooks={"after_backward": oom_once}).train()
    assert summary["replans"] == [{"step": 2, "reason": "out of memory", "change": "micro-batch 4 -> 2",
                                   "predicted_peak_bytes": summary["plan"]["peak_bytes"]}]
    # The effective batch stays: twice the accumulation.
    assert (summary["plan"]["micro_batch_size"], summary["plan"]["grad_accum"]) == (2, 2)
    ref = tiny_config(tiny_llama, pc_data, tmp_path / "b", training={"micro_batch_size": 2, "max_steps": 3},
                      eval={"enabled": False})
    Trainer(Config.from_dict(ref)).train()
    a = load_file(str(tmp_path / "a" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter" / "adapter_model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=2e-5)


def test_seed_article_config_runs_as_written(tiny_llama, pc_data, tmp_path):
    """The article's config (target_vram 16GB, ghost logit, Kronecker sketching, batch 4, epochs)
    with only the model and dataset pointed at local files."""
    import yaml

    from tiny import ARTICLE_YAML

    article = yaml.safe_load(ARTICLE_YAML)
    article.update(model=str(tiny_llama), dataset=str(pc_data), output_dir=str(tmp_path / "seed"),
                   logging={"progress": "none"})
    article["training"].update(epochs=1, seq_len=64, dtype="fp32")  # a tiny run; the rest as written
    text = yaml.safe_dump(article)
    path = tmp_path / "seed.yaml"
    path.write_text(text)
    summary = Trainer(Config.from_yaml(path)).train()
    assert summary["plan"]["budget_bytes"] == 16 * 10**9 and summary["plan"]["loss_mode"] == "ghost"
    assert summary["plan"]["peak_bytes"] <= 16 * 10**9
    # the sketch is installed, and run.json says so
    assert summary["kernels"]["attention"] == "kronecker"
    assert summary["plan"]["attention"] == {"kind": "kronecker", "detail_tokens": 256, "sketch_slots": 64, "block": 64}
    assert summary["eval"]["after"]["loss"] < summary["eval"]["before"]["loss"]  # evaluated with the exact loss
    cfg = yaml.safe_load(path.read_text())
    assert cfg["optimization"]["kronecker_sketching"] is True
    # No `method:` beside a budget: the planner picks QLoRA or LoRA (never full unless asked), and the
    # trained sketches are saved with the adapter.
    assert summary["method"] in ("qlora", "lora")
    from peft import PeftConfig

    saved = PeftConfig.from_pretrained(str(tmp_path / "seed" / "adapter"))
    assert any("kronecker" in m for m in (saved.modules_to_save or []))


def test_matryoshka_objective_trains(tiny_llama, pc_data, tmp_path):
    """The auxiliary loss is in the trained loss: the first step (same rows, same weights) logs the
    plain loss plus weight x the prefix losses, linear in the weight, and the run still learns."""
    def first_loss(name, weight, steps=1):
        matryoshka = None if weight is None else {"dims": [16, 32], "weight": weight, "token_fraction": 1.0}
        summary, _ = _run(tiny_config(tiny_llama, pc_data, tmp_path / name, optimization={"matryoshka": matryoshka},
                                      training={"max_steps": steps}))
        rows = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return rows[0]["loss"], summary

    plain, _ = first_loss("plain", None)
    low, summary = first_loss("low", 0.2, steps=4)
    high, _ = first_loss("high", 0.4)
    # A random tiny model's prefix losses are near ln(vocab) ~ 5.7, so weight 0.2 adds about 1.1.
    assert low - plain > 0.5
    assert high - plain == pytest.approx(2 * (low - plain), rel=1e-4)
    assert summary["eval"]["after"]["loss"] < summary["eval"]["before"]["loss"]


def test_no_target_vram_plans_against_free_ram_and_recomputes_nothing(tiny_llama, pc_data, tmp_path):
    """The default config (no target_vram, `gradient_checkpointing: auto`) fits the plan to the
    free memory, read as `target_vram: auto` reads it; a tiny run fits many times over, so no
    layer recomputes. The meter is held to no budget: free memory is not one the user gave."""
    import psutil

    from maximus.memory.planner import resolve_budget

    cfg = tiny_config(tiny_llama, pc_data, tmp_path / "run", optimization={"gradient_checkpointing": "auto"},
                      training={"micro_batch_size": "auto"}, eval={"enabled": False})
    before = resolve_budget("auto", "cpu")
    trainer = Trainer(Config.from_dict(cfg))
    trainer.setup()
    after = psutil.virtual_memory().available
    free = trainer.plan.free_memory_bytes
    assert min(before, after) - 2**30 <= free <= max(before, after) + 2**30
    assert trainer.plan.recompute == ("none", "none") and trainer.checkpointing.modes == ["none", "none"]
    assert trainer.plan.micro_batch_size == 4  # the fastest micro-batch that fits: the whole batch
    assert trainer.plan.budget_bytes is None and trainer.meter.budget_bytes is None


def test_a_step_over_the_meter_budget_replans(tiny_llama, pc_data, tmp_path):
    """The trainer re-plans on the meter's budget (memory.meter.MemoryMeter.budget_bytes)."""
    import io

    def tighten(trainer, step):
        if step == 1:
            trainer.meter.budget_bytes = 1

    stream = io.StringIO()
    cfg = tiny_config(tiny_llama, pc_data, tmp_path / "run", training={"micro_batch_size": 4, "max_steps": 2},
                      eval={"enabled": False}, logging={"progress": "plain"})
    trainer = Trainer(Config.from_dict(cfg), hooks={"after_backward": tighten}, stream=stream)
    trainer.train()
    lines = [line for line in stream.getvalue().splitlines() if "over the budget" in line]
    assert [line.split(" peaked at ")[0] for line in lines] == ["warning: step 1", "warning: step 2"]
    assert lines[0].endswith("over the budget of 1; re-planned for the next steps: micro-batch 4 -> 2")
    assert trainer.plan.micro_batch_size == 1 and [r["step"] for r in trainer.replans] == [1, 2]
