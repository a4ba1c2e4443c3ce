"""Swap the Triton kernels into a Transformers Llama / Mistral / Qwen2 model (PEFT-wrapped or not).

What is patched, per module instance (the classes are untouched, other models are unaffected):

- ``LlamaRMSNorm`` / ``MistralRMSNorm`` / ``Qwen2RMSNorm`` (and ``GemmaRMSNorm``, ``1 + w`` style):
  forward -> :func:`rms_norm`.
- ``LlamaMLP`` / ``MistralMLP`` / ``Qwen2MLP`` with a SiLU activation: ``act(gate) * up`` -> :func:`swiglu`
  (the projections stay modules, so their LoRA / 4-bit forwards apply as usual).
- ``LlamaAttention`` / ``MistralAttention`` / ``Qwen2Attention``: the rotary step -> :func:`apply_rotary`.
  Transformers calls ``apply_rotary_pos_emb`` from the modeling module's globals, so that name is
  replaced once by a dispatcher that uses the kernel only inside a patched attention's forward
  (a context variable) and calls the original everywhere else.
- PEFT ``lora.bnb.Linear4bit`` (QLoRA): forward -> :func:`lora_linear_4bit` for the plain case (one
  active vanilla adapter, not merged, NF4 weight; under autocast its LoRA matmuls run in the autocast
  dtype, as PEFT's do); anything else takes PEFT's own forward.

Every patched forward re-checks at call time and falls back to the original when the kernel cannot
run on the tensor's device or the case is not covered. Modules of unknown types are skipped, and so
are modules whose forward someone else already replaced.
"""
from __future__ import annotations

import contextvars
import sys
import types

import torch

from maximus.kernels.forward_override import is_transformers_class as _is_transformers_class
from maximus.kernels.forward_override import remove_forward_overrides
from maximus.kernels.lean_norm import NORM_CLASSES as RMS_NORM_CLASSES
from maximus.kernels.lean_norm import norm_settings
from maximus.kernels.triton.runtime import TRITON_HINT, TritonKernelsUnavailable, interpreting, triton_import_error
from maximus.structure import compute_device

MLP_CLASSES = ("LlamaMLP", "MistralMLP", "Qwen2MLP")
ATTENTION_CLASSES = ("LlamaAttention", "MistralAttention", "Qwen2Attention")

_ROPE_ACTIVE = contextvars.ContextVar("maximus_triton_rope_active", default=False)
_MARK = "_maximus_triton_kernel"  # attribute on our forwards: which kernel they route to


def _is_silu(act) -> bool:
    """torch's SiLU or Transformers' SiLUActivation (what ACT2FN["silu"] builds); anything else is skipped."""
    return isinstance(act, torch.nn.SiLU) or (type(act).__name__ == "SiLUActivation"
                                              and type(act).__module__ == "transformers.activations")


def _rms_norm_forward(self, hidden_states):
    from maximus.kernels.triton.rms_norm import _rms_norm_forward_kernel, rms_norm
    from maximus.kernels.triton.runtime import can_launch

    if not can_launch(_rms_norm_forward_kernel, hidden_states):
        return type(self).forward(self, hidden_states)
    eps, offset = norm_settings(self)
    return rms_norm(hidden_states, self.weight, eps, offset=offset)


def _mlp_forward(self, x):
    from maximus.kernels.triton.runtime import can_launch
    from maximus.kernels.triton.swiglu import _swiglu_forward_kernel, swiglu

    from maximus.kernels.tiled_mlp import tiled_module_forward

    if not can_launch(_swiglu_forward_kernel, x):
        return type(self).forward(self, x)
    # Tiled when checkpointing asked for it (`optimization.tile_tokens`), as the class's own forward is.
    return tiled_module_forward(self, lambda t: self.down_proj(swiglu(self.gate_proj(t), self.up_proj(t))), x)


def _attention_forward(self, *args, **kwargs):
    token = _ROPE_ACTIVE.set(True)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _ROPE_ACTIVE.reset(token)


def _rope_dispatcher(original):
    """A stand-in for a modeling module's `apply_rotary_pos_emb`: the kernel inside patched attentions only."""
    from maximus.kernels.triton.rope import _rope_kernel, apply_rotary, rope_supported
    from maximus.kernels.triton.runtime import can_launch

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if _ROPE_ACTIVE.get() and not kwargs and len(args) <= 1:
            unsqueeze_dim = args[0] if args else 1
            if rope_supported(q, k, cos, sin, unsqueeze_dim) and can_launch(_rope_kernel, q):
                return apply_rotary(q, k, cos, sin, unsqueeze_dim)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._maximus_original = original
    return apply_rotary_pos_emb


def _install_rope_dispatcher(attention: torch.nn.Module) -> bool:
    """Route the attention's modeling module's `apply_rotary_pos_emb` through the dispatcher (once)."""
    modeling = sys.modules.get(type(attention).__module__)
    original = getattr(modeling, "apply_rotary_pos_emb", None)
    if original is None:
        return False
    if not hasattr(original, "_maximus_original"):
        modeling.apply_rotary_pos_emb = _rope_dispatcher(original)
    return True


def _remove_rope_dispatcher(attention: torch.nn.Module) -> None:
    """Put the modeling module's own `apply_rotary_pos_emb` back (outside a patched attention the
    dispatcher only calls it, so another model still patched computes the same values)."""
    modeling = sys.modules.get(type(attention).__module__)
    original = getattr(getattr(modeling, "apply_rotary_pos_emb", None), "_maximus_original", None)
    if original is not None:
        modeling.apply_rotary_pos_emb = original


def _lora_4bit_forward(self, x, *args, **kwargs):
    from maximus.kernels.lean_lora import single_lora_adapter
    from maximus.kernels.triton.lora_4bit import lora_linear_4bit
    from maximus.kernels.triton.nf4 import _dequantize_nf4_kernel, nf4_supported
    from maximus.kernels.triton.runtime import can_launch

    name = None if args else single_lora_adapter(self, kwargs)
    base = self.base_layer
    quant_state = getattr(base.weight, "quant_state", None)
    if name is None or not nf4_supported(quant_state) or not can_launch(_dequantize_nf4_kernel, x):
        return type(self).forward(self, x, *args, **kwargs)
    dropout = self.lora_dropout[name]
    lora_input = None if isinstance(dropout, torch.nn.Identity) else dropout(x)
    compute_dtype = getattr(base, "compute_dtype", None) or x.dtype  # bitsandbytes' own default
    args = (x, base.weight, quant_state, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name])
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        # What PEFT + bitsandbytes do under autocast: the LoRA matmuls in the autocast dtype, the
        # 4-bit matmul in its compute dtype; the fused node runs with autocast off and says so.
        with torch.autocast(device_type, enabled=False):
            return lora_linear_4bit(*args, bias=base.bias, lora_input=lora_input, compute_dtype=compute_dtype,
                                    lora_dtype=torch.get_autocast_dtype(device_type))
    return lora_linear_4bit(*args, bias=base.bias, lora_input=lora_input, compute_dtype=compute_dtype)


def _peft_linear4bit_class():
    try:
        from peft.tuners.lora.bnb import Linear4bit
    except Exception:  # PEFT without bitsandbytes support: nothing 4-bit to patch
        return None
    return Linear4bit


def _patch(module: torch.nn.Module, forward, kind: str) -> bool:
    current = module.__dict__.get("forward")
    if current is not None:  # ours already (idempotent) or someone else's hook: leave it
        return getattr(current, _MARK, None) == kind
    bound = types.MethodType(forward, module)
    module.forward = bound
    return True


for _forward, _kind in ((_rms_norm_forward, "rms_norm"), (_mlp_forward, "swiglu"), (_attention_forward, "rope"),
                       (_lora_4bit_forward, "lora_4bit")):
    setattr(_forward, _MARK, _kind)


def check_triton_usable(device: torch.device) -> None:
    """Raise TritonKernelsUnavailable unless Triton imports and can run on `device` (CUDA, or CPU interpreted)."""
    reason = triton_import_error()
    if reason is not None:
        raise TritonKernelsUnavailable(f"optimization.kernels: Triton is not importable ({reason})", TRITON_HINT)
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        raise TritonKernelsUnavailable(f"optimization.kernels: Triton kernels need a CUDA device, the model is on "
                                       f"{device.type}", TRITON_HINT)
    from maximus.kernels.triton.rms_norm import _rms_norm_forward_kernel
    from maximus.kernels.triton.runtime import require_launchable

    require_launchable(_rms_norm_forward_kernel, torch.empty(0, device=device), "optimization.kernels")


def install_triton_kernels(model: torch.nn.Module) -> list[str]:
    """Patch the known modules of `model` in place; returns "kind: module.path" for each one patched.

    Raises TritonKernelsUnavailable (a MaximusError) when Triton is missing or the model is not on
    CUDA and TRITON_INTERPRET is unset; the caller turns that into a fallback notice.
    """
    check_triton_usable(compute_device(model))
    linear4bit = _peft_linear4bit_class()
    patched: list[str] = []
    for path, module in model.named_modules():
        kind = None
        if _is_transformers_class(module, RMS_NORM_CLASSES):
            kind = _patch(module, _rms_norm_forward, "rms_norm") and "rms_norm"
        elif _is_transformers_class(module, MLP_CLASSES):
            if _is_silu(getattr(module, "act_fn", None)):
                kind = _patch(module, _mlp_forward, "swiglu") and "swiglu"
        elif _is_transformers_class(module, ATTENTION_CLASSES):
            if _install_rope_dispatcher(module):
                kind = _patch(module, _attention_forward, "rope") and "rope"
        elif linear4bit is not None and isinstance(module, linear4bit):
            kind = _patch(module, _lora_4bit_forward, "lora_4bit") and "lora_4bit"
        if kind:
            patched.append(f"{kind}: {path}")
    return patched


def uninstall_triton_kernels(model: torch.nn.Module) -> int:
    """Undo install_triton_kernels on `model`, the modeling modules' `apply_rotary_pos_emb` included;
    returns how many modules went back to their own forward."""
    for module in model.modules():
        if _is_transformers_class(module, ATTENTION_CLASSES):
            _remove_rope_dispatcher(module)
    return remove_forward_overrides(model, _MARK)


def summarize(patched: list[str]) -> str:
    """A one-line notice for install_triton_kernels' result, e.g. "rms_norm x5, rope x2, swiglu x2"."""
    counts: dict[str, int] = {}
    for entry in patched:
        kind = entry.split(":", 1)[0]
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{kind} x{n}" for kind, n in counts.items()) or "nothing"
