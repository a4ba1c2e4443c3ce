"""Fused SwiGLU product ``silu(gate) * up``, forward and hand-derived backward.

With ``sg = sigmoid(g)``: ``y = g * sg * u``; ``dy/du = g * sg`` (= silu(g)) and
``dy/dg = u * sg * (1 + g * (1 - sg))``. Math in fp32, one rounding to the output dtype. Eager
PyTorch writes silu(g) to memory and reads it back for the product (and keeps it for backward);
the fused kernel reads g and u once and writes y once, and the backward recomputes the sigmoid.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from maximus.kernels.triton.runtime import require_launchable

_BLOCK = 1024  # elements per program (a flat elementwise map)


@triton.jit
def _swiglu_forward_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u  # sigmoid written out: see the note in rms_norm.py
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sg = 1.0 / (1.0 + tl.exp(-g))
    tl.store(DU + offs, (dy * g * sg).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (dy * u * sg * (1.0 + g * (1.0 - sg))).to(DG.dtype.element_ty), mask=mask)


class SwiGLUFunction(torch.autograd.Function):
    """Autograd wrapper: saves gate and up (as eager does), not silu(gate)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor):
        require_launchable(_swiglu_forward_kernel, gate, "swiglu")
        if gate.shape != up.shape:
            raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate, dtype=torch.promote_types(gate.dtype, up.dtype))
        n = gate.numel()
        _swiglu_forward_kernel[(triton.cdiv(n, _BLOCK),)](gate, up, y, n, BLOCK=_BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _swiglu_backward_kernel[(triton.cdiv(n, _BLOCK),)](dy, gate, up, dg, du, n, BLOCK=_BLOCK)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` (same shapes) with the fused Triton kernel."""
    return SwiGLUFunction.apply(gate, up)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The same math in eager PyTorch (what LlamaMLP computes between its projections)."""
    return F.silu(gate) * up
