"""Install Kronecker Sketching attention into a Transformers model through its attention registry.

`install_kronecker(model, settings)` attaches a `KroneckerSketch` at `<attention>.kronecker` of every
attention layer and switches `config._attn_implementation` to ``"maximus_kronecker"``, a function
registered in `transformers.AttentionInterface`. A matching entry in `AttentionMaskInterface` makes
Transformers hand us the 2D padding mask (never an N x N mask), and packed documents are read from
`position_ids` exactly as Transformers does (a new document wherever positions do not step by 1,
only when no 2D mask is given and the queries are the whole sequence).
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from maximus.attention.sketch_module import KroneckerSketch
from maximus.config import KroneckerConfig
from maximus.errors import ModelError
from maximus.structure import document_starts

IMPLEMENTATION = "maximus_kronecker"


def _padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """Mask interface: the 2D key-validity mask [B, kv_length] (bool) or None. Causality, packing
    and windows are applied inside the attention at O(N * K) cost, never as an N x N tensor."""
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)
    if (missing := kv_offset + kv_length - mask.shape[-1]) > 0:
        mask = torch.nn.functional.pad(mask, (0, missing))
    return mask[:, kv_offset:kv_offset + kv_length]


def kronecker_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                sliding_window=None, position_ids=None, **kwargs):
    """Transformers attention function: query [B, H, Tq, D], key/value [B, Hkv, Tk, D] ->
    ([B, Tq, H, D], None). Attention weights are never materialised, so none are returned."""
    sketch = getattr(module, "kronecker", None)
    if sketch is None:
        raise ModelError(f"{type(module).__name__} has no Kronecker sketch attached",
                         "call maximus.attention.install_kronecker(model, settings) on this model")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ModelError("Kronecker Sketching attention takes a 2D padding mask, not a prepared 4D mask",
                         "pass attention_mask as [batch, tokens] of 0/1, or position_ids for packed documents")
    doc_start = None
    if attention_mask is None and position_ids is not None and query.shape[2] == key.shape[2]:
        doc_start = document_starts(position_ids.expand(query.shape[0], -1))
    out = sketch(query, key, value, scaling=module.scaling if scaling is None else scaling,
                 key_valid=attention_mask, doc_start=doc_start, sliding_window=sliding_window,
                 dropout_p=dropout if module.training else 0.0)
    return out.transpose(1, 2).contiguous(), None


def register_kronecker() -> None:
    """Register the attention and mask functions under ``"maximus_kronecker"`` (idempotent)."""
    AttentionInterface.register(IMPLEMENTATION, kronecker_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, _padding_mask)


def _attention_layers(model):
    """(name, module) of every attention layer that uses the Transformers attention interface."""
    for name, module in model.named_modules():
        if all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "head_dim", "layer_idx", "scaling")):
            yield name, module


def install_kronecker(model, settings: KroneckerConfig | bool | None = None):
    """Attach a `KroneckerSketch` to every attention layer and switch attention to it; returns model.

    Works for models whose attention goes through `transformers.AttentionInterface` (Llama,
    Mistral, Qwen2 and the many that share their attention). Sequences of at most
    `detail_tokens // block * block` tokens are attended exactly, so a fresh install reproduces
    the base model. Installing again with settings of the same layout keeps the existing (perhaps
    trained) sketches; other settings are an error, since replacing them would drop what they learned.

    Raises:
        ModelError: the model does not route attention through Transformers' registry, or it
            already carries sketches of another layout.
        ConfigError: settings with detail_tokens < block.
    """
    if settings is None or settings is True:
        settings = KroneckerConfig()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = list(_attention_layers(base))
    if not getattr(base, "_supports_attention_backend", False) or not layers:
        raise ModelError(f"{type(base).__name__} does not route attention through Transformers' attention registry",
                         "use a Llama, Mistral or Qwen2-family model, or turn off optimization.kronecker_sketching")
    register_kronecker()
    for name, attn in layers:
        fresh = KroneckerSketch(attn.head_dim, settings)
        if "kronecker" in attn._modules:
            existing = attn.kronecker
            existing = getattr(existing, "original_module", existing)  # inside a PEFT ModulesToSaveWrapper
            if existing.layout != fresh.layout:
                raise ModelError(f"{name}.kronecker is already installed with another layout ({existing.extra_repr()}) "
                                 f"than these settings give ({fresh.extra_repr()})",
                                 "install on a fresh model, or pass the settings it was installed with")
            continue
        attn.kronecker = fresh.to(attn.q_proj.weight.device)
    base.set_attn_implementation(IMPLEMENTATION)
    if base.config._attn_implementation != IMPLEMENTATION:  # defensive: set_attn_implementation only warns
        raise ModelError(f"{type(base).__name__} refused the attention implementation {IMPLEMENTATION!r}",
                         "turn off optimization.kronecker_sketching for this model")
    return model


def kronecker_module_names(model) -> list[str]:
    """Qualified names of the `KroneckerSketch` modules, for PEFT ``modules_to_save``.

    Called on a PEFT model, the wrapper's own path is returned (not its inner copies)."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, KroneckerSketch):
            for marker in (".modules_to_save.", ".original_module"):
                if marker in name:
                    name = name.split(marker)[0]
            if name not in names:
                names.append(name)
    return names
