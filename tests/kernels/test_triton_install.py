"""install_triton_kernels on whole tiny PEFT QLoRA models (CPU interpreter): same logits and LoRA grads."""
import sys

import pytest
import torch

from maximus.kernels.triton.runtime import interpreter_env

pytest.importorskip("triton")
with interpreter_env():  # triton.jit builds CPU-interpreted kernels only if set when they are defined
    import maximus.kernels.triton.lora_4bit  # noqa: F401  (build every kernel now, interpreted)
    import maximus.kernels.triton.rms_norm  # noqa: F401
    import maximus.kernels.triton.rope  # noqa: F401
    import maximus.kernels.triton.swiglu  # noqa: F401
    from maximus.kernels.triton import (TritonKernelsUnavailable, install_triton_kernels, summarize,
                                        uninstall_triton_kernels)

from tiny import backward_node_names  # noqa: E402

OUR_BACKWARD_NODES = {"RMSNormFunctionBackward", "RopeFunctionBackward", "SwiGLUFunctionBackward",
                      "LoRALinear4bitFunctionBackward"}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _qlora(model_dir, dtype=torch.float32, dropout=0.0):
    """A tiny NF4 (double quantised) model, PEFT's kbit preparation, a random LoRA on every linear, train mode."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), quantization_config=quant, dtype=dtype,
                                                 device_map={"": "cpu"})
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", init_lora_weights=False,
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lora).train()


# Few tokens: the interpreter runs each kernel program in NumPy (seconds per step even at this size)
IDS = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(0))
PACKED_POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2], list(range(6))])  # row 0: two packed sequences


def _step(model, seed=0):
    """Logits, every LoRA grad, and the names of the autograd nodes of one loss.backward()."""
    model.zero_grad()
    torch.manual_seed(seed)  # same dropout masks in both runs
    out = model(input_ids=IDS, position_ids=PACKED_POSITIONS, labels=IDS)
    nodes = backward_node_names(out.loss)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), grads, nodes


def _assert_same_step(patched, eager, atol, rtol):
    torch.testing.assert_close(patched[0], eager[0], atol=atol, rtol=rtol)
    assert patched[1].keys() == eager[1].keys() and len(eager[1]) == 28  # A and B of 14 projections
    for name, grad in eager[1].items():
        torch.testing.assert_close(patched[1][name], grad, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def test_llama_qlora_logits_and_lora_grads_match_unpatched(tiny_llama):
    model = _qlora(tiny_llama)
    eager = _step(model)
    patched_modules = install_triton_kernels(model)
    assert summarize(patched_modules) == "rope x2, lora_4bit x14, swiglu x2, rms_norm x5"
    assert "rms_norm: base_model.model.model.norm" in patched_modules
    patched = _step(model)
    assert OUR_BACKWARD_NODES <= patched[2] and not OUR_BACKWARD_NODES & eager[2]
    _assert_same_step(patched, eager, atol=2e-5, rtol=1e-4)
    assert install_triton_kernels(model) == patched_modules  # idempotent
    assert uninstall_triton_kernels(model) == 23
    again = _step(model)
    assert not OUR_BACKWARD_NODES & again[2]
    _assert_same_step(again, eager, atol=0, rtol=0)  # the left-behind rope dispatcher is inert outside


def test_qwen2_with_qkv_bias_and_lora_dropout(tiny_model_dirs):
    model = _qlora(tiny_model_dirs["qwen2"], dropout=0.1)
    assert model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.bias is not None
    eager = _step(model, seed=5)
    install_triton_kernels(model)
    patched = _step(model, seed=5)
    assert OUR_BACKWARD_NODES <= patched[2]
    _assert_same_step(patched, eager, atol=2e-5, rtol=1e-4)


def test_patched_lora_layer_falls_back_to_peft_when_adapter_disabled(tiny_llama):
    model = _qlora(tiny_llama)
    install_triton_kernels(model)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 64)
    with torch.no_grad():
        with model.disable_adapter():
            disabled = layer(x)
        enabled = layer(x)
        peft = type(layer).forward(layer, x)
        base = layer.base_layer(x)
    assert torch.equal(disabled, base)  # PEFT's own path: exactly the 4-bit base layer
    assert (enabled - base).abs().max() > 1e-3  # the fused path (adapter on) does add the LoRA term
    torch.testing.assert_close(enabled, peft, atol=1e-6, rtol=1e-6)


def test_unknown_modules_are_skipped():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.SiLU())
    assert install_triton_kernels(model) == []
    assert "forward" not in model[1].__dict__


def test_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(TritonKernelsUnavailable) as err:
        install_triton_kernels(torch.nn.Linear(4, 4))
    assert str(err.value) == ("optimization.kernels: Triton kernels need a CUDA device, the model is on cpu (hint: use "
                              "optimization.kernels: compile or eager (the Triton kernels need CUDA and `pip install "
                              "triton`))")


def test_refuses_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # as if triton were not installed
    with pytest.raises(TritonKernelsUnavailable) as err:
        install_triton_kernels(torch.nn.Linear(4, 4))
    assert err.value.message == ("optimization.kernels: Triton is not importable (ModuleNotFoundError: import of triton "
                                 "halted; None in sys.modules)")


def test_qlora_under_bf16_autocast_uses_the_fused_projection(tiny_llama):
    """The trainer's setting: bf16 autocast around a QLoRA model. The fused projection takes over
    (PEFT's path is not silently kept), adapters get fp32 gradients, and the step stays near the
    float32 one. (The exact check of the autocast path is test_lora_matmuls_in_the_autocast_dtype:
    here the interpreter's fp32 -> bf16 rounding toward zero, unlike CUDA's to-nearest, compounds
    over the whole model, so only a coarse bound holds.)"""
    reference = _step(_qlora(tiny_llama))  # float32, no autocast
    model = _qlora(tiny_llama, dtype=torch.bfloat16)
    install_triton_kernels(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        patched = _step(model)
    assert "LoRALinear4bitFunctionBackward" in patched[2]
    assert {g.dtype for g in patched[1].values()} == {torch.float32}
    rel = (patched[0].float() - reference[0]).norm() / reference[0].norm()
    assert rel < 5e-2
    total = sum((patched[1][n] - g).norm() ** 2 for n, g in reference[1].items()) ** 0.5
    assert total / sum(g.norm() ** 2 for g in reference[1].values()) ** 0.5 < 0.25


def test_unpatch_removes_the_triton_forwards_and_the_rope_dispatcher(tiny_llama):
    """`maximus.unpatch` undoes what `patch` installs on CUDA (kernels: triton), the modeling
    module's `apply_rotary_pos_emb` included; here installed through the CPU interpreter."""
    import transformers.models.llama.modeling_llama as modeling
    from transformers import AutoModelForCausalLM

    import maximus

    original_rope = getattr(modeling.apply_rotary_pos_emb, "_maximus_original", modeling.apply_rotary_pos_emb)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    maximus.patch(model, seq_len=64, kernels="eager")
    assert install_triton_kernels(model)  # what patch(kernels="triton") installs on a CUDA model
    assert modeling.apply_rotary_pos_emb is not original_rope
    maximus.unpatch(model)
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == []
    assert modeling.apply_rotary_pos_emb is original_rope
