"""Where things are inside a model and a batch: the bottom layer every other module may import.

`IGNORE_INDEX` is the label of a token without loss, `causal_lm_of` / `peft_model_of` see through the wrappers (PEFT, DDP, `torch.compile`),
`find_decoder_layers` finds the decoder stack and its layer list, and `row_lengths` reads the
real length of each right-padded row from its position ids. This module imports nothing of
Maximus but its errors, so that memory/, kernels/, train/ and losses/ can share it without
importing one another.
"""
from __future__ import annotations

import torch
from torch import nn

from maximus.errors import ModelError

IGNORE_INDEX = -100
"""Label of a token without loss (the ignore_index of torch / Transformers cross-entropy)."""


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
        "(Llama, Mistral, Qwen2, ...); set optimization.gradient_checkpointing: off for others",
    )


def row_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """Real (unpadded) length of each right-padded row [R]: padding restarts positions at 0."""
    restart = position_ids[:, 1:] == 0
    first = torch.where(restart.any(dim=1), restart.float().argmax(dim=1) + 1,
                        torch.full_like(restart[:, 0], position_ids.shape[1], dtype=torch.long))
    return first.long()
