"""What `training.qat` trains for: the deployed file's weight type, tensor by tensor.

A GGUF target names the `--quant` of `maximus export --format gguf | ollama`, and each tensor gets
the ggml type that export writes for it:

- ``q8_0``, ``q4_0`` (written by the `gguf` package from the float32 weights,
  `maximus.export.to_gguf`): every matrix in that type; under ``q4_0`` the untied output layer in
  ``q8_0``; a matrix whose rows do not divide into blocks of 32 in f16;
- ``q4_k_m`` (written by llama.cpp's own quantiser from an f16 file, so the weights are rounded to
  fp16 first): llama.cpp's Q4_K_M mixture (`llama_tensor_get_type` in llama-quant.cpp): Q4_K,
  with the output layer (or the token embedding when the head is tied) in Q6_K, attn_v and
  ffn_down in Q6_K on the layers `use_more_bits` picks (the first and last eighth, every third
  between), and llama.cpp's fallback for rows that do not divide into 256 (Q4_K -> Q5_0,
  Q6_K -> Q8_0, then f16).

``int4`` is not a GGUF type: torchao's symmetric int4 weights in groups of 32 on every decoder
linear, for runtimes that load torchao's int4 layouts; a GGUF export cannot hold it.
"""
from __future__ import annotations

from dataclasses import dataclass

from maximus.qat.ggml_rounding import BLOCK_SIZES

#: `training.qat` values besides ``off``.
QAT_TARGETS = ("q8_0", "q4_0", "q4_k_m", "int4")
#: Targets a GGUF file holds: the value is also the export's `--quant`.
GGUF_TARGETS = ("q8_0", "q4_0", "q4_k_m")
#: int4 group size (values per scale), as torchao's IntxFakeQuantizeConfig takes it.
INT4_GROUP_SIZE = 32


@dataclass(frozen=True)
class GGUFTensor:
    """One matrix as the GGUF file holds it: its name, its row length (columns) and its layer."""

    name: str
    columns: int
    layer: int | None


def _use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _fallback(ggml_type: str, columns: int) -> str:
    """llama.cpp's `tensor_type_fallback`: a K type whose 256-blocks do not fit the rows."""
    if columns % BLOCK_SIZES[ggml_type] == 0:
        return ggml_type
    smaller = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}.get(ggml_type, "f16")
    return smaller if columns % BLOCK_SIZES[smaller] == 0 else "f16"


def ggml_types(target: str, tensors: list[GGUFTensor], *, layers: int) -> dict[str, str]:
    """{GGUF tensor name: ggml type its fake quantizer uses} for the matrices `tensors` of a model
    with `layers` decoder layers, exported at `target` (one of GGUF_TARGETS)."""
    names = {t.name for t in tensors}
    tied = "output.weight" not in names
    types = {}
    if target in ("q8_0", "q4_0"):
        for t in tensors:
            kind = "q8_0" if target == "q4_0" and t.name == "output.weight" else target
            types[t.name] = kind if t.columns % BLOCK_SIZES[kind] == 0 else "f16"
        return types
    if target != "q4_k_m":
        raise ValueError(f"not a GGUF target: {target!r}")
    attn_v = sum(".attn_v." in t.name or ".attn_qkv." in t.name for t in tensors)
    seen_v = 0
    for t in tensors:
        kind = "q4_k"
        if t.name == "output.weight" or (tied and t.name == "token_embd.weight"):
            kind = "q8_0" if t.columns % BLOCK_SIZES["q4_k"] else "q6_k"
        elif ".attn_v." in t.name or ".attn_qkv." in t.name:
            if _use_more_bits(seen_v, attn_v):
                kind = "q6_k"
            seen_v += 1
        elif ".ffn_down" in t.name and t.layer is not None and _use_more_bits(t.layer, layers):
            kind = "q6_k"
        types[t.name] = _fallback(kind, t.columns)
    return types


def rounds_to_fp16_first(target: str) -> bool:
    """K-quant files are quantized by llama.cpp from an f16 file: the weights pass through fp16."""
    return target == "q4_k_m"
