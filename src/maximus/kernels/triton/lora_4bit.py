"""LoRA on a frozen NF4 base weight with a hand-derived backward (Unsloth's LoRA_W approach).

Forward:  ``y = (x @ W.T + bias) + s * (x_l @ A.T) @ B.T`` with ``W = dequant(qweight)`` rebuilt by the
NF4 kernel, ``x_l`` the LoRA input (``x`` itself, or ``dropout(x)``), A: (r, in), B: (out, r), s: scaling.
Backward (dy: (tokens, out); W frozen, so no dW):
``dx = dy @ W`` (W dequantised again) ``+ s * (dy @ B) @ A`` (the second term to ``x_l``),
``dB = s * dy.T @ (x_l @ A.T)`` and ``dA = s * (dy @ B).T @ x_l``.
The dequantised weight lives only inside forward and inside backward, never between them: saved
are x_l as it came (in the compute dtype, no float32 copy: projections fed the same tensor share
it), the small (tokens, r) product ``x_l @ A.T``, A, B and the packed bytes. One autograd node instead of PEFT's chain
(clone, two linears, scale, cast, add), and the weight decoded by the fused NF4 kernel.

Dtypes follow PEFT + bitsandbytes: the base path runs in the layer's compute dtype (the dequantised
weight's dtype), the LoRA path in the adapters' dtype, and the sum is returned in ``x.dtype``.
"""
from __future__ import annotations

import torch

from maximus.kernels.triton.nf4 import dequantize_nf4, dequantize_nf4_reference


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class LoRALinear4bitFunction(torch.autograd.Function):
    """Autograd wrapper: inputs (x, lora_x, qweight, quant_state, A, B, scaling, bias, compute_dtype,
    lora_dtype). The LoRA matmuls run in ``lora_dtype`` (the adapters' own dtype, or autocast's)."""

    @staticmethod
    def forward(ctx, x, lora_x, qweight, quant_state, lora_a, lora_b, scaling, bias, compute_dtype, lora_dtype):
        weight = dequantize_nf4(qweight, quant_state, compute_dtype)
        x2 = _as_rows(x)
        base = x2.to(compute_dtype) @ weight.t()
        del weight  # never kept: backward dequantises again
        if bias is not None:
            base = base + bias.to(compute_dtype)
        lx = _as_rows(lora_x)
        xa = lx.to(lora_dtype) @ lora_a.to(lora_dtype).t()
        out = base.to(x.dtype) + ((xa @ lora_b.to(lora_dtype).t()) * scaling).to(x.dtype)
        # The input as it came (a view: q/k/v, and gate/up, share one saved tensor), never a
        # lora_dtype copy; backward casts it again.
        ctx.save_for_backward(lx, xa, lora_a, lora_b, qweight)
        ctx.quant_state, ctx.scaling, ctx.compute_dtype = quant_state, scaling, compute_dtype
        ctx.lora_dtype = lora_dtype
        ctx.same_input = lora_x is x
        ctx.shapes = (x.shape, lora_x.shape)
        ctx.dtypes = (x.dtype, lora_x.dtype)
        ctx.bias_grad = bias is not None and ctx.needs_input_grad[7]
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        lx, xa, lora_a, lora_b, qweight = ctx.saved_tensors
        s = ctx.scaling
        dy2 = _as_rows(dy)
        a, b = lora_a.to(ctx.lora_dtype), lora_b.to(ctx.lora_dtype)
        dy_l = dy2.to(ctx.lora_dtype)
        dy_b = dy_l @ b  # (tokens, r)
        grad_a = ((dy_b.t() @ lx.to(ctx.lora_dtype)) * s).to(lora_a.dtype) if ctx.needs_input_grad[4] else None
        grad_b = ((dy_l.t() @ xa) * s).to(lora_b.dtype) if ctx.needs_input_grad[5] else None
        grad_bias = dy2.sum(0) if ctx.bias_grad else None
        x_shape, lx_shape = ctx.shapes
        x_dtype, lx_dtype = ctx.dtypes
        grad_x = grad_lx = None
        lora_dx = (dy_b @ a) * s
        if ctx.needs_input_grad[0]:
            weight = dequantize_nf4(qweight, ctx.quant_state, ctx.compute_dtype)
            grad_x = (dy2.to(ctx.compute_dtype) @ weight).to(x_dtype)
            del weight
            if ctx.same_input:  # one tensor fed both paths: return the sum once
                grad_x = grad_x + lora_dx.to(x_dtype)
            grad_x = grad_x.view(x_shape)
        if not ctx.same_input and ctx.needs_input_grad[1]:
            grad_lx = lora_dx.to(lx_dtype).view(lx_shape)
        return grad_x, grad_lx, None, None, grad_a, grad_b, None, grad_bias, None, None


def lora_linear_4bit(x: torch.Tensor, qweight: torch.Tensor, quant_state, lora_a: torch.Tensor,
                     lora_b: torch.Tensor, scaling: float, *, bias: torch.Tensor | None = None,
                     lora_input: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None,
                     lora_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x @ dequant(qweight).T + bias + scaling * (lora_input @ A.T) @ B.T` with a hand-written backward.

    x: (..., in); qweight + quant_state: a bitsandbytes NF4 weight of logical shape (out, in);
    lora_a: (r, in); lora_b: (out, r); lora_input: x after LoRA dropout (default: x itself);
    compute_dtype: the base matmul dtype (default quant_state.dtype, as bitsandbytes); lora_dtype: the
    LoRA matmuls' dtype (default A's: PEFT without autocast; under autocast PEFT's LoRA matmuls run in
    the autocast dtype, which the caller passes). Returns (..., out) in x.dtype. Gradients flow to x,
    lora_input, A, B (in their own dtypes; and bias if it requires grad), never to the weight.
    """
    compute_dtype = compute_dtype or quant_state.dtype
    lora_x = x if lora_input is None else lora_input
    return LoRALinear4bitFunction.apply(x, lora_x, qweight, quant_state, lora_a, lora_b, float(scaling), bias,
                                        compute_dtype, lora_dtype or lora_a.dtype)


def lora_linear_4bit_reference(x: torch.Tensor, qweight: torch.Tensor, quant_state, lora_a: torch.Tensor,
                               lora_b: torch.Tensor, scaling: float, *, bias: torch.Tensor | None = None,
                               lora_input: torch.Tensor | None = None,
                               compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The same math in eager PyTorch with autograd (the oracle beside PEFT's Linear4bit forward)."""
    compute_dtype = compute_dtype or quant_state.dtype
    weight = dequantize_nf4_reference(qweight, quant_state, compute_dtype)
    base = x.to(compute_dtype) @ weight.t()
    if bias is not None:
        base = base + bias.to(compute_dtype)
    lx = (x if lora_input is None else lora_input).to(lora_a.dtype)
    return base.to(x.dtype) + ((lx @ lora_a.t() @ lora_b.t()) * scaling).to(x.dtype)
