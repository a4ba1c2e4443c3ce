"""Fused SwiGLU (Triton, CPU interpreter) vs LlamaMLP's activation product and the eager reference."""
import pytest
import torch

from maximus.kernels.triton.runtime import interpreter_env

pytest.importorskip("triton")
with interpreter_env():  # triton.jit builds CPU-interpreted kernels only if set when they are defined
    from maximus.kernels.triton.swiglu import swiglu, swiglu_reference


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _run(fn, gate, up, dy):
    gate = gate.detach().clone().requires_grad_()
    up = up.detach().clone().requires_grad_()
    y = fn(gate, up)
    y.backward(dy)
    return y.detach(), gate.grad, up.grad


def _llama_act_product(gate, up):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=2,
                                 hidden_act="silu"))
    return mlp.act_fn(gate) * up  # the product LlamaMLP.forward feeds to down_proj


@pytest.mark.parametrize("shape", [(3, 5, 40), (2, 1100)])  # 2200 elements: three programs, a ragged tail
def test_matches_llama_mlp_product_fp32(shape):
    torch.manual_seed(0)
    gate, up, dy = torch.randn(shape) * 3, torch.randn(shape), torch.randn(shape)
    ours = _run(swiglu, gate, up, dy)
    ref = _run(_llama_act_product, gate, up, dy)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_hand_backward_matches_autograd_of_reference_in_float64_math():
    torch.manual_seed(1)
    gate, up, dy = torch.randn(64) * 4, torch.randn(64), torch.randn(64)
    ours = _run(swiglu, gate, up, dy)
    ref = _run(swiglu_reference, gate.double(), up.double(), dy.double())
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, atol=2e-6, rtol=2e-6)


def test_bf16_and_non_contiguous_inputs():
    torch.manual_seed(2)
    both = (torch.randn(4, 6, 64) * 3).bfloat16()
    gate, up = both[..., :32], both[..., 32:]  # strided views, as a fused gate_up projection would give
    dy = torch.randn(4, 6, 32).bfloat16()
    ours = _run(swiglu, gate, up, dy)
    ref = _run(swiglu_reference, gate, up, dy)
    for a, b in zip(ours, ref):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=2 ** -5, rtol=2 ** -6)
