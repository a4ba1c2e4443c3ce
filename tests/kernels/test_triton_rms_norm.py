"""Fused RMSNorm (Triton, run by the CPU interpreter) vs Transformers' RMSNorm modules and the eager reference."""
import pytest
import torch

from maximus.kernels.triton.runtime import interpreter_env

pytest.importorskip("triton")
with interpreter_env():  # triton.jit builds CPU-interpreted kernels only if set when they are defined
    from maximus.kernels.triton.rms_norm import rms_norm, rms_norm_reference


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _grads(fn, x, w, dy):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("rows", [(2, 5), (37,)])  # 37 rows: several rows per backward program
def test_matches_llama_rmsnorm_fp32(rows):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    module = LlamaRMSNorm(48, eps=1e-5)  # 48: not a power of two, so the column mask matters
    x = torch.randn(*rows, 48)
    w = torch.randn(48) * 0.2 + 1
    dy = torch.randn(*rows, 48)

    y_ref, dx_ref, dw_ref = _grads(lambda a, b: torch.func.functional_call(module, {"weight": b}, (a,)), x, w, dy)
    y, dx, dw = _grads(lambda a, b: rms_norm(a, b, 1e-5), x, w, dy)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, dx_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, dw_ref, atol=1e-5, rtol=1e-5)


def test_bf16_input_fp32_weight_is_qlora_layout():
    # prepare_model_for_kbit_training keeps norms in fp32 while activations are bf16: output is fp32
    torch.manual_seed(1)
    x = torch.randn(3, 4, 64).bfloat16()
    w = torch.randn(64) * 0.2 + 1
    dy = torch.randn(3, 4, 64)
    y_ref, dx_ref, dw_ref = _grads(rms_norm_reference, x, w, dy)
    y, dx, dw = _grads(rms_norm, x, w, dy)
    assert y.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    # The normalised row is rounded to bf16 (as Transformers does): at most one bf16 step apart
    torch.testing.assert_close(y, y_ref, atol=1e-3, rtol=2 ** -7)
    torch.testing.assert_close(dx.float(), dx_ref.float(), atol=1e-2, rtol=2 ** -6)
    torch.testing.assert_close(dw, dw_ref, atol=5e-2, rtol=2 ** -6)


def test_gemma_offset_matches_gemma_rmsnorm():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    torch.manual_seed(2)
    module = GemmaRMSNorm(40, eps=1e-6)
    x = torch.randn(6, 40)
    w = torch.randn(40) * 0.1
    dy = torch.randn(6, 40)
    y_ref, dx_ref, dw_ref = _grads(lambda a, b: torch.func.functional_call(module, {"weight": b}, (a,)), x, w, dy)
    y, dx, dw = _grads(lambda a, b: rms_norm(a, b, 1e-6, offset=True), x, w, dy)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, dx_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, dw_ref, atol=1e-5, rtol=1e-5)


def test_reference_matches_llama_module_in_bf16():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(3)
    module = LlamaRMSNorm(32).bfloat16()
    x = torch.randn(5, 32).bfloat16()
    assert torch.equal(rms_norm_reference(x, module.weight, module.variance_epsilon), module(x))
