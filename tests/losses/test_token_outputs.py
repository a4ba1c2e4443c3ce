"""`token_outputs` (a fused LM head's per-token fields, chunked) against the full-logits reference
and TRL's own `ChunkedLogProbFunction`, values and gradients, frozen and trainable heads."""
from __future__ import annotations

import pytest
import torch

from maximus.losses.token_outputs import OPTIONAL_OUTPUTS, naive_token_outputs, token_outputs

ALL = ("log_probs",) + OPTIONAL_OUTPUTS


@pytest.mark.parametrize("frozen", [True, False])
@pytest.mark.parametrize("softcap,temperature", [(None, 1.0), (5.0, 0.7)])
def test_fields_and_grads_equal_reference(frozen, softcap, temperature):
    torch.manual_seed(0)
    n, h, v = 37, 16, 101
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=not frozen)
    labels = torch.randint(0, v, (n,))
    ours = token_outputs(hidden, weight, labels, outputs=ALL, softcap=softcap, temperature=temperature, chunk_size=8)
    ref = naive_token_outputs(hidden, weight, labels, outputs=ALL, softcap=softcap, temperature=temperature)
    for name in ALL:
        torch.testing.assert_close(ours[name], ref[name], atol=1e-12, rtol=0)
    upstream = torch.randn(n, dtype=torch.float64)
    params = [hidden] if frozen else [hidden, weight]
    for with_entropy in (False, True):  # the eager frozen-head path, then the recompute path
        def total(fields):
            return (fields["log_probs"] * upstream).sum() + (fields["entropy"].sum() if with_entropy else 0.0)
        got = torch.autograd.grad(total(ours), params, retain_graph=True)
        want = torch.autograd.grad(total(ref), params, retain_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


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
