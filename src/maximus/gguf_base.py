"""A GGUF file as the base model (`model: path/to/model.gguf`), as Ollama and LM Studio keep them.

Transformers loads it (`from_pretrained(directory, gguf_file=name)`): the config is read from the
file's metadata, every tensor is dequantized to the training dtype, and the tokenizer is rebuilt
from the vocabulary stored in the same file. The run then trains as usual: the weights are plain
dense tensors, so the planner counts them at the training dtype, not at the file's quantized size.

Checked before the minutes of dequantizing start, each a one-line `ModelError`:

- the file exists and is a GGUF file;
- its architecture is one Transformers' GGUF loader knows;
- every tensor's quantization type can be dequantized by the `gguf` package (which Transformers
  calls); a type it cannot (``Q8_K``, integer or ``F64`` tensors, ...) is named.
"""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from maximus.errors import ModelError

__all__ = ["is_gguf", "gguf_location", "check_gguf", "gguf_config", "metadata_read_once", "shared_tensor_name_maps"]


def is_gguf(model: str | Path) -> bool:
    """Whether `model:` names a GGUF file (by its suffix, as every GGUF tool does)."""
    return str(model).lower().endswith(".gguf")


def gguf_location(model: str | Path) -> tuple[str, str]:
    """(directory, file name): how Transformers' `from_pretrained(..., gguf_file=...)` takes it."""
    path = Path(model).expanduser()
    return str(path.parent), path.name


@functools.lru_cache(maxsize=8)
def _dequantizable(type_id: int) -> bool:
    """Whether the `gguf` package (Transformers' dequantizer) can dequantize this tensor type: one
    zero block of it is tried."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    qtype = GGMLQuantizationType(type_id)
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def check_gguf(model: str | Path) -> None:
    """Raise a one-line ModelError unless `model` is a GGUF file Transformers can load and dequantize
    (a file that passed is not read again until it changes)."""
    path = Path(model).expanduser()
    if not path.is_file():
        raise ModelError(f"model not found: {model}", "give the path of an existing .gguf file")
    _check(str(model), str(path.resolve()), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _check(model: str, path: str, mtime_ns: int) -> None:
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ModelError(f"model {model} is not a readable GGUF file: {str(exc).splitlines()[0]}",
                         "give a .gguf file written by llama.cpp, Ollama, LM Studio or maximus export") from None
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode("utf-8") if field is not None else "unknown"
    # Transformers' own renames of llama.cpp architecture names (modeling_gguf_pytorch_utils).
    renamed = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}.get(arch, arch)
    if arch not in GGUF_SUPPORTED_ARCHITECTURES and renamed not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelError(f"model {model}: GGUF architecture '{arch}' is not one Transformers can load from GGUF",
                         f"Transformers' GGUF loader knows: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}; "
                         "use the model's Hugging Face checkpoint instead")
    refused: dict[str, list[str]] = {}
    for tensor in reader.tensors:
        if not _dequantizable(int(tensor.tensor_type)):
            refused.setdefault(tensor.tensor_type.name, []).append(tensor.name)
    if refused:
        kinds = ", ".join(f"{kind} ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''})"
                          for kind, names in refused.items())
        raise ModelError(f"model {model} holds tensors of quantization type {kinds}, which Transformers cannot dequantize",
                         "re-quantize it with llama.cpp to a type such as Q8_0, Q4_K_M or F16, "
                         "or use the model's Hugging Face checkpoint")


@functools.lru_cache(maxsize=4)
def _config_of(path: str, mtime_ns: int, trust_remote_code: bool):
    from transformers import AutoConfig

    directory, name = gguf_location(path)
    with metadata_read_once():
        return AutoConfig.from_pretrained(directory, gguf_file=name, trust_remote_code=trust_remote_code)


def gguf_config(model: str | Path, trust_remote_code: bool = False):
    """The Transformers config stored in a GGUF file's metadata (read once per file: parsing the
    metadata of a real model takes seconds)."""
    import copy

    check_gguf(model)
    path = Path(model).expanduser().resolve()
    return copy.deepcopy(_config_of(str(path), path.stat().st_mtime_ns, trust_remote_code))


@contextlib.contextmanager
def shared_tensor_name_maps():
    """While Transformers loads a GGUF file, build the `gguf` package's name map of an architecture
    once instead of once per submodule (Transformers walks the model and asks for it at every
    module: 397 times, 12 of 38 s for SmolLM2-135M on a loaded 2-core machine). The maps are
    read-only lookup tables, so sharing one is the same result."""
    import gguf

    original = getattr(gguf, "get_tensor_name_map", None)
    if original is None:
        yield
        return
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


@functools.lru_cache(maxsize=2)
def _metadata(path: str, mtime_ns: int) -> dict:
    """Transformers' parse of a GGUF file's metadata (`load_gguf_checkpoint` without tensors): the
    config, and the tokenizer with every token and merge of the vocabulary."""
    return _read_checkpoint(path, return_tensors=False)


_read_checkpoint = None  # Transformers' own load_gguf_checkpoint while `metadata_read_once` is in force


@contextlib.contextmanager
def metadata_read_once():
    """While Transformers loads a config, tokenizer or model from a GGUF file, parse the file's
    metadata once per file instead of once per caller: the config, the tokenizer and the model
    loader each call `load_gguf_checkpoint`, and each call reads the whole vocabulary (49,152
    tokens and as many merges for SmolLM2-135M). A caller gets its own copy, as from a fresh parse;
    a call that reads tensors goes to Transformers as it is. Nested uses share the outer one."""
    global _read_checkpoint
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    if _read_checkpoint is not None:
        yield
        return
    import copy

    original = gguf_utils.load_gguf_checkpoint

    def load_gguf_checkpoint(gguf_checkpoint_path, return_tensors=False, model_to_load=None, torch_dtype=None):
        if return_tensors or model_to_load is not None:
            return original(gguf_checkpoint_path, return_tensors, model_to_load, torch_dtype)
        path = Path(gguf_checkpoint_path).resolve()
        return copy.deepcopy(_metadata(str(path), path.stat().st_mtime_ns))

    _read_checkpoint = original
    gguf_utils.load_gguf_checkpoint = load_gguf_checkpoint
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = original
        _read_checkpoint = None
