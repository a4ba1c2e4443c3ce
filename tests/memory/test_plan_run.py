"""`plan_run`: the one config -> plan translation; the typed, immutable `Plan`; the loss key;
offload on CPU; a prediction for every run."""
import dataclasses
import io
import json
from contextlib import redirect_stdout

import pytest

from maximus import Config
from maximus.errors import ConfigError
from maximus.memory import Plan, estimate_peak, plan_run, replan
from maximus.plan_command import plan_main

EIGHT_B = "meta-llama/Llama-3.1-8B"
ARTICLE = {"model": "mistralai/Mistral-12B-v0.1", "dataset": "my_dataset",
           "optimization": {"target_vram": "16GB", "use_ghost_logit": True, "kronecker_sketching": True},
           "training": {"batch_size": 4, "epochs": 3}}


def _cfg(**sections) -> Config:
    data = {"model": EIGHT_B, "dataset": "unused"}
    data.update(sections)
    return Config.from_dict(data)


# -- the loss key ------------------------------------------------------------------------------------


def test_use_ghost_logit_is_the_articles_spelling_of_loss_ghost():
    assert _cfg(optimization={"use_ghost_logit": True}).optimization.loss_mode == "ghost"
    assert _cfg(optimization={"loss": "ghost"}).optimization.loss_mode == "ghost"
    assert _cfg(optimization={"use_ghost_logit": True, "loss": "ghost"}).optimization.loss_mode == "ghost"
    assert _cfg().optimization.loss_mode == "exact"
    plan = plan_run(_cfg(optimization={"loss": "ghost", "ghost_logit": {"candidates": 512}}), device="cuda")
    assert (plan.loss_mode, plan.ghost_candidates) == ("ghost", 512)


def test_use_ghost_logit_with_loss_naive_is_one_error_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        _cfg(optimization={"use_ghost_logit": True, "loss": "naive"})
    assert str(err.value) == (
        "config: optimization.use_ghost_logit: true contradicts optimization.loss: naive (hint: keep one of "
        "them: loss: ghost (or use_ghost_logit: true) for the Ghost Logit loss, or use_ghost_logit: false for "
        "loss: naive)")


def test_the_loss_key_round_trips_through_run_json():
    # use_ghost_logit beside the default loss names the loss; the dump (run.json's config) says ghost once
    cfg = _cfg(optimization={"use_ghost_logit": True, "loss": "exact"})
    assert cfg.optimization.loss == cfg.optimization.loss_mode == "ghost"
    again = Config.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again.optimization.loss_mode == "ghost" and again.to_dict() == cfg.to_dict()


def test_loss_ghost_is_refused_by_an_objective_without_a_vocabulary_softmax():
    from maximus.train.objectives.contrastive import ContrastiveObjective

    with pytest.raises(ConfigError) as err:
        ContrastiveObjective(_cfg(objective="contrastive", optimization={"loss": "ghost"}), None, 0)
    assert str(err.value) == ("optimization.loss: ghost does not apply to objective contrastive (hint: set "
                              "optimization.loss: exact; the contrastive loss has no vocabulary softmax)")


# -- the Plan ----------------------------------------------------------------------------------------


def test_plan_is_immutable_and_a_replan_is_a_new_re_estimated_plan():
    cfg = _cfg(method="qlora", training={"batch_size": 8, "micro_batch_size": 4}, optimization={"target_vram": "24GB"})
    plan = plan_run(cfg, device="cuda")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.micro_batch_size = 1
    assert plan.micro_batch_size > 1 and all(m in ("none", "selective", "full") for m in plan.recompute)
    half = replan(plan, None, micro_batch_size=plan.micro_batch_size // 2)
    assert half is not plan and (plan.micro_batch_size, half.micro_batch_size, half.grad_accum) == (4, 2, 4)
    assert half.effective_batch == plan.effective_batch == 8
    again = estimate_peak(EIGHT_B, method="qlora", micro_batch=half.micro_batch_size, grad_accum=half.grad_accum,
                          checkpointing=list(half.recompute), loss_chunk_tokens=half.loss_chunk_size,
                          tile_tokens=half.tile_tokens, lean_lora=True)  # optimization.lean_lora's default
    assert (half.peak_bytes, half.breakdown, half.peak_phase) == (again.peak_bytes, again.breakdown, again.phase)


def test_every_run_has_a_prediction_also_without_a_budget():
    cfg = _cfg(method="lora", training={"batch_size": 8, "micro_batch_size": 2},
               optimization={"gradient_checkpointing": "full"})
    plan = plan_run(cfg, device="cuda")
    assert plan.budget_bytes is None and plan.recompute == ("full",) * 32 and plan.grad_accum == 4
    expected = estimate_peak(EIGHT_B, method="lora", micro_batch=2, grad_accum=4, checkpointing="full",
                             loss_chunk_tokens=plan.loss_chunk_size, tile_tokens=plan.tile_tokens, lean_lora=True)
    assert plan.peak_bytes == expected.peak_bytes > 0 and plan.peak_phase == expected.phase
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["peak_bytes"] == plan.peak_bytes and d["recompute"] == ["full"] * 32 and d["strategy"] == "single"
    assert d["attention"] == {"kind": "sdpa", "detail_tokens": None, "sketch_slots": None, "block": None}


def test_the_articles_config_plans_every_technique_it_names():
    plan = plan_run(Config.from_dict(ARTICLE), device="cuda")
    assert isinstance(plan, Plan) and plan.budget_bytes == 16 * 10**9
    assert plan.method in ("qlora", "lora") and plan.loss_mode == "ghost" and plan.ghost_candidates == 1024
    assert (plan.attention.kind, plan.attention.detail_tokens, plan.attention.sketch_slots) == ("kronecker", 256, 64)
    assert plan.peak_bytes + plan.margin_bytes <= plan.budget_bytes
    text = plan.text()
    assert "kronecker (detail 256 tokens, 64 sketch slots, block 64)" in text
    assert "ghost (1024 candidates)" in text  # the ghost chunk is the loss's own unless set


def test_maximus_plan_and_maximus_train_make_the_same_plan(tmp_path):
    path = tmp_path / "config.yaml"
    import yaml

    path.write_text(yaml.safe_dump(ARTICLE))
    out = io.StringIO()
    with redirect_stdout(out):
        assert plan_main(["--config", str(path), "--json"]) == 0
    report = json.loads(out.getvalue())
    assert report["budget"]["plan"] == plan_run(Config.from_yaml(path), device="cuda").to_dict()
    # flags are config overrides, planned by the same function
    out = io.StringIO()
    with redirect_stdout(out):
        assert plan_main(["--model", EIGHT_B, "--method", "qlora", "--batch", "4", "--budget", "16GB", "--json"]) == 0
    report = json.loads(out.getvalue())
    cfg = _cfg(method="qlora", training={"batch_size": 4}, optimization={"target_vram": "16GB"})
    assert report["budget"]["plan"] == plan_run(cfg, device="cuda").to_dict()


# -- offload on CPU ----------------------------------------------------------------------------------


def test_cpu_plans_never_offload_and_say_it_does_not_apply():
    from maximus.errors import BudgetError

    tight = dict(method="qlora", training={"batch_size": 2, "seq_len": 2048}, optimization={"target_vram": "7.5GB"})
    on_gpu = plan_run(_cfg(**tight), device="cuda")
    assert on_gpu.offload_optimizer or on_gpu.offload_activations  # the GPU fits by moving state to the host
    with pytest.raises(BudgetError):  # on CPU the host is the device: offload cannot make room
        plan_run(_cfg(**tight), device="cpu")
    roomy = plan_run(_cfg(method="lora", optimization={"target_vram": "64GB"}), device="cpu")
    rows = dict(roomy.rows()[:9])
    assert rows["offload"] == "does not apply (CPU: host and device memory are the same)"
    # asked for outright, it is honoured, and the table says what it buys on a CPU
    forced = plan_run(_cfg(method="lora", optimization={"target_vram": "64GB", "offload": {"optimizer": "on"}}),
                      device="cpu")
    assert forced.offload_optimizer
    assert dict(forced.rows()[:9])["offload"] == "optimizer (no effect on CPU: host and device memory are the same)"
