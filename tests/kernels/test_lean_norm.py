"""Lean RMSNorm (`maximus.kernels.lean_norm`): Transformers' output bitwise, its gradients to
float32 rounding (the published formula in float64 as the oracle), the input kept once and the
backward's float32 work one block of rows at a time."""
from __future__ import annotations

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from maximus.kernels.lean_norm import install_lean_norm, lean_rms_norm, uninstall_lean_norm
from maximus.memory.meter import StorageTracker

from tiny import backward_node_names, one_thread  # noqa: F401  (one_thread: a fixture, used through pytestmark)

pytestmark = pytest.mark.usefixtures("one_thread")


def _norm(cls, hidden, dtype):
    torch.manual_seed(0)
    norm = cls(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5) if cls is GemmaRMSNorm else norm.weight.uniform_(0.5, 1.5)
    return norm


def _float64_oracle(x, weight, g, eps, offset):
    """The published RMSNorm in float64 (no float32 rounding), its input and weight gradients."""
    x = x.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = n * (1.0 + w) if offset else w * n
    y.backward(g.double())
    return x.grad, w.grad


@pytest.mark.parametrize("cls, offset", [(LlamaRMSNorm, False), (GemmaRMSNorm, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_transformers_bitwise_and_gradients_as_close_to_float64(cls, offset, dtype):
    norm = _norm(cls, 48, dtype)
    eps = norm.eps if offset else norm.variance_epsilon
    x = torch.randn(3, 333, 48, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_(True)
    g = torch.randn(3, 333, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = norm(x)
    expected.backward(g)
    hf = (x.grad.clone(), norm.weight.grad.clone())
    x.grad = None
    norm.weight.grad = None
    got = lean_rms_norm(x, norm.weight, eps, offset=offset, block_rows=100)  # blocks that do not divide the rows
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    got.backward(g)
    truth = _float64_oracle(x, norm.weight, g, eps, offset)
    for ours, theirs, exact in zip((x.grad, norm.weight.grad), hf, truth):
        err, hf_err = (ours.double() - exact).abs().max(), (theirs.double() - exact).abs().max()
        scale = exact.abs().max()
        if dtype == torch.float32:
            assert err <= 1e-5 * scale
        assert err <= 1.5 * hf_err + 1e-6 * scale  # never meaningfully worse than Transformers' own


def test_float64_gradients_match_the_oracle():
    """Both Transformers and the lean norm compute in float32 even for float64 rows; the lean node's
    gradient then equals the float64 formula to float32 rounding."""
    norm = _norm(LlamaRMSNorm, 32, torch.float64)
    x = torch.randn(2, 50, 32, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 50, 32, dtype=torch.float64)
    lean_rms_norm(x, norm.weight, norm.variance_epsilon).backward(g)
    gx, gw = _float64_oracle(x, norm.weight, g, norm.variance_epsilon, False)
    torch.testing.assert_close(x.grad, gx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm.weight.grad, gw, rtol=1e-5, atol=1e-4)


def test_the_input_is_kept_once_and_backward_works_in_blocks():
    tokens, hidden = 8192, 256
    unit = tokens * hidden * 4  # one float32 tokens x hidden tensor
    norm = _norm(LlamaRMSNorm, hidden, torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, tokens, hidden, dtype=torch.bfloat16)
    measured = {}
    for name, run in (("transformers", norm), ("lean", lambda t: lean_rms_norm(t, norm.weight, 1e-6))):
        tracker = StorageTracker("cpu")
        with tracker:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = run(x)
            kept = tracker.current_bytes
            tracker.reset_peak()
            y.backward(g)
        measured[name] = (kept / unit, (tracker.peak_bytes - kept) / unit)
        x.grad = None
    # Transformers: the bf16 output and a float32 copy of the input; five float32 temporaries in backward.
    assert measured["transformers"][0] == pytest.approx(1.5, abs=0.01)
    assert measured["transformers"][1] == pytest.approx(5.0, abs=0.01)
    # Lean: the bf16 output and one float32 per row; backward: the bf16 gradient and float32 blocks.
    assert measured["lean"][0] == pytest.approx(0.5, abs=0.01)
    assert measured["lean"][1] < 0.5 + 6 * 1024 / tokens


def test_install_routes_the_models_norms_and_uninstall_restores_them(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).train()
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    stock = model(input_ids=ids, labels=ids)
    stock.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    paths = install_lean_norm(model)
    layers = model.config.num_hidden_layers
    assert len(paths) == 2 * layers + 1 and paths[-1] == "model.norm"
    assert install_lean_norm(model) == paths  # idempotent
    lean = model(input_ids=ids, labels=ids)
    assert torch.equal(lean.logits, stock.logits)
    lean.loss.backward()
    for name, grad in grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-5, atol=1e-6)
    assert "_LeanRMSNormBackward" in backward_node_names(model(input_ids=ids, labels=ids).loss)
    with torch.no_grad():  # inference takes Transformers' own forward
        assert torch.equal(model(input_ids=ids).logits, stock.logits)
    assert uninstall_lean_norm(model) == len(paths)
    assert "_LeanRMSNormBackward" not in backward_node_names(model(input_ids=ids, labels=ids).loss)


def test_trainer_routes_norms_through_lean_unless_turned_off(tiny_llama, pc_data, tmp_path):
    from tiny import kernel_switch_runs

    counts, losses = kernel_switch_runs(tiny_llama, pc_data, tmp_path, "lean_norm")
    assert counts == {True: 5, False: 0}  # 2 layers x 2 norms + the final norm
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=1e-5, atol=1e-6)
