"""Fused RMSNorm, forward and hand-derived backward, in one pass over each row.

Math (per row of length H, fp32 throughout): ``r = 1 / sqrt(mean(x^2) + eps)``, ``n = x * r``,
Llama / Mistral / Qwen2: ``y = w * n.to(x.dtype)`` (the normalised row is rounded to the input dtype
before the weight multiplies it, as Transformers does, so a fp32 weight gives a fp32 output);
Gemma (``offset=True``): ``y = (n * (1 + w)).to(x.dtype)``.

Backward with ``g = dy * w_eff`` (``w_eff`` = w or 1 + w): ``dx = r * (g - n * mean(g * n))`` and
``dw = sum over rows of dy * n``. The forward keeps one fp32 ``r`` per row (4 bytes a row) instead of
the fp32 copies of the row that eager autograd saves.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from maximus.kernels.triton.runtime import program_count, require_launchable, rows_of


@triton.jit
def _add(a, b):
    return a + b


# Only core builtins inside the kernels: sums are tl.reduce with our own combine function, zeros are
# tl.full, the sigmoid in swiglu.py is written out. Triton's standard-library helpers (sum, zeros,
# sigmoid) are jit functions built when triton is first imported, so under TRITON_INTERPRET they work
# only if triton itself was first imported with it set; ours are built with the kernel modules.
@triton.jit
def _rms_norm_forward_kernel(X, W, Y, RSTD, stride_x, stride_y, n_cols, eps,
                             BLOCK: tl.constexpr, OFFSET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 0, _add) / n_cols + eps)
    n = x * rstd
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        y = n * (1.0 + w)
    else:
        y = n.to(X.dtype.element_ty).to(tl.float32) * w
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, stride_dy, stride_x, stride_dx, n_rows, n_cols,
                              rows_per_program, BLOCK: tl.constexpr, OFFSET: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        w = w + 1.0
    dw = tl.full((BLOCK,), 0.0, tl.float32)
    first = pid.to(tl.int64) * rows_per_program  # int64 so row * stride cannot overflow
    last = tl.minimum(first + rows_per_program, n_rows)
    for row in range(first, last):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        n = x * rstd
        g = dy * w
        dx = rstd * (g - n * (tl.reduce(g * n, 0, _add) / n_cols))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if OFFSET:
            dw += dy * n
        else:
            dw += dy * n.to(X.dtype.element_ty).to(tl.float32)
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)


def _block(n_cols: int) -> int:
    return triton.next_power_of_2(n_cols)


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: inputs (x, weight, eps, offset); saves x, weight and one fp32 rstd per row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool):
        require_launchable(_rms_norm_forward_kernel, x, "rms_norm")
        x2 = rows_of(x)
        rows, cols = x2.shape
        out_dtype = x.dtype if offset else torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        _rms_norm_forward_kernel[(rows,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), cols, eps,
                                          BLOCK=_block(cols), OFFSET=offset)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.offset = offset
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], cols)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        rows, cols = x2.shape
        dy2 = rows_of(dy)
        dx = torch.empty_like(x2)
        programs = program_count(x2.device, rows)
        rows_per_program = -(-rows // programs)
        dw_partial = torch.empty((programs, cols), dtype=torch.float32, device=x2.device)
        _rms_norm_backward_kernel[(programs,)](dy2, x2, weight, rstd, dx, dw_partial, dy2.stride(0), x2.stride(0),
                                               dx.stride(0), rows, cols, rows_per_program,
                                               BLOCK=_block(cols), OFFSET=ctx.offset)
        dw = dw_partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.x_shape), dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any leading shape) with the fused Triton kernel.

    `offset=False` is Llama/Mistral/Qwen2 (`w * n`), `offset=True` is Gemma (`(1 + w) * n`). Output dtype
    follows Transformers: promote(x, w) for Llama style, x.dtype for Gemma style.
    """
    return RMSNormFunction.apply(x, weight, float(eps), bool(offset))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: bool = False) -> torch.Tensor:
    """The same math in eager PyTorch (the oracle beside Transformers' own RMSNorm modules)."""
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (n * (1.0 + weight.float())).to(x.dtype)
    return weight * n.to(x.dtype)
