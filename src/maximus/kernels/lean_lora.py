"""Lean LoRA projections: PEFT's LoRA math as one autograd node that saves the layer input once.

PEFT's `lora.Linear` / `lora.bnb.Linear4bit` forward is a chain: the base projection, a cast of the
input to the adapters' dtype (float32: a new copy per projection, kept by ``lora_A`` for
backward), ``lora_A``, ``lora_B``, a scale and an add. Each projection keeps its own copy of the
input, so q, k and v keep three float32 copies of the same hidden states, and gate and up two.

`lean_lora_linear` computes the same values (same ops in the same dtypes, under autocast too) and
saves only what backward needs: the input tensor as it came (in the compute dtype; q/k/v receive
the same tensor, so they share it, and so do gate/up), the rank-r product ``x @ A.T`` and the
adapters. Backward is derived by hand (W frozen):

``g = s * dy``;  ``dB = g.T @ (x A.T)``;  ``dA = (g B).T @ x``;  ``dx = dy W + (g B) A``

with the base weight used as it is (dense) or dequantised again for the backward matmul
(bitsandbytes NF4 / FP4, as bitsandbytes itself does). The adapters stay PEFT modules: the
``state_dict`` keys, the saved adapter and the loaded adapter are PEFT's.

`install_lean_lora(model)` routes the plain case of every PEFT LoRA linear through it (one active
vanilla adapter, not merged, no dropout, no DoRA, no LoRA bias, frozen base): every other case,
DoRA included, takes PEFT's own forward (docs/long_context.md). Without gradients (sampling,
evaluation) the plain case computes the same values directly: no autograd node, and none of
PEFT's per-call chain of module calls, which a decode loop would pay once per projection per token. Parity with PEFT in float64 (LoRA)
and float32 (QLoRA): tests/kernels/test_lean_lora.py.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from maximus.kernels.forward_override import install_forward_override, remove_forward_overrides

__all__ = ["install_lean_lora", "uninstall_lean_lora", "lean_lora_linear", "merged_for_sampling"]

_MARK = "_maximus_lean_lora"
#: The (merged weight, bias) a projection samples with inside `merged_for_sampling`.
_MERGED = "_maximus_merged_for_sampling"


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _base_weight(base: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The frozen base weight (out, in) in `dtype`: dense as is, 4-bit dequantised by bitsandbytes."""
    weight = base.weight
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is None:
        return weight.to(dtype)
    import bitsandbytes.functional as bnb_f

    return bnb_f.dequantize_4bit(weight.data, quant_state).to(dtype)


def _lean_values(x, lora_a, lora_b, base, scaling, quantized):
    """(output, x @ A.T, the adapters' matmul dtype): PEFT's values, in its dtypes."""
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type)
    # The adapters' matmuls run where PEFT runs them: in the autocast dtype under autocast, else
    # in the adapters' own dtype (PEFT casts the input to it).
    lora_dtype = torch.get_autocast_dtype(device_type) if autocast else lora_a.dtype
    result = base(x)  # the base projection exactly as PEFT calls it (no graph: inside forward)
    xa = F.linear(x.to(lora_dtype), lora_a.to(lora_dtype))
    lora = F.linear(xa, lora_b.to(lora_dtype)) * scaling
    if quantized and not autocast:
        out = result + lora.to(result.dtype)  # PEFT's Linear4bit: cast, then add
    else:
        out = (result + lora).to(result.dtype)  # PEFT's Linear: add (promoted), then cast
    return out, xa, lora_dtype


class _LeanLoRAFunction(torch.autograd.Function):
    """Inputs (x, lora_a, lora_b, base, scaling, quantized); see `lean_lora_linear`."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, base, scaling, quantized):
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        out, xa, lora_dtype = _lean_values(x, lora_a, lora_b, base, scaling, quantized)
        ctx.save_for_backward(x, xa, lora_a, lora_b)
        ctx.base, ctx.scaling, ctx.lora_dtype = base, scaling, lora_dtype
        # The dtype the base matmul ran in: bitsandbytes' compute dtype, autocast's, or the weight's.
        if quantized:
            ctx.base_dtype = getattr(base, "compute_dtype", None) or x.dtype
        else:
            ctx.base_dtype = torch.get_autocast_dtype(device_type) if autocast else base.weight.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        x, xa, lora_a, lora_b = ctx.saved_tensors
        ld = ctx.lora_dtype
        a, b = lora_a.to(ld), lora_b.to(ld)
        g = _rows(dy).to(ld) * ctx.scaling
        g_b = g @ b  # (tokens, r)
        x2 = _rows(x)
        grad_a = (g_b.t() @ x2.to(ld)).to(lora_a.dtype) if ctx.needs_input_grad[1] else None
        grad_b = (g.t() @ _rows(xa)).to(lora_b.dtype) if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            weight = _base_weight(ctx.base, ctx.base_dtype)
            grad_x = (_rows(dy).to(ctx.base_dtype) @ weight).to(x.dtype)
            del weight
            grad_x = (grad_x + (g_b @ a).to(x.dtype)).view(x.shape)
        return grad_x, grad_a, grad_b, None, None, None


def lean_lora_linear(x: torch.Tensor, base: torch.nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """``base(x) + scaling * (x @ A.T) @ B.T`` as PEFT computes it, saving only ``x`` and ``x @ A.T``.

    base: the frozen base projection (`torch.nn.Linear` or a bitsandbytes `Linear4bit`); lora_a:
    (r, in); lora_b: (out, r). Returns (..., out) in the base output's dtype, as PEFT does.
    """
    quantized = getattr(base.weight, "quant_state", None) is not None
    return _LeanLoRAFunction.apply(x, lora_a, lora_b, base, float(scaling), quantized)


def single_lora_adapter(layer, kwargs) -> str | None:
    """The one active adapter's name when the PEFT LoRA layer's forward is plain LoRA (no variant
    such as DoRA, no LoRA bias, not merged, adapters on, no extra forward kwargs), else None.
    Shared by the lean LoRA forward and the Triton 4-bit path."""
    if kwargs or layer.disable_adapters or layer.merged:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if name in getattr(layer, "lora_variant", {}) or layer.use_dora.get(name, False):
        return None
    if getattr(layer, "lora_bias", {}).get(name, False):
        return None
    return name


def _plain_adapter(layer, args, kwargs) -> str | None:
    """The adapter name when the PEFT layer's forward is plain LoRA on a frozen base with no
    dropout, else None."""
    name = None if args else single_lora_adapter(layer, kwargs)
    if name is None or not isinstance(layer.lora_dropout[name], torch.nn.Identity):
        return None
    if not getattr(layer, "cast_input_dtype_enabled", True):
        return None
    base = layer.get_base_layer()
    # A plain (out, in) weight: nn.Linear or bitsandbytes' 4-bit subclass of it; not GPT-2's
    # transposed Conv1D (fan_in_fan_out), whose backward the hand-derived one does not cover.
    if not isinstance(base, torch.nn.Linear) or getattr(layer, "fan_in_fan_out", False):
        return None
    if base.weight.requires_grad or (getattr(base, "bias", None) is not None and base.bias.requires_grad):
        return None
    return name


def _lean_forward(self, x, *args, **kwargs):
    merged = self.__dict__.get(_MERGED)
    if merged is not None and not args and not kwargs and not torch.is_grad_enabled() and not self.disable_adapters:
        return F.linear(x, *merged)  # inside `merged_for_sampling`: W + s B A, one matmul
    name = _plain_adapter(self, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    a, b, base, scaling = self.lora_A[name].weight, self.lora_B[name].weight, self.get_base_layer(), self.scaling[name]
    if not torch.is_grad_enabled():
        # Sampling and evaluation: the same values without an autograd node, and without PEFT's
        # chain of module calls (GRPO's decode loop runs every projection once per token).
        return _lean_values(x, a, b, base, float(scaling), getattr(base.weight, "quant_state", None) is not None)[0]
    return lean_lora_linear(x, base, a, b, scaling)


setattr(_lean_forward, _MARK, True)


def _mergeable(module: torch.nn.Module) -> str | None:
    """The adapter of a lean-routed PEFT LoRA linear whose merged weight `merged_for_sampling`
    can form: plain LoRA on a dense float32 base (not 4-bit), else None."""
    current = module.__dict__.get("forward")
    if current is None or not getattr(current, _MARK, False):
        return None
    name = _plain_adapter(module, (), {})
    base = module.get_base_layer() if name is not None else None
    if base is None or base.weight.dtype != torch.float32 or getattr(base.weight, "quant_state", None) is not None:
        return None
    return name if module.lora_A[name].weight.dtype == torch.float32 else None


@contextmanager
def merged_for_sampling(model: torch.nn.Module):
    """Within: every lean-routed plain LoRA projection on a float32 base runs its no-grad calls
    (sampling) as one matmul with ``W + s * B @ A``, formed here once (a copy of each adapted
    weight), instead of the base matmul, the two rank-r ones, the scale and the add per call.
    Float32 only: the values differ from the unmerged sum by float32 rounding (1e-7 relative),
    where a bf16 merged weight would round far more. Calls with gradients, with the adapter
    disabled, and everything outside the block take the usual path. Yields how many projections
    were merged."""
    merged = []
    with torch.no_grad():
        for module in model.modules():
            name = _mergeable(module)
            if name is None:
                continue
            base = module.get_base_layer()
            delta = module.lora_B[name].weight @ module.lora_A[name].weight
            module.__dict__[_MERGED] = (torch.add(base.weight, delta, alpha=float(module.scaling[name])), base.bias)
            merged.append(module)
    try:
        yield len(merged)
    finally:
        for module in merged:
            module.__dict__.pop(_MERGED, None)


def _lora_linear_classes() -> tuple[type, ...]:
    from peft.tuners.lora.layer import Linear

    classes: list[type] = [Linear]
    try:
        from peft.tuners.lora.bnb import Linear4bit

        classes.append(Linear4bit)
    except Exception:  # PEFT without bitsandbytes: no 4-bit layers to route
        pass
    return tuple(classes)


def install_lean_lora(model: torch.nn.Module) -> list[str]:
    """Route every PEFT LoRA linear (dense or 4-bit) of `model` through `lean_lora_linear`; returns
    their module paths. Modules whose forward someone else replaced (the Triton QLoRA kernel, a
    hook) are left alone; the check for the plain case runs at every call."""
    classes = _lora_linear_classes()
    return install_forward_override(model, lambda m: type(m) in classes, _lean_forward, _MARK)


def uninstall_lean_lora(model: torch.nn.Module) -> int:
    """Undo `install_lean_lora`; returns how many modules went back to PEFT's forward."""
    return remove_forward_overrides(model, _MARK)
