"""SDPA attention with learned per-head sink logits (gpt-oss), exact, through PyTorch's fused kernel.

gpt-oss adds one learned logit per query head, the *sink*, to every softmax row and drops it
after: ``p_j = exp(s_j) / (exp(sink_h) + sum_i exp(s_i))``, so the weights of a row sum to less
than 1. Transformers gives the class no SDPA path (`_supports_sdpa = False`): its eager attention
materialises the ``[B, H, T, T]`` scores, their softmax and copies, in float32 the largest
tensors a gpt-oss layer keeps for backward.

The same function as one SDPA call, with nothing approximated: one extra head dimension and one
extra key and value per head,

* query ``[q, sink_h / scale]``, keys ``[k_j, 0]``, a sink key ``[0, ..., 0, 1]`` and a zero value:
  the sink key's logit is ``scale * (q . 0 + sink_h / scale) = sink_h`` for every query and head
  (the per-head value sits in the query, so grouped keys stay shared), every other logit is
  unchanged, and the zero value adds nothing to the output; the sink's gradient arrives through
  the query's extra dimension;
* the sink key goes first, so it is visible to every query: without a mask a placeholder query
  goes first too and SDPA's causal flag (upper-left aligned) shifts with it, so the kernel still
  skips the masked half; with a mask (padding, packed documents, a sliding window shorter than
  the keys, as Transformers' SDPA mask builds it) the mask becomes additive with one leading 0
  column, once per mask and forward: the layers that share a mask share it (one float mask per
  kind of layer, full or sliding, kept for backward; not one per layer);
* the value gets the extra dimension as a zero column, so query, key and value share one head
  size and the CPU flash kernel takes them (a narrower value falls back to the math kernel).

``training.dtype`` bf16: the sink logit passes through the query as ``sink / scale`` in the compute
dtype (exact when the head size is a power of 4, e.g. 64: the scale is a power of 2).
Chosen at load time for the model types in `SINK_MODEL_TYPES` (`maximus.families`); a model
loaded elsewhere with Transformers' eager attention is switched by `use_sink_attention`
(`maximus.kernels.apply_kernels`, so also under `maximus.patch`).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["IMPLEMENTATION", "SINK_MODEL_TYPES", "register_sink_attention", "sink_attention_forward", "use_sink_attention"]

IMPLEMENTATION = "maximus_sinks"
#: Model types whose attention has learned sinks (`s_aux`) and takes this path.
SINK_MODEL_TYPES = ("gpt_oss",)


def _augmented(query, key, value, sinks, scale):
    """(query, key, value) with the sink dimension and the leading sink key / zero value."""
    b, h, tq, d = query.shape
    extra = (sinks.to(query.dtype) / scale).view(1, h, 1, 1).expand(b, h, tq, 1)
    query = torch.cat([query, extra], dim=-1)
    sink_key = key.new_zeros(b, key.shape[1], 1, d + 1)
    sink_key[..., d] = 1
    key = torch.cat([sink_key, F.pad(key, (0, 1))], dim=2)
    value = F.pad(value, (0, 1, 1, 0))
    return query, key, value


#: id(mask Transformers built) -> (its key, the additive mask with the sink column); an entry goes
#: when its source mask is freed (the end of the forward that built it).
_MASKS: dict[int, tuple] = {}


def _with_sink_column(mask: torch.Tensor, kv_length: int, dtype: torch.dtype) -> torch.Tensor:
    """A Transformers SDPA mask (bool: True = attend, or additive float) as an additive mask of
    the keys with the sink key's leading 0 column. Worked out once per mask: the layers of a kind
    (full or sliding) get the same mask tensor in a forward, so they share one additive mask
    (SDPA would otherwise turn each layer's boolean mask into a float copy and keep it for backward)."""
    key = (kv_length, dtype, mask._version, tuple(mask.shape))
    cached = _MASKS.get(id(mask))
    if cached is not None and cached[0] == key:
        return cached[1]
    source, mask = mask, mask[..., :kv_length]
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    additive = F.pad(mask.to(dtype), (1, 0))
    ident = id(source)
    _MASKS[ident] = (key, additive, weakref.ref(source, lambda _: _MASKS.pop(ident, None)))
    return additive


def sink_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, s_aux=None,
                           **kwargs):
    """Transformers attention function: query [B, H, Tq, D], key/value [B, Hkv, Tk, D] and the
    module's sinks (``s_aux`` [H]) -> ([B, Tq, H, D], None), equal to gpt-oss' eager attention."""
    scale = module.scaling if scaling is None else scaling
    sinks = module.sinks if s_aux is None else s_aux
    tq, tk, d = query.shape[2], key.shape[2], query.shape[-1]
    query, key, value = _augmented(query, key, value, sinks, scale)
    causal, first = False, 0
    if attention_mask is not None:
        attention_mask = _with_sink_column(attention_mask, tk, query.dtype)
    elif tq == tk and tq > 1:  # a placeholder query first: the causal flag then shifts with the sink key
        query, causal, first = F.pad(query, (0, 0, 1, 0)), True, 1
    elif tq > 1:  # queries after a cache, no mask given: lower-right causal
        lower_right = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)
        attention_mask = _with_sink_column(lower_right, tk, query.dtype)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         dropout_p=dropout if module.training else 0.0, is_causal=causal,
                                         scale=scale, enable_gqa=key.shape[1] != query.shape[1])
    return out[:, :, first:, :d].transpose(1, 2).contiguous(), None


def _mask(*args, local_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, **kwargs):
    """Transformers' SDPA mask; a sliding window that reaches every key is dropped first, so that
    a full-length window (training rows no longer than the window) takes the unmasked causal kernel."""
    if (local_size is not None and not isinstance(q_offset, torch.Tensor)
            and q_offset + q_length - 1 - kv_offset < local_size):
        local_size = None
    return sdpa_mask(*args, local_size=local_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, **kwargs)


def register_sink_attention() -> None:
    """Register the attention and mask functions under ``"maximus_sinks"`` (idempotent)."""
    AttentionInterface.register(IMPLEMENTATION, sink_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, _mask)


def use_sink_attention(model) -> bool:
    """Switch ``model`` (or the model inside a PEFT wrapper) from Transformers' eager attention to
    this path when its model type has sinks (`SINK_MODEL_TYPES`); True when switched."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if getattr(config, "model_type", None) not in SINK_MODEL_TYPES or config._attn_implementation != "eager":
        return False
    register_sink_attention()
    base.set_attn_implementation(IMPLEMENTATION)
    return base.config._attn_implementation == IMPLEMENTATION
