"""The lean losses under autocast: one cast of the head, bf16 matmuls, the same numbers as the
explicit bf16 computation (the QLoRA case: float32 residual stream, bf16 frozen head)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from maximus.losses.ghost_logit import ghost_logit_loss
from maximus.losses.linear_cross_entropy import linear_cross_entropy, matmul_dtype


class _Matmuls(TorchDispatchMode):
    """Dtypes of every mm/addmm and the number of copies the size of the weight."""

    def __init__(self, weight_numel: int):
        super().__init__()
        self.weight_numel = weight_numel
        self.mm_dtypes = set()
        self.weight_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        if name.startswith(("mm", "addmm")):
            self.mm_dtypes.add(args[-1].dtype if name.startswith("mm") else args[1].dtype)
        if name.startswith(("_to_copy", "copy_")) and isinstance(out, torch.Tensor) and out.numel() == self.weight_numel:
            self.weight_copies += 1
        return out


def _case(seed=0, tokens=96, vocab=500, hidden=32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, requires_grad=True)  # float32, like a QLoRA residual stream
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(torch.bfloat16)  # frozen bf16 head
    y = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, y


def test_matmul_dtype_follows_autocast():
    h = torch.zeros(2, 2)
    assert matmul_dtype(h) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert matmul_dtype(h) == torch.bfloat16
        assert matmul_dtype(h.double()) == torch.float64


def test_exact_loss_under_autocast_equals_explicit_bf16_and_casts_the_head_once():
    h, w, y = _case()
    rec = _Matmuls(w.numel())
    with torch.autocast("cpu", dtype=torch.bfloat16), rec:
        loss = linear_cross_entropy(h, w, y, chunk_size=16, reduction="sum")
        loss.backward()
    assert rec.mm_dtypes == {torch.bfloat16}
    assert rec.weight_copies == 0  # the head is already bf16: no copy at all (autocast made one per chunk)
    # Oracle: bf16 logits from an explicit bf16 matmul, float32 softmax, F.cross_entropy.
    h2 = h.detach().clone().requires_grad_(True)
    logits = (h2.to(torch.bfloat16) @ w.t()).float()
    ref = F.cross_entropy(logits, y, reduction="sum")
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(h.grad, h2.grad, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("kind", ["exact", "ghost"])
def test_float32_head_under_autocast_is_cast_once(kind):
    h, w, y = _case(1)
    w32 = w.float()
    rec = _Matmuls(w32.numel())
    with torch.autocast("cpu", dtype=torch.bfloat16), rec:
        if kind == "exact":
            linear_cross_entropy(h, w32, y, chunk_size=16, reduction="sum").backward()
        else:
            ghost_logit_loss(h, w32, y, num_candidates=64, prefix_dims=8, chunk_size=16, reduction="sum").backward()
    if kind == "exact":
        assert rec.weight_copies == 1  # (the ghost loss also reads the head block-wise in float32 for its statistics)
    assert torch.float32 not in rec.mm_dtypes
