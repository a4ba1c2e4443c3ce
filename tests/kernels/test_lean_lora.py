"""Lean LoRA projections (`maximus.kernels.lean_lora`): PEFT's forward and every gradient, with each
projection keeping the layer input once (no float32 copies), q/k/v and gate/up sharing one."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from maximus.kernels.lean_lora import install_lean_lora, uninstall_lean_lora

from tiny import backward_node_names, one_thread  # noqa: F401  (one_thread: a fixture, used through pytestmark)

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(0))


def _model(model_dir, method, dtype, use_dora=False, dropout=0.0, base_dtype=None):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = dict(dtype=base_dtype or dtype)
    if method == "qlora":
        kwargs.update(device_map={"": "cpu"}, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=base_dtype or dtype))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, use_dora=use_dora,
                      lora_dropout=dropout)
    model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype)
    return model.train()


def _step(model, autocast=None):
    model.zero_grad()
    torch.manual_seed(1)
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        out = model(input_ids=IDS, labels=IDS)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _nodes(model):
    with torch.enable_grad():
        return backward_node_names(model(input_ids=IDS, labels=IDS).loss)


def _assert_same(got, expected, tol, n_grads=28):
    torch.testing.assert_close(got[0], expected[0], rtol=tol, atol=tol)
    assert got[1].keys() == expected[1].keys() and len(expected[1]) == n_grads
    for name, grad in expected[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_lora_float64_matches_peft(tiny_model_dirs, arch):
    expected = _step(_model(tiny_model_dirs[arch], "lora", torch.float64))
    model = _model(tiny_model_dirs[arch], "lora", torch.float64)
    assert len(install_lean_lora(model)) == 14
    assert "_LeanLoRAFunctionBackward" in _nodes(model)
    _assert_same(_step(model), expected, 1e-12)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_qlora_float32_matches_peft_bitsandbytes(tiny_model_dirs, arch):
    expected = _step(_model(tiny_model_dirs[arch], "qlora", torch.float32))
    model = _model(tiny_model_dirs[arch], "qlora", torch.float32)
    assert len(install_lean_lora(model)) == 14
    _assert_same(_step(model), expected, 1e-5)


def test_without_gradients_the_lean_forward_gives_peft_and_the_training_forward_values(tiny_llama):
    peft = _model(tiny_llama, "lora", torch.float32)
    model = _model(tiny_llama, "lora", torch.float32)
    install_lean_lora(model)
    with torch.no_grad():
        expected, got = peft(input_ids=IDS).logits, model(input_ids=IDS).logits
    assert torch.equal(got, expected)
    assert torch.equal(got, model(input_ids=IDS).logits.detach())  # what the loss pass sees, bit for bit


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_bf16_base_fp32_adapters_as_close_to_float64_as_peft(tiny_llama, autocast):
    """The training regime (bf16 base, fp32 adapters, with or without autocast): bfloat16 sums (the
    input's gradient from q, k, v, ...) run in another order than in PEFT, so the oracle is the
    same model upcast to float64: lean's error is within twice PEFT's own, tensor by tensor."""
    oracle = _step(_model(tiny_llama, "lora", torch.float32, base_dtype=torch.bfloat16).double())
    peft = _step(_model(tiny_llama, "lora", torch.float32, base_dtype=torch.bfloat16), autocast)
    model = _model(tiny_llama, "lora", torch.float32, base_dtype=torch.bfloat16)
    install_lean_lora(model)
    lean = _step(model, autocast)
    pairs = [(lean[0], peft[0], oracle[0])] + [(lean[1][n], peft[1][n], oracle[1][n]) for n in oracle[1]]
    for ours, theirs, exact in pairs:
        assert _rel(ours, exact) <= 2 * _rel(theirs, exact) + 1e-6


def test_bf16_qlora_matches_peft_to_bfloat16_rounding(tiny_llama):
    expected = _step(_model(tiny_llama, "qlora", torch.float32, base_dtype=torch.bfloat16), torch.bfloat16)
    model = _model(tiny_llama, "qlora", torch.float32, base_dtype=torch.bfloat16)
    install_lean_lora(model)
    got = _step(model, torch.bfloat16)
    for a, b in [(got[0], expected[0])] + [(got[1][n], g) for n, g in expected[1].items()]:
        # four bfloat16 ulps, relative per tensor (the largest in layer 0, the end of a bf16 backward;
        # logits agree exactly); a wrong term is O(1)
        assert _rel(a, b) < 4 * 2**-8


def test_dora_and_dropout_take_peft_forward(tiny_llama):
    for kwargs in (dict(use_dora=True), dict(dropout=0.1)):
        expected = _step(_model(tiny_llama, "lora", torch.float64, **kwargs))
        model = _model(tiny_llama, "lora", torch.float64, **kwargs)
        install_lean_lora(model)
        assert "_LeanLoRAFunctionBackward" not in _nodes(model)
        _assert_same(_step(model), expected, 0, n_grads=42 if "use_dora" in kwargs else 28)  # DoRA: + magnitudes


def test_state_dict_and_saved_adapter_are_peft(tiny_llama, tmp_path):
    model = _model(tiny_llama, "lora", torch.float32)
    keys = set(model.state_dict())
    install_lean_lora(model)
    assert set(model.state_dict()) == keys
    logits = _step(model)[0]
    model.save_pretrained(tmp_path / "adapter")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, logits, rtol=1e-6, atol=1e-6)
    assert uninstall_lean_lora(model) == 14 and "_LeanLoRAFunctionBackward" not in _nodes(model)


def _saved(model) -> dict:
    """(dtype, shape) -> bytes of the distinct non-parameter storages autograd saves in one forward."""
    seen = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = (t.dtype, tuple(t.shape), s.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=IDS, labels=IDS)
    out: dict = {}
    for dtype, shape, nbytes in seen.values():
        out[(dtype, shape)] = out.get((dtype, shape), 0) + nbytes
    return out


def test_no_float32_copies_of_the_input_are_kept(tiny_llama):
    """bf16 base, fp32 adapters, no autocast: PEFT keeps a float32 copy of the input per projection
    (q, k, v, o, gate, up of hidden size, down of intermediate size, per layer); lean keeps none, and
    its bf16 inputs are one per distinct input (q/k/v share one, gate/up share one)."""
    peft = _saved(_model(tiny_llama, "lora", torch.float32, base_dtype=torch.bfloat16))
    model = _model(tiny_llama, "lora", torch.float32, base_dtype=torch.bfloat16)
    install_lean_lora(model)
    lean = _saved(model)
    cfg = model.config
    layers, tokens, h, i = cfg.num_hidden_layers, IDS.numel(), cfg.hidden_size, cfg.intermediate_size
    assert peft[(torch.float32, (tokens, h))] == layers * 6 * tokens * h * 4
    assert peft[(torch.float32, (tokens, i))] == layers * tokens * i * 4
    assert (torch.float32, (tokens, h)) not in lean and (torch.float32, (tokens, i)) not in lean
    assert sum(lean.values()) < sum(peft.values()) - layers * tokens * (6 * h + i) * 2


def test_trainer_routes_lora_through_lean_unless_turned_off(tiny_llama, pc_data, tmp_path):
    from tiny import kernel_switch_runs

    counts, losses = kernel_switch_runs(tiny_llama, pc_data, tmp_path, "lean_lora")
    assert counts == {True: 14, False: 0}
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=1e-5, atol=1e-6)


def test_gpt2_conv1d_takes_peft_forward():
    """GPT-2's Conv1D keeps its weight transposed (fan_in_fan_out): not the lean case."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                             init_lora_weights=False)).train()
    assert len(install_lean_lora(model)) == 1  # routed, but the plain-case check declines it
    assert "_LeanLoRAFunctionBackward" not in _nodes(model)
