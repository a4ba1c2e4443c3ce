"""What LoRA's options add to a step: `lora.modules_to_save`, DoRA and LoRA dropout.

Each takes PEFT's own code path, measured with the CPU meter on real trainer steps
(tests/memory/test_adapter_terms.py, docs/planner.md):

* ``modules_to_save``: PEFT's `ModulesToSaveWrapper` keeps the frozen original and trains a full
  copy (float32: the trainer trains every trainable parameter in float32), so the copy, its
  gradient and its optimizer moments join the static part. A trained head makes the loss's head
  trainable (its float32 weight-gradient accumulator, a larger chunk floor, and in 16-bit a cast
  of the float32 copy per call); a trained embedding adds the float32 gradient of its output.
* DoRA: a float32 magnitude vector per targeted linear (trainable), and per token two saved
  tensors of each target's output width (the base result and the LoRA result that the
  magnitude scale multiplies).
* LoRA dropout: each targeted linear keeps its dropout mask (one byte per input element) and,
  in float32, the dropped input its down-projection saves.

A lean LoRA projection (`maximus.kernels.lean_lora`) never runs with DoRA or dropout: those fall
back to PEFT's forward (`maximus.memory.spec_from_config.lean_lora_applies`), whose coefficients these add to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from maximus.memory.coefficients import DORA_OUT_BYTES, DROPOUT_IN_BYTES

__all__ = ["AdapterTerms", "adapter_terms", "EMBEDDING_NAMES", "HEAD_NAMES"]

#: Module names (the last part of a dotted path) of the input embedding and the output head.
EMBEDDING_NAMES = frozenset({"embed_tokens", "wte", "embed_in", "word_embeddings", "tok_embeddings"})
HEAD_NAMES = frozenset({"lm_head", "embed_out", "output"})
_LAYER_NORMS = frozenset({"input_layernorm", "post_attention_layernorm"})
_FINAL_NORMS = frozenset({"norm", "ln_f", "final_layernorm"})



@dataclass(frozen=True)
class AdapterTerms:
    """The adapter options' bytes, each in the estimate's vocabulary."""

    #: Trainable float32 parameters beyond the LoRA matrices (modules_to_save copies, DoRA magnitudes).
    trainable_params: int = 0
    #: Saved bytes per token of one decoder layer (DoRA's results, dropout's masks and inputs).
    layer_bytes_per_token: float = 0.0
    #: Saved bytes per token outside the layers (a trained embedding's float32 output gradient).
    stream_bytes_per_token: float = 0.0
    trains_head: bool = False
    trains_embedding: bool = False
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"trainable_params": self.trainable_params, "trains_head": self.trains_head,
                "trains_embedding": self.trains_embedding}


def _base_name(name: str) -> str:
    return str(name).rsplit(".", 1)[-1]


def adapter_terms(shape: Any, targets: Sequence[str], dtype_bytes: int, *, modules_to_save: Sequence[str] = (),
                  use_dora: bool = False, lora_dropout: float = 0.0) -> AdapterTerms:
    """The `AdapterTerms` of an adapter on `targets` (linear names of one decoder layer) of `shape`
    (`maximus.memory.estimate.ModelShape`) in steps of `dtype_bytes`."""
    lin = shape.linear_shapes()
    L, h = shape.num_layers, shape.hidden_size
    width = 4 if dtype_bytes >= 4 else 2
    params, notes = 0, []
    names = {_base_name(n) for n in modules_to_save or ()}
    trains_head = bool(names & HEAD_NAMES)
    trains_embedding = bool(names & EMBEDDING_NAMES)
    for name in sorted(names):
        if name in EMBEDDING_NAMES:
            params += shape.embedding_params
        elif name in HEAD_NAMES:
            params += shape.vocab_size * h  # PEFT trains an own copy, tied or not
        elif name in lin:
            params += L * lin[name][0] * lin[name][1]
        elif name in _LAYER_NORMS:
            params += L * h
        elif name in _FINAL_NORMS:
            params += h
        else:
            notes.append(f"lora.modules_to_save {name!r}: not a module the estimator knows, its copy is not counted")
    per_token = 0.0
    if use_dora:
        params += L * sum(lin[t][1] for t in targets)  # one magnitude per output feature
        per_token += DORA_OUT_BYTES[width] * sum(lin[t][1] for t in targets)
    if lora_dropout:
        per_token += DROPOUT_IN_BYTES[width] * sum(lin[t][0] for t in targets)
    return AdapterTerms(trainable_params=params, layer_bytes_per_token=per_token,
                        stream_bytes_per_token=4 * h if trains_embedding else 0.0, trains_head=trains_head,
                        trains_embedding=trains_embedding, notes=tuple(notes))
