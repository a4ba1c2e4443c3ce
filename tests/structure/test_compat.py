"""The private hooks of maximus.compat resolve with the installed libraries, a hook that stops
resolving is named, and pyproject.toml bounds each hooked library to what was tested."""
from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

from maximus import compat

ROOT = Path(__file__).resolve().parents[2]


def test_every_private_hook_resolves():
    assert compat.broken_hooks() == []


def test_a_hook_that_no_longer_resolves_is_named(monkeypatch):
    import transformers.models.mistral.modeling_mistral as mistral

    monkeypatch.delattr(mistral, "apply_rotary_pos_emb")
    monkeypatch.setattr(compat, "TRL_FUSED_CLOSURE", compat.TRL_FUSED_CLOSURE | {"logit_softcap"})
    assert compat.broken_hooks() == [
        "trl.trainer.utils.add_fused_lm_head: _fused_forward and its closure names (used by maximus.hf_patch): "
        "_fused_forward's closure lacks ['logit_softcap']",
        "apply_rotary_pos_emb in Transformers' Llama / Mistral / Qwen2 modeling modules (used by "
        "maximus.kernels.triton.install): transformers.models.mistral.modeling_mistral.apply_rotary_pos_emb is gone",
    ]


def test_a_changed_private_part_of_torch_or_torchao_is_named(monkeypatch):
    """A reordered positional argument of torchao's Adam step would corrupt every step silently, and
    without torch._grouped_mm the experts quietly take the slow loop: both are named."""
    import torch
    import torchao.optim.adam as adam

    def reordered(p, grad, step, exp_avg, exp_avg_sq, max_exp_avg_sq, lr, beta2, beta1, weight_decay, eps, IS_ADAMW,
                  BF16_STOCHASTIC_ROUND):
        raise AssertionError("never called")

    monkeypatch.setattr(adam, "single_param_adam", reordered)
    monkeypatch.delattr(torch, "_grouped_mm")
    assert compat.broken_hooks() == [
        "torchao's private optimizer parts (single_param_adam called positionally, _AdamW, AdamW4bit / AdamW8bit "
        "._new_buffer, OptimState4bit / OptimState8bit) (used by maximus.train.optimizers (adamw_4bit, "
        "adamw_8bit_torchao, bf16 weights)): torchao.optim.adam.single_param_adam takes ('p', 'grad', 'step', "
        "'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'lr', 'beta2', 'beta1', 'weight_decay', 'eps', 'IS_ADAMW', "
        "'BF16_STOCHASTIC_ROUND'), not ('p', 'grad', 'step', 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'lr', "
        "'beta1', 'beta2', 'weight_decay', 'eps', 'IS_ADAMW', 'BF16_STOCHASTIC_ROUND')",
        "torch._grouped_mm (used by maximus.kernels.grouped_experts (without it: the per-expert loop, slower)): "
        "torch._grouped_mm is gone (the grouped experts take the per-expert loop)",
    ]


def test_a_changed_expert_gate_or_adapter_layout_is_named(monkeypatch):
    from peft.tuners.lora.layer import ParamWrapper
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    monkeypatch.setattr(GptOssExperts, "_apply_gate", lambda self, gate_up: gate_up[..., ::2] * gate_up[..., 1::2])
    monkeypatch.setattr(ParamWrapper, "get_delta_weight", lambda self, name: self.base_layer.gate_up_proj * 0)
    assert [line.rsplit("): ", 1)[1] for line in compat.broken_hooks()] == [
        "GptOssExperts._apply_gate no longer computes the clamped SwiGLU of interleaved columns",
        "ParamWrapper's lora_A / lora_B are no longer laid out expert-major / rank-major",
    ]


def test_pyproject_bounds_the_hooked_libraries_to_the_tested_versions():
    text = (ROOT / "pyproject.toml").read_text()
    requirements = {Requirement(r).name: Requirement(r) for r in re.findall(r'"([a-z_-]+[<>=][^"]*)"', text)}
    for name in ("torch", "transformers", "peft", "trl", "bitsandbytes", "torchao"):
        spec = requirements[name].specifier
        assert any(s.operator == "<" for s in spec), f"{name} has no upper bound"
        assert compat.TESTED_VERSIONS[name] in spec and md.version(name) in spec, name


def test_the_hooked_code_reads_its_names_from_compat():
    """hf_patch no longer spells TRL's private names itself."""
    source = (ROOT / "src/maximus/hf_patch.py").read_text()
    assert '"_fused_forward"' not in source and '"cast_lm_head_to_fp32"}' not in source
    assert "torch._C._current_graph_task_id" not in (ROOT / "src/maximus/kernels/tiled_mlp.py").read_text()
    assert sys.modules["maximus.compat"] is compat
