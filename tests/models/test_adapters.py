"""Adapters: `init_adapter` honours the config's lora.* settings (or refuses them by name), and
DoRA / rsLoRA adapters written by a run load in PEFT itself with identical logits (oracle: PEFT)."""
from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from tiny import one_thread, tiny_config  # noqa: F401 (fixture)
from transformers import AutoModelForCausalLM

import maximus
from maximus.attention import KroneckerSketch
from maximus.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

SKETCH = {"detail_tokens": 16, "sketch_slots": 4, "block": 8}


def _ids(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (2, n), generator=g)


def _base(model_dir):
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def saved_adapter(tiny_llama, tmp_path_factory):
    """A PEFT LoRA adapter (r=4, q_proj/v_proj, dropout 0) with non-zero B, saved as PEFT writes it."""
    torch.manual_seed(1)
    model = get_peft_model(_base(tiny_llama), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                          lora_dropout=0.0, init_lora_weights=False))
    path = tmp_path_factory.mktemp("adapter") / "adapter"
    model.save_pretrained(str(path))
    return path


def _cfg(tiny_llama, pc_data, tmp_path, adapter, **sections):
    d = tiny_config(tiny_llama, pc_data, tmp_path / "run", **{"init_adapter": str(adapter), **sections})
    d["lora"] = sections.get("lora", {})  # only what the test writes
    return maximus.Config.from_dict(d)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_init_adapter_applies_dropout_and_modules_to_save(tiny_llama, pc_data, tmp_path, saved_adapter):
    cfg = _cfg(tiny_llama, pc_data, tmp_path, saved_adapter, lora={"dropout": 0.1, "modules_to_save": ["lm_head"]})
    model, _ = maximus.load_model(cfg, device=torch.device("cpu"))
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.lora_dropout["default"].p == 0.1
    assert q.r["default"] == 4  # the adapter's own rank (lora.r not written)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "base_model.model.lm_head.modules_to_save.default.weight" in trainable
    # The saved adapter weights were loaded, not re-initialised: same logits as PEFT's own loader.
    reference = PeftModel.from_pretrained(_base(tiny_llama), str(saved_adapter)).eval()
    model.eval()
    torch.testing.assert_close(_logits(model, _ids()), _logits(reference, _ids()), rtol=0, atol=0)


def test_init_adapter_trains_the_kronecker_sketches(tiny_llama, pc_data, tmp_path, saved_adapter):
    cfg = _cfg(tiny_llama, pc_data, tmp_path, saved_adapter, optimization={"kronecker_sketching": SKETCH})
    model, _ = maximus.load_model(cfg, device=torch.device("cpu"))
    sketches = [m for n, m in model.named_modules() if isinstance(m, KroneckerSketch) and ".modules_to_save." in n]
    assert len(sketches) == 2
    assert all(p.requires_grad for s in sketches for p in s.parameters())
    assert set(model.peft_config["default"].modules_to_save) == {
        "model.layers.0.self_attn.kronecker", "model.layers.1.self_attn.kronecker"}
    # ... and saved with the adapter, so the next run (or export) gets the trained sketches.
    model.save_pretrained(str(tmp_path / "again"))
    saved = load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    assert sum("kronecker" in k for k in saved) == 2 * 5 and sum("lora_A" in k for k in saved) == 4


def test_init_adapter_refuses_a_different_rank_by_name(tiny_llama, pc_data, tmp_path, saved_adapter):
    cfg = _cfg(tiny_llama, pc_data, tmp_path, saved_adapter, lora={"r": 8})
    with pytest.raises(ConfigError) as err:
        maximus.load_model(cfg, device=torch.device("cpu"))
    assert str(err.value) == (f"lora.r: 8 differs from the init_adapter {saved_adapter} (r: 4) (hint: an adapter "
                              "keeps the shape it was trained with: drop lora.r, or train a new adapter without "
                              "init_adapter)")


def test_init_adapter_refuses_other_target_modules_and_accepts_the_same(tiny_llama, pc_data, tmp_path, saved_adapter):
    cfg = _cfg(tiny_llama, pc_data, tmp_path, saved_adapter, lora={"target_modules": "all-linear"})
    with pytest.raises(ConfigError) as err:
        maximus.load_model(cfg, device=torch.device("cpu"))
    assert str(err.value).startswith(f"lora.target_modules: all-linear differs from the init_adapter {saved_adapter} "
                                     "(target_modules: ['q_proj', 'v_proj'])")
    same = _cfg(tiny_llama, pc_data, tmp_path, saved_adapter, lora={"target_modules": ["v_proj", "q_proj"], "r": 4})
    maximus.load_model(same, device=torch.device("cpu"))


def test_full_fine_tune_starts_from_the_merged_init_adapter(tiny_llama, pc_data, tmp_path, saved_adapter):
    cfg = _cfg(tiny_llama, pc_data, tmp_path, saved_adapter, method="full")
    model, _ = maximus.load_model(cfg, device=torch.device("cpu"), for_training=False)
    assert not hasattr(model, "peft_config")
    assert all(p.requires_grad for p in model.parameters())
    reference = PeftModel.from_pretrained(_base(tiny_llama), str(saved_adapter)).eval()
    torch.testing.assert_close(_logits(model, _ids()), _logits(reference, _ids()), rtol=1e-5, atol=1e-5)
    plain, _ = maximus.load_model(_cfg(tiny_llama, pc_data, tmp_path, saved_adapter, method="full",
                                       init_adapter=None), device=torch.device("cpu"), for_training=False)
    assert (_logits(plain, _ids()) - _logits(model, _ids())).abs().max() > 1e-3


@pytest.mark.parametrize("variant", ["use_dora", "use_rslora"])
def test_dora_and_rslora_adapters_load_in_peft_with_identical_logits(tiny_llama, pc_data, tmp_path, variant):
    lora = {"r": 4, "alpha": 8, variant: True, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    d = tiny_config(tiny_llama, pc_data, tmp_path / "run", lora=lora, eval={"enabled": False},
                    training={"max_steps": 2})
    trainer = maximus.Trainer(maximus.Config.from_dict(d))
    trainer.train()
    adapter = tmp_path / "run" / "adapter"
    ours = trainer.model.eval()
    peft = PeftModel.from_pretrained(_base(tiny_llama), str(adapter)).eval()
    v = peft.base_model.model.model.layers[0].self_attn.v_proj
    if variant == "use_dora":
        assert "default" in v.lora_magnitude_vector  # a DoRA layer, not plain LoRA
    else:
        assert v.scaling["default"] == pytest.approx(8 / math.sqrt(4))  # alpha / sqrt(r), not alpha / r
    trained = v.lora_B["default"].weight
    assert trained.abs().max() > 0  # two steps moved B away from its zero init
    ids = _ids()
    torch.testing.assert_close(_logits(ours, ids), _logits(peft, ids), rtol=0, atol=0)
    # maximus.load_model with init_adapter gives the same model.
    again, _ = maximus.load_model(maximus.Config.from_dict({**d, "init_adapter": str(adapter)}),
                                  device=torch.device("cpu"), for_training=False)
    torch.testing.assert_close(_logits(again, ids), _logits(peft, ids), rtol=0, atol=0)
