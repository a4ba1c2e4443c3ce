"""Lean RMSNorm in plain PyTorch: the input kept once, float32 work one block of rows at a time.

Transformers' ``LlamaRMSNorm`` (and Mistral's, Qwen2's, Gemma's) computes in float32: its forward
saves a float32 copy of the whole input for backward, and its backward holds five float32
``tokens x hidden`` temporaries at once (measured with the CPU meter). In a long-context step
with the MLP tiled (`maximus.kernels.tiled_mlp`), that backward is the peak of the recomputed
layer: at 32k tokens on the reference model, 5 x 64 MiB of float32 beside everything else.

`lean_rms_norm` is one autograd node with a hand-written backward, the math of the Triton kernel
(`maximus.kernels.triton.rms_norm`) in eager PyTorch, for the devices and modes where that
kernel does not run (CPU, ``kernels: eager``):

* forward, per block of rows: ``r = 1 / sqrt(mean(x^2) + eps)``, ``n = x * r`` in float32, then
  Llama style ``y = w * n.to(x.dtype)`` or Gemma style ``y = (n * (1 + w)).to(x.dtype)``: the same
  operations as Transformers in the same order, so the output is bitwise the same;
* it saves the input (by reference: no copy) and one float32 ``r`` per row;
* backward, per block of rows: ``g = dy * w_eff``, ``dx = r * (g - n * mean(g * n))``, and for a
  trainable weight ``dw = sum(dy * n)`` (``n`` rounded to the input dtype first, Llama style).

Working memory in backward: float32 blocks of `BLOCK_ROWS` rows, not of the whole sequence.
Gradients equal autograd's through Transformers' module to float32 rounding (tests in float64,
float32 and bf16). Installed per module instance (`install_lean_norm`), so the class, its
state_dict keys and PEFT's wrapping stay; `uninstall_lean_norm` takes it off again.
"""
from __future__ import annotations

import torch

from maximus.kernels.forward_override import install_forward_override, is_transformers_class, remove_forward_overrides

__all__ = ["lean_rms_norm", "install_lean_norm", "uninstall_lean_norm", "norm_settings", "NORM_CLASSES", "BLOCK_ROWS"]

#: Transformers RMSNorm classes with the Llama formula (False) or Gemma's ``1 + w`` (True); the
#: Triton RMSNorm (`maximus.kernels.triton.install`) takes the same ones.
NORM_CLASSES = {"LlamaRMSNorm": False, "MistralRMSNorm": False, "Qwen2RMSNorm": False, "GemmaRMSNorm": True,
                # Same formulas, checked equal in fp32 and bf16 (tests/models/test_families.py). Not here:
                # OLMo 2's and gpt-oss's, which multiply by the weight before casting back.
                "Qwen3RMSNorm": False, "Qwen3MoeRMSNorm": False, "MixtralRMSNorm": False, "Phi3RMSNorm": False,
                "GraniteRMSNorm": False, "Gemma2RMSNorm": True, "Gemma3RMSNorm": True}
#: Rows per float32 block: 1,024 rows of a 4,096-wide model are 16 MiB per temporary.
BLOCK_ROWS = 1024
_MARK = "_maximus_lean_norm"


def _normalise(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, r) in float32 for rows `x`, as Transformers computes them."""
    xf = x.to(torch.float32)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * r, r


class _LeanRMSNorm(torch.autograd.Function):
    """Inputs (x, weight, eps, offset, block_rows); x: (rows, hidden)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, block_rows):
        out_dtype = x.dtype if offset else torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
        for s in range(0, x.shape[0], block_rows):
            n, r = _normalise(x[s:s + block_rows], eps)
            rstd[s:s + block_rows] = r
            y[s:s + block_rows] = (n * (1.0 + weight.float())).to(x.dtype) if offset else weight * n.to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.block_rows = offset, block_rows
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        offset, block_rows = ctx.offset, ctx.block_rows
        w = weight.float() + 1.0 if offset else weight.float()
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[1] else None
        for s in range(0, x.shape[0], block_rows):
            r = rstd[s:s + block_rows]
            n = x[s:s + block_rows].to(torch.float32) * r
            dyb = dy[s:s + block_rows].to(torch.float32)
            if dx is not None:
                g = dyb * w
                dx[s:s + block_rows] = r * (g - n * (g * n).mean(-1, keepdim=True))
            if dw is not None:
                dw += (dyb * (n if offset else n.to(x.dtype).to(torch.float32))).sum(0)
        return dx, (dw.to(weight.dtype) if dw is not None else None), None, None, None


def lean_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: bool = False,
                  block_rows: int = BLOCK_ROWS) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any leading shape), saving `x` and one float32 per row.

    `offset=False`: Llama / Mistral / Qwen2 (``w * n``, output dtype promote(x, w)); `offset=True`:
    Gemma (``(1 + w) * n``, output in x's dtype), as Transformers computes them.
    """
    rows = x.reshape(-1, x.shape[-1])
    y = _LeanRMSNorm.apply(rows, weight, float(eps), bool(offset), int(block_rows))
    return y.view(*x.shape[:-1], x.shape[-1])


def norm_settings(module: torch.nn.Module) -> tuple[float, bool]:
    """(eps, offset) of one of the `NORM_CLASSES` modules: Gemma's is ``eps`` with ``1 + w``, the
    Llama family's ``variance_epsilon`` with ``w``."""
    offset = NORM_CLASSES[type(module).__name__]
    return (module.eps if offset else module.variance_epsilon), offset


def _lean_norm_forward(self, hidden_states):
    if not (torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad)):
        return type(self).forward(self, hidden_states)  # inference: nothing to save, the stock path
    eps, offset = norm_settings(self)
    return lean_rms_norm(hidden_states, self.weight, eps, offset=offset)


setattr(_lean_norm_forward, _MARK, True)


def _is_norm(module: torch.nn.Module) -> bool:
    return is_transformers_class(module, NORM_CLASSES)


def install_lean_norm(model: torch.nn.Module) -> list[str]:
    """Route every Transformers RMSNorm of `model` (`NORM_CLASSES`) through `lean_rms_norm`; returns
    their module paths. Modules whose forward someone else replaced (the Triton RMSNorm) are left alone."""
    return install_forward_override(model, _is_norm, _lean_norm_forward, _MARK)


def uninstall_lean_norm(model: torch.nn.Module) -> int:
    """Undo `install_lean_norm`; returns how many modules went back to Transformers' forward."""
    return remove_forward_overrides(model, _MARK)
