"""`token_outputs` (a fused LM head's per-token fields, chunked) against the full-logits reference
and TRL's own `ChunkedLogProbFunction`, values and gradients, frozen and trainable heads; and its
working memory: one reused chunk x vocab buffer, no out-of-place temporaries of that size."""
from __future__ import annotations

import pytest
import torch

from maximus.losses import token_outputs as token_outputs_module
from maximus.losses.token_outputs import OPTIONAL_OUTPUTS, naive_token_outputs, token_outputs
from maximus.memory.meter import StorageTracker

ALL = ("log_probs",) + OPTIONAL_OUTPUTS


def _grads(fields, params, upstream, with_entropy):
    total = (fields["log_probs"] * upstream).sum() + (fields["entropy"] * upstream.flip(0)).sum() * with_entropy
    return torch.autograd.grad(total, params, retain_graph=True)


@pytest.mark.parametrize("row_block", ["1/8 of a chunk", "3 rows"])
@pytest.mark.parametrize("frozen", [True, False])
@pytest.mark.parametrize("softcap,temperature,with_bias", [(None, 1.0, False), (5.0, 0.7, False), (None, 1.3, True),
                                                             (1.0, 1.0, True)])
def test_fields_and_grads_equal_reference(frozen, softcap, temperature, with_bias, row_block, monkeypatch):
    """float64: every field and every gradient (hidden, weight, bias; through log_probs alone = the
    eager frozen-head path, and through entropy too = the recompute path) to 1e-12; chunks of 8
    rows that do not divide 37, and row blocks of 3 rows inside them."""
    n, h, v = 37, 16, 101
    if row_block == "3 rows":
        monkeypatch.setattr(token_outputs_module, "ROW_BLOCKS_PER_CHUNK", 3)  # 3, 3, 2 rows
    torch.manual_seed(0)
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=not frozen)
    bias = torch.randn(v, dtype=torch.float64, requires_grad=not frozen) if with_bias else None
    labels = torch.randint(0, v, (n,))
    labels[:5] = torch.nn.functional.linear(hidden[:5], weight, bias).argmax(dim=1)  # some is_top1 are True
    opts = dict(outputs=ALL, bias=bias, softcap=softcap, temperature=temperature)
    ours = token_outputs(hidden, weight, labels, chunk_size=8, **opts)
    ref = naive_token_outputs(hidden, weight, labels, **opts)
    for name in ALL:
        torch.testing.assert_close(ours[name], ref[name], atol=1e-12, rtol=0)
    assert ours["is_top1"][:5].all() and not ours["is_top1"][5:].all()
    upstream = torch.randn(n, dtype=torch.float64)
    params = [hidden] + ([] if frozen else [weight] + ([bias] if with_bias else []))
    for with_entropy in (False, True):
        for a, b in zip(_grads(ours, params, upstream, with_entropy), _grads(ref, params, upstream, with_entropy),
                        strict=True):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("frozen", [True, False])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_float32_and_bfloat16_equal_reference(dtype, atol, frozen):
    """The dtypes a trainer runs: float32, and bf16 (matmul in bf16 into its own buffer, statistics
    in float32), values and gradients against the reference in the same dtype."""
    torch.manual_seed(2)
    hidden = torch.randn(70, 32, requires_grad=True)
    weight = (torch.randn(1000, 32) * 0.3).requires_grad_(not frozen)
    labels = torch.randint(0, 1000, (70,))
    h, w = hidden.to(dtype), weight.to(dtype)
    ours = token_outputs(h, w, labels, outputs=ALL, softcap=20.0, chunk_size=16)
    ref = naive_token_outputs(h, w, labels, outputs=ALL, softcap=20.0)
    for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        assert ours[name].dtype == torch.float32
        torch.testing.assert_close(ours[name], ref[name], atol=atol, rtol=0)
    upstream = torch.randn(70)
    params = [hidden] if frozen else [hidden, weight]
    for with_entropy in (False, True):
        for a, b in zip(_grads(ours, params, upstream, with_entropy),
                        _grads(ref, params, upstream, with_entropy), strict=True):
            torch.testing.assert_close(a, b, atol=atol, rtol=atol)


@pytest.mark.parametrize("path", ["frozen head", "trainable head, entropy gradient"])
def test_working_memory_is_one_chunk_buffer(path, monkeypatch):
    """Forward + backward hold one reused chunk x vocab buffer (plus the weight gradient when the
    head trains), never a second one: an out-of-place softmax or product would add 2 MiB here.
    Row blocks of 8 rows (1/16 of a chunk)."""
    n, h, v, chunk = 512, 32, 4096, 128
    monkeypatch.setattr(token_outputs_module, "ROW_BLOCKS_PER_CHUNK", 16)
    torch.manual_seed(3)
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=path != "frozen head")
    labels = torch.randint(0, v, (n,))
    buffer_bytes = chunk * v * 4
    with StorageTracker() as tracker:
        fields = token_outputs(hidden, weight, labels, outputs=ALL, chunk_size=chunk)
        total = fields["log_probs"].sum() + (fields["entropy"].sum() if weight.requires_grad else 0.0)
        total.backward()
    weight_grad_bytes = v * h * 4 if weight.requires_grad else 0
    assert buffer_bytes <= tracker.peak_bytes <= buffer_bytes * 1.25 + weight_grad_bytes * 2
    assert hidden.grad is not None and (weight.grad is not None) == weight.requires_grad


def test_equal_to_trl_kernel():
    from trl.kernels import ChunkedLogProbFunction

    torch.manual_seed(1)
    hidden = torch.randn(50, 32, requires_grad=True)
    weight = torch.randn(300, 32)
    labels = torch.randint(0, 300, (50,))
    ours = token_outputs(hidden, weight, labels, outputs=ALL, softcap=30.0, temperature=0.9)
    theirs = ChunkedLogProbFunction.apply(hidden, weight, None, labels, 0.9, 64, 30.0, 1.0, OPTIONAL_OUTPUTS)
    for name, value in zip(ALL, theirs):
        torch.testing.assert_close(ours[name].float(), value.float(), atol=5e-5, rtol=1e-5)  # float32 both
    g_ours, = torch.autograd.grad(ours["log_probs"].sum(), hidden)
    g_theirs, = torch.autograd.grad(theirs[0].sum(), hidden)
    torch.testing.assert_close(g_ours, g_theirs, atol=1e-5, rtol=1e-4)


def test_unknown_output_is_refused():
    with pytest.raises(ValueError, match="token_outputs: unknown output 'logits'"):
        token_outputs(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), outputs=("logits",))
