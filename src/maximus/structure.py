"""Where things are inside a model and a batch: the bottom layer every other module may import.

`IGNORE_INDEX` is the label of a token without loss, `causal_lm_of` / `peft_model_of` see through the wrappers (PEFT, DDP, `torch.compile`),
`find_decoder_layers` finds the decoder stack and its layer list, `compute_device` names the device
a model computes on (looking past a table kept in host memory), `row_lengths` reads the
real length of each right-padded row from its position ids, and `document_resets` says where a
packed document starts in them (`document_starts` for the attention, `documents_in` for a row). This module imports nothing of
Maximus but its errors, so that memory/, kernels/, train/ and losses/ can share it without
importing one another.
"""
from __future__ import annotations

import torch
from torch import nn

from maximus.errors import ModelError

IGNORE_INDEX = -100
"""Label of a token without loss (the ignore_index of torch / Transformers cross-entropy)."""

HOST_KEPT = "_maximus_host_kept"
"""Set (True) on a module whose parameters stay in host memory while the model computes on another
device: the input embedding under streamed weights (`maximus.memory.host_embedding`)."""


def causal_lm_of(model):
    """The Transformers `*ForCausalLM` inside a PEFT / DDP / compile wrapper."""
    m = model
    for attr in ("module", "_orig_mod"):
        m = getattr(m, attr, m)
    if hasattr(m, "get_base_model"):
        m = m.get_base_model()
    return m


def peft_model_of(model):
    """The PEFT model inside a DDP / compile wrapper (the one with `disable_adapter()`), or None
    when the model has no adapter (full fine-tuning)."""
    m = model
    for attr in ("module", "_orig_mod"):
        m = getattr(m, attr, m)
    return m if hasattr(m, "disable_adapter") and hasattr(m, "peft_config") else None


def find_decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The decoder stack (e.g. `LlamaModel`) and its list of decoder layers, through any PEFT wrapper.

    The stack is the module owning a `layers` ModuleList next to an `embed_tokens` embedding;
    raises `ModelError` when the model has none (not a decoder-only language model)."""
    for _, module in model.named_modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0 and hasattr(module, "embed_tokens"):
            return module, layers
    raise ModelError(
        f"gradient checkpointing: no decoder layer list found in {type(model).__name__}",
        "Maximus checkpoints decoder-only models whose stack has `embed_tokens` and `layers` "
        "(Llama, Mistral, Qwen2, ...); set optimization.gradient_checkpointing: none for others",
    )


def compute_device(model: nn.Module) -> torch.device:
    """The device `model` computes on, where its inputs belong: the first parameter's, in module
    order, looking past modules marked `HOST_KEPT` (Transformers' ``model.device`` and
    ``next(model.parameters()).device`` read the first parameter, which is the input embedding's:
    in host memory under streamed weights). CPU for a model without parameters."""
    stack = [model]
    while stack:
        module = stack.pop()
        if getattr(module, HOST_KEPT, False):
            continue
        for p in module.parameters(recurse=False):
            return p.device
        stack.extend(reversed(list(module.children())))
    return torch.device("cpu")


def document_resets(position_ids: torch.Tensor) -> torch.Tensor:
    """Whether each token but the first starts a packed document, [..., T - 1] bool: its position
    is not the previous one's plus one (`maximus.data.packing` restarts them at 0 at every
    document), the rule of `transformers.masking_utils.find_packed_sequence_indices`."""
    return position_ids[..., 1:] != position_ids[..., :-1] + 1


def document_starts(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Start index of each token's packed document, [B, T] long; None when nothing is packed
    (a document starts at index 0 and at every `document_resets`)."""
    resets = document_resets(position_ids)
    if not resets.any():
        return None
    idx = torch.arange(position_ids.shape[-1], device=position_ids.device).expand_as(position_ids)
    starts = torch.cat([torch.ones_like(resets[..., :1]), resets], dim=-1)
    return torch.where(starts, idx, torch.zeros_like(idx)).cummax(-1).values


def documents_in(position_ids) -> int:
    """Documents packed in one row, from its position ids (a list or a 1-D tensor; none: 1)."""
    if position_ids is None or len(position_ids) == 0:
        return 1
    return 1 + int(document_resets(torch.as_tensor(position_ids)).sum())


def row_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """Real (unpadded) length of each right-padded row [R]: padding restarts positions at 0."""
    restart = position_ids[:, 1:] == 0
    first = torch.where(restart.any(dim=1), restart.float().argmax(dim=1) + 1,
                        torch.full_like(restart[:, 0], position_ids.shape[1], dtype=torch.long))
    return first.long()
