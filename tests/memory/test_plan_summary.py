"""One line per plan, `Plan.summary()`: `maximus plan`'s per-card table and `maximus ui` print the
same words for the same plan."""
from __future__ import annotations

from maximus.config import Config
from maximus.memory import plan_run
from maximus.memory.plan import plan_summary
from maximus.ui.routes.planner import plan_text


def test_summary_words_and_one_implementation(tiny_llama, tmp_path):
    cfg = Config.from_dict({"model": str(tiny_llama), "dataset": str(tmp_path / "d.jsonl"), "method": "lora",
                            "training": {"batch_size": 8, "micro_batch_size": 2, "seq_len": 64},
                            "optimization": {"gradient_checkpointing": "full"}})
    plan = plan_run(cfg, device="cpu")
    assert plan.summary() == "lora mb 2 x acc 4, ckpt full"
    assert plan_text(plan.to_dict()) == plan.summary() == plan_summary(plan.to_dict())


def test_summary_of_a_plan_dict_names_offload_and_tiles():
    p = {"method": "qlora", "micro_batch_size": 1, "grad_accum": 8, "recompute": ["full", "none"],
         "offload_activations": True, "offload_params": True, "tile_tokens": 1024}
    assert plan_summary(p) == "qlora mb 1 x acc 8, ckpt full 1/2 layers, offload act+params, tiles 1024"
    assert plan_text(p) == plan_summary(p)


def test_planner_and_kernels_share_lean_lora_applies(tiny_llama, tmp_path):
    """DoRA and LoRA dropout take PEFT's forward: the planner predicts PEFT's activations for them,
    as for `optimization.lean_lora: false`, and the trainer does not install the lean projection."""
    from maximus.memory.spec_from_config import lean_lora_applies

    def peak(lora=None, **opt):
        cfg = Config.from_dict({"model": str(tiny_llama), "dataset": str(tmp_path / "d.jsonl"), "method": "lora",
                                "lora": {"r": 4, **(lora or {})},
                                "training": {"batch_size": 2, "micro_batch_size": 2, "seq_len": 256},
                                "optimization": {"gradient_checkpointing": "off", **opt}})
        return lean_lora_applies(cfg), plan_run(cfg, device="cpu").peak_bytes

    lean, peft = peak(), peak(lean_lora=False)
    assert lean[0] and not peft[0] and lean[1] < peft[1]
    assert peak({"dropout": 0.1}) == (False, peak({"dropout": 0.1}, lean_lora=False)[1])
    assert peak({"use_dora": True})[0] is False and peak(kernels="compile")[0] is False
