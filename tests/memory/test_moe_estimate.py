"""The estimator on mixture-of-experts models beyond the family matrix's default run: `lora.experts:
false` (no expert LoRA state) and Qwen3-MoE's dense layers (`mlp_only_layers`,
`decoder_sparse_step`), checked against the real model's parameters and the meter's peak of a
2-step LoRA run (within 10 %)."""
from __future__ import annotations

import json

import pytest
import torch

from maximus.memory.estimate import estimate_peak
from maximus.memory.shape import model_shape

from tiny import build_family_model_dir, one_thread, tiny_config, write_prompt_completion  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-estimate")
    return {"mixtral": build_family_model_dir(root / "mixtral", "mixtral"),
            # layer 0 dense, layers 1-2 with experts, layer 3 dense
            "qwen3_moe": build_family_model_dir(root / "qwen3_moe", "qwen3_moe", layers=4, mlp_only_layers=[0, 3]),
            "data": write_prompt_completion(root / "data.jsonl", n=24), "root": root}


def test_dense_layers_of_qwen3_moe_are_not_counted_as_experts(dirs):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(dirs["qwen3_moe"])
    shape = model_shape(config)
    assert shape.moe_layers == 2 and shape.num_experts == 4
    model = AutoModelForCausalLM.from_config(config)
    linear = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() >= 2)
    assert shape.num_layers * shape.layer_linear_params == linear
    every_other = model_shape({**config.to_dict(), "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert every_other.moe_layers == 2  # layers 1 and 3 (1-based 2 and 4)


def test_lora_experts_false_has_no_expert_lora_state(dirs):
    from maximus.config import Config
    from maximus.memory.spec_from_config import run_spec
    from maximus.models import load_model

    cfg = Config.from_dict({"model": str(dirs["mixtral"]), "dataset": "unused.jsonl", "method": "lora", "device": "cpu",
                            "lora": {"r": 4, "alpha": 8, "experts": False}, "training": {"dtype": "fp32"}})
    model, _ = load_model(cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    estimate = estimate_peak(dirs["mixtral"], method="lora", dtype="fp32", lora_r=4, device="cpu",
                             lora_experts=run_spec(cfg, device="cpu").lora.experts)
    assert run_spec(cfg, device="cpu").lora.experts is False
    assert estimate.breakdown["adapters"] == 4 * trainable  # float32 adapters on attention only
    with_experts = estimate_peak(dirs["mixtral"], method="lora", dtype="fp32", lora_r=4, device="cpu")
    assert with_experts.breakdown["adapters"] > estimate.breakdown["adapters"]


def test_lora_experts_true_with_attention_targets_counts_every_expert_adapter(dirs):
    """`lora.experts: true` adapts the experts whatever `target_modules` names: the planner counts
    exactly the adapters the model trains (none at the dense shape of an MLP it does not target)."""
    from maximus.config import Config
    from maximus.memory.spec_from_config import run_spec
    from maximus.models import load_model

    cfg = Config.from_dict({"model": str(dirs["qwen3_moe"]), "dataset": "unused.jsonl", "method": "lora", "device": "cpu",
                            "lora": {"r": 4, "alpha": 8, "experts": True, "target_modules": ATTENTION},
                            "training": {"dtype": "fp32"}})
    model, _ = load_model(cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert any(".experts." in n for n, p in model.named_parameters() if p.requires_grad)
    estimate = estimate_peak(dirs["qwen3_moe"], method="lora", dtype="fp32", lora_r=4, device="cpu", lora_targets=ATTENTION,
                             lora_experts=run_spec(cfg, device="cpu").lora.experts)
    assert estimate.breakdown["adapters"] == 4 * trainable


def test_peft_cannot_adapt_the_dense_mlp_layers_of_qwen3_moe_and_says_so(dirs):
    from maximus.config import Config
    from maximus.errors import ModelError
    from maximus.models import load_model

    cfg = Config.from_dict({"model": str(dirs["qwen3_moe"]), "dataset": "unused.jsonl", "method": "lora",
                            "device": "cpu", "lora": {"r": 4, "alpha": 8, "experts": False}, "training": {"dtype": "fp32"}})
    with pytest.raises(ModelError) as error:
        load_model(cfg)
    import peft
    assert str(error.value) == (
        f"lora.target_modules: PEFT {peft.__version__} maps down_proj, gate_proj, up_proj of Qwen3MoeForCausalLM to its "
        "fused experts, so 6 linears outside the experts would train no adapter (model.layers.0.mlp.down_proj, ...) "
        "(hint: leave down_proj, gate_proj, up_proj out of lora.target_modules (e.g. [q_proj, k_proj, v_proj, o_proj], "
        "with lora.experts: true to train the experts))")



@pytest.mark.parametrize("model_type, experts", [("mixtral", False), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_the_plan_predicts_the_measured_peak_within_10_percent(dirs, model_type, experts):
    from maximus.config import Config
    from maximus.train.trainer import Trainer

    out = dirs["root"] / f"run-{model_type}-{experts}"
    # Qwen3-MoE's dense MLP layers cannot take an adapter under PEFT 0.21 (the test above): attention + experts
    lora = {"r": 4, "alpha": 8, "experts": experts, **({"target_modules": ATTENTION} if model_type == "qwen3_moe" else {})}
    cfg = tiny_config(dirs[model_type], dirs["data"], out, lora=lora,
                      training={"max_steps": 2, "batch_size": 4, "micro_batch_size": 4}, eval={"split": 0.0, "before": False})
    Trainer(Config.from_dict(cfg)).train()
    summary = json.loads((out / "run.json").read_text())
    assert summary["kernels"]["grouped_experts"] == 2  # the experts ran the grouped forward
    error = summary["plan"]["peak_bytes"] / summary["memory"]["peak_bytes"] - 1
    assert -0.10 <= error <= 0.10, f"{model_type} experts={experts}: predicted {error:+.1%} of the measured peak"
