"""Padding-free attention over packed documents: each document attends only to itself, and no
``T x T`` mask (nor the FLOPs of its masked-out part) exists.

Packed rows (``training.packing``) hold several documents, each restarting its ``position_ids``
at 0; right padding is one more such "document" (see `maximus.data.collate`). Stock Transformers
turns that into a dense ``[B, 1, T, T]`` mask for SDPA, which costs the whole ``T x T`` score
matrix in FLOPs (the kernel cannot skip the causal half once a mask is given) and ``T^2`` bytes of
mask per row. Here the row is cut at the document starts and SDPA runs once per document with
``is_causal=True``: the attention FLOPs fall from ``T^2`` to ``sum(L_i^2) / 2`` (ten 205-token
documents in a 2,048-token row: about 20x less), with the same result as the masked call.

Everything else is delegated to Transformers' own SDPA function, unchanged: a 2D padding mask
(generation), a KV cache (queries shorter than keys), or a row that holds one document.

``use_varlen_attention(model)`` switches a model whose attention goes through
`transformers.AttentionInterface` (Llama, Mistral, Qwen2, ...) to ``"maximus_varlen"``.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from maximus.structure import document_starts

IMPLEMENTATION = "maximus_varlen"

#: One SDPA call per document pays off unless the documents are both many and short: then the
#: call overhead exceeds the masked FLOPs saved, and the rows get one SDPA call with a
#: block-diagonal causal mask instead (measured on the quickstart, 128 documents of ~16 tokens
#: per micro-batch: 0.19-0.21 s per step with a call per document, 0.16 s masked).
MIN_MEAN_DOCUMENT_TOKENS = 64
MAX_SHORT_DOCUMENTS = 32


def per_document(num_documents: int, num_tokens: int) -> bool:
    """Whether attention runs one SDPA call per document (else one masked call per row)."""
    return num_documents <= MAX_SHORT_DOCUMENTS or num_tokens >= MIN_MEAN_DOCUMENT_TOKENS * num_documents


def document_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]] | None:
    """Per row, the ``[start, end)`` token spans of its packed documents; None when no row holds
    more than one (the rule of :func:`maximus.structure.document_starts`)."""
    starts = document_starts(position_ids)
    if starts is None:
        return None
    length = position_ids.shape[-1]
    spans = []
    for row in starts.tolist():  # one host sync per forward of a layer; rows are short lists
        cuts = [t for t in range(length) if row[t] == t] + [length]
        spans.append(list(zip(cuts[:-1], cuts[1:])))
    return spans


def varlen_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             position_ids=None, **kwargs):
    """Transformers attention function: query [B, H, T, D], key/value [B, Hkv, T, D] ->
    ([B, T, H, D], None); packed documents are attended one by one (causal within each)."""
    packed = (attention_mask is None and position_ids is not None and query.shape[2] == key.shape[2]
              and not kwargs.get("output_attentions", False))
    layout = _layout(position_ids, query.shape[0], query.device) if packed else None
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, position_ids=position_ids, **kwargs)
    spans, mask = layout
    if mask is not None:
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                      position_ids=position_ids, **kwargs)
    gqa = key.shape[1] != query.shape[1]
    dropout_p = dropout if module.training else 0.0
    rows = []
    for b, row_spans in enumerate(spans):
        pieces = [F.scaled_dot_product_attention(query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
                                                 dropout_p=dropout_p, is_causal=True, scale=scaling, enable_gqa=gqa)
                  for s, e in row_spans]
        rows.append(torch.cat(pieces, dim=2))
    out = torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


_LAST_LAYOUT: tuple = (None, None)  # (weakref to the position_ids tensor, its layout)


def _layout(position_ids: torch.Tensor, batch: int, device):
    """(spans, mask or None) of a forward's packed rows, or None when nothing is packed; worked
    out once per forward (every layer gets the same position_ids tensor), not once per layer."""
    global _LAST_LAYOUT
    ref, layout = _LAST_LAYOUT
    if ref is not None and ref() is position_ids and layout[0] == (batch, position_ids._version):
        return layout[1]
    spans = document_spans(position_ids.expand(batch, -1))
    result = None
    if spans is not None:
        length = position_ids.shape[-1]
        per_doc = per_document(sum(len(row) for row in spans), batch * length)
        result = (spans, None if per_doc else document_mask(spans, length, device))
    _LAST_LAYOUT = (weakref.ref(position_ids), ((batch, position_ids._version), result))
    return result


def document_mask(spans: list[list[tuple[int, int]]], length: int, device) -> torch.Tensor:
    """Boolean ``[B, 1, T, T]`` mask (True = may attend): causal within each document span."""
    doc = torch.zeros(len(spans), length, dtype=torch.long)
    for b, row in enumerate(spans):
        for i, (s, e) in enumerate(row):
            doc[b, s:e] = i
    doc = doc.to(device)
    idx = torch.arange(length, device=device)
    causal = idx[:, None] >= idx[None, :]
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def _mask(*args, attention_mask=None, **kwargs):
    """Mask interface: no mask when none was given (packing is read from position_ids inside the
    attention); Transformers' own SDPA mask otherwise."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_varlen() -> None:
    """Register the attention and mask functions under ``"maximus_varlen"`` (idempotent)."""
    AttentionInterface.register(IMPLEMENTATION, varlen_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, _mask)


def sliding_window(config) -> int | None:
    """The sliding attention window (tokens) some of the model's layers use, or None: when its
    `layer_types` name sliding layers (or it has none and sets `sliding_window`) and the window is
    shorter than the context. Padding-free attention leaves such a model on Transformers' SDPA,
    whose mask keeps the window."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return window if window < (getattr(config, "max_position_embeddings", None) or window + 1) else None


def use_varlen_attention(model) -> bool:
    """Switch ``model`` (or the model inside a PEFT wrapper) from SDPA to padding-free attention.

    Returns True when switched; False (and nothing changes) when the model does not use SDPA
    through Transformers' attention registry (eager, flash-attention or Kronecker attention,
    or an architecture without the registry), or has sliding-window layers (`sliding_window`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if not getattr(base, "_supports_attention_backend", False) or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if sliding_window(config) is not None:  # per-document causal SDPA would attend past the window
        return False
    register_varlen()
    base.set_attn_implementation(IMPLEMENTATION)
    return base.config._attn_implementation == IMPLEMENTATION
