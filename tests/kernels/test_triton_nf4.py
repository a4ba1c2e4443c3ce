"""NF4 dequantisation and the QLoRA projection (Triton, CPU interpreter) vs bitsandbytes and PEFT."""
import pytest
import torch

from maximus.kernels.triton.runtime import interpreter_env

pytest.importorskip("triton")
with interpreter_env():  # triton.jit builds CPU-interpreted kernels only if set when they are defined
    import bitsandbytes.functional as bnbf

    from maximus.kernels.triton.lora_4bit import lora_linear_4bit, lora_linear_4bit_reference
    from maximus.kernels.triton.nf4 import dequantize_nf4, dequantize_nf4_reference


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def qlora_llama(tiny_llama):
    """The tiny Llama loaded in NF4 (double quantised) with a random (non-zero) LoRA on every linear."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), quantization_config=quant, dtype=torch.float32,
                                                 device_map={"": "cpu"})
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
    # train mode: in eval mode without grads, bitsandbytes repacks CPU weights for its AVX512 kernel (another layout)
    return get_peft_model(model, lora).train()


def _quantize(shape, dtype, nested, seed=0):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return bnbf.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")


# bf16: the interpreter rounds fp32 -> bf16 toward zero (CUDA rounds to nearest): within one bf16 step
_DEQUANT_RTOL = {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 2 ** -7}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("nested", [False, True])
def test_dequantize_matches_bitsandbytes(dtype, nested):
    packed, state = _quantize((24, 192), dtype, nested)  # 72 blocks of 64; 1 block of the nested 256
    ours = dequantize_nf4(packed, state)
    expected = bnbf.dequantize_4bit(packed, state)
    assert ours.dtype == expected.dtype == dtype and ours.shape == expected.shape == (24, 192)
    torch.testing.assert_close(ours, expected, atol=0, rtol=_DEQUANT_RTOL[dtype])
    torch.testing.assert_close(dequantize_nf4_reference(packed, state), expected, atol=0, rtol=0)


def test_dequantize_real_linear4bit_weights(qlora_llama):
    layers = [m for m in qlora_llama.modules() if type(m).__name__ == "Linear4bit" and hasattr(m, "quant_state")]
    assert len(layers) == 14  # 7 projections x 2 layers
    for layer in layers[:3] + layers[-1:]:
        weight = layer.weight
        assert weight.quant_state.nested  # QLoRA's double quantisation
        expected = bnbf.dequantize_4bit(weight.data, weight.quant_state)
        torch.testing.assert_close(dequantize_nf4(weight.data, weight.quant_state), expected, atol=0, rtol=0)


def test_dequantize_refuses_fp4():
    w = torch.randn(8, 64)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="fp4")
    with pytest.raises(ValueError, match="^dequantize_nf4: only bitsandbytes NF4 weights in the standard packing are "
                                         "supported$"):
        dequantize_nf4(packed, state)


def _lora_run(fn, x, packed, state, a, b, scaling, dy, **kw):
    x = x.detach().clone().requires_grad_()
    a = a.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_()
    y = fn(x, packed, state, a, b, scaling, **kw)
    y.backward(dy)
    return y.detach(), x.grad, a.grad, b.grad


@pytest.mark.parametrize("nested", [False, True])
def test_lora_linear_4bit_matches_reference(nested):
    torch.manual_seed(0)
    packed, state = _quantize((48, 128), torch.float32, nested)
    x, a, b = torch.randn(2, 5, 128), torch.randn(4, 128) * 0.1, torch.randn(48, 4) * 0.1
    dy = torch.randn(2, 5, 48)
    bias = torch.randn(48)
    ours = _lora_run(lora_linear_4bit, x, packed, state, a, b, 2.0, dy, bias=bias)
    ref = _lora_run(lora_linear_4bit_reference, x, packed, state, a, b, 2.0, dy, bias=bias)
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_lora_matmuls_in_the_autocast_dtype():
    """`lora_dtype=bf16` (what the patched layer passes under bf16 autocast): the LoRA matmuls run
    in bf16 like PEFT's under autocast, the base stays in its compute dtype, A and B get fp32 grads."""
    from maximus.kernels.triton.nf4 import dequantize_nf4_reference

    torch.manual_seed(0)
    packed, state = _quantize((48, 128), torch.float32, True)
    x, a, b = torch.randn(2, 5, 128), torch.randn(4, 128) * 0.1, torch.randn(48, 4) * 0.1
    dy = torch.randn(2, 5, 48)

    def oracle(x, packed, state, a, b, scaling):
        w = dequantize_nf4_reference(packed, state, torch.float32)
        lora = (x.to(torch.bfloat16) @ a.to(torch.bfloat16).t()) @ b.to(torch.bfloat16).t()
        return x @ w.t() + (lora * scaling).float()

    ours = _lora_run(lora_linear_4bit, x, packed, state, a, b, 2.0, dy, lora_dtype=torch.bfloat16)
    ref = _lora_run(oracle, x, packed, state, a, b, 2.0, dy)
    assert ours[2].dtype == ours[3].dtype == torch.float32
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)  # bf16 products in both
    full = _lora_run(lora_linear_4bit, x, packed, state, a, b, 2.0, dy)  # fp32 LoRA: a different number
    assert not torch.allclose(full[2], ours[2], atol=1e-6, rtol=0)


def test_lora_dropout_input_gets_its_own_gradient():
    torch.manual_seed(1)
    packed, state = _quantize((32, 64), torch.float32, True)
    a, b = torch.randn(4, 64) * 0.1, torch.randn(32, 4) * 0.1
    x = torch.randn(6, 64, requires_grad=True)
    mask = (torch.rand(6, 64) > 0.3).float() / 0.7  # a fixed dropout mask: x_l = x * mask

    def grads(fn):
        x.grad = None
        fn(x, packed, state, a, b, 0.5, lora_input=x * mask).sum().backward()
        return x.grad.clone()

    torch.testing.assert_close(grads(lora_linear_4bit), grads(lora_linear_4bit_reference), atol=1e-5, rtol=1e-5)


def test_dequantised_weight_is_not_saved_for_backward():
    packed, state = _quantize((48, 128), torch.float32, True)
    x = torch.randn(3, 128, requires_grad=True)
    a, b = torch.randn(4, 128, requires_grad=True), torch.randn(48, 4, requires_grad=True)
    y = lora_linear_4bit(x, packed, state, a, b, 1.0)
    saved = y.grad_fn.saved_tensors
    assert not any(t.shape == (48, 128) for t in saved)  # only x, x@A.T, A, B and the packed bytes
    assert sum(t.numel() * t.element_size() for t in saved if t.dtype == torch.uint8) == 48 * 128 // 2


def test_matches_peft_linear4bit_layer(qlora_llama):
    layer = qlora_llama.base_model.model.model.layers[0].mlp.down_proj  # in 128 -> out 64
    base = layer.base_layer
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    torch.manual_seed(2)
    x = torch.randn(2, 3, 128)
    dy = torch.randn(2, 3, 64)

    def run(fn):
        x_ = x.clone().requires_grad_()
        for p in (a, b):
            p.grad = None
        fn(x_).backward(dy)
        return x_.grad, a.grad.clone(), b.grad.clone()

    y_ref = type(layer).forward(layer, x)  # PEFT + bitsandbytes, unpatched
    y = lora_linear_4bit(x, base.weight, base.weight.quant_state, a, b, layer.scaling["default"],
                         compute_dtype=base.compute_dtype)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    ours = run(lambda x_: lora_linear_4bit(x_, base.weight, base.weight.quant_state, a, b, layer.scaling["default"],
                                           compute_dtype=base.compute_dtype))
    ref = run(lambda x_: type(layer).forward(layer, x_))
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_input_is_saved_as_it_came_not_as_a_float32_copy():
    """Lean (issue 17): with bf16 activations and fp32 adapters the node keeps the input itself
    (so projections fed the same tensor share it), not a float32 copy of it."""
    packed, state = _quantize((48, 128), torch.bfloat16, True)
    x = torch.randn(3, 128, dtype=torch.bfloat16, requires_grad=True)
    a, b = torch.randn(4, 128, requires_grad=True), torch.randn(48, 4, requires_grad=True)
    q = lora_linear_4bit(x, packed, state, a, b, 1.0, compute_dtype=torch.bfloat16)
    k = lora_linear_4bit(x, packed, state, a, b, 1.0, compute_dtype=torch.bfloat16)
    saved_q, saved_k = q.grad_fn.saved_tensors, k.grad_fn.saved_tensors
    assert saved_q[0].dtype == torch.bfloat16 and saved_q[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert saved_k[0].untyped_storage().data_ptr() == saved_q[0].untyped_storage().data_ptr()
    assert not any(t.dtype == torch.float32 and t.shape == (3, 128) for t in saved_q)
