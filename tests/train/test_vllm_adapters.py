"""`grpo.generation: vllm` (the CPU-testable part): the adapter copies the engine samples with
count on across a resume, so a resumed run's first sync writes a new version instead of failing
on a surviving `vllm_adapter/<n>`, and each copy is the adapter as it was when saved."""
from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from maximus.train.vllm_generation import AdapterVersions


def _lora(tiny_llama):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def test_a_resumed_run_counts_on_from_the_surviving_versions(tmp_path, tiny_llama):
    model = _lora(tiny_llama)
    root = tmp_path / "run" / "vllm_adapter"
    first = AdapterVersions(root)
    assert first.version == 0 and [first.save(model).name for _ in range(3)] == ["1", "2", "3"]
    assert sorted(p.name for p in root.iterdir()) == ["2", "3"]  # the one before the last is kept for the engine
    resumed = AdapterVersions(root)  # the run stopped and was started again
    assert resumed.version == 3
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.5)
    target = resumed.save(model)
    assert (target.name, resumed.version) == ("4", 4)
    assert sorted(p.name for p in root.iterdir()) == ["3", "4"]
    saved = load_file(str(target / "adapter_model.safetensors"))
    b = [v for k, v in saved.items() if "lora_B" in k]
    assert b and all(torch.equal(v, torch.full_like(v, 0.5)) for v in b)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_llama)), str(target))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
