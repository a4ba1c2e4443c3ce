"""A merged Llama / Mistral / Qwen2 model as one GGUF file for llama.cpp, Ollama and LM Studio.

The file format and the quantisers are the `gguf` package's (llama.cpp's own Python writer); this
module decides only what goes in, as llama.cpp's loader expects it per family:

- tensor names from the package's HF -> GGUF map (`gguf.get_tensor_name_map`);
- Llama and Mistral load as llama.cpp's `llama` architecture, whose RoPE rotates adjacent pairs
  (GPT-J style) where Hugging Face rotates halves: their Q and K rows are permuted per head so
  both compute the same attention (`permute_for_llama_rope`). Qwen2 (`qwen2`, NeoX RoPE) is not;
- a tied head is written once (token_embd); llama.cpp reuses it as the output layer;
- hyperparameters: context length, widths, GQA heads, head size, RMSNorm eps, RoPE theta and
  scaling (linear, or Llama-3's per-frequency factors as the `rope_freqs` tensor);
- quantisation (`--quant`): norms and biases stay f32 (llama.cpp's rule); a matrix whose rows do
  not divide into the quant's blocks falls back to f16; under a 4- or 5-bit quant the output
  layer is q8_0, as llama.cpp's own quantiser keeps it at higher precision (6-bit there).
  K-quants (q4_k_m ...) are not in the package: with llama-cpp-python installed they are made by
  llama.cpp's own quantiser from an f16 file written first; without it they are refused by name.

A Mistral `sliding_window` shorter than the context is not representable in the `llama` architecture:
the export notes it, and llama.cpp attends over the whole context.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from maximus.errors import ExportError
from maximus.export.gguf_vocab import write_vocab
from maximus.export.target import GGUF_MARKER_KEY

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")
# --quant name -> (tensor type, file type) in the gguf package; these are the types it can quantise to.
QUANTS = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"),
          "q8_0": ("Q8_0", "MOSTLY_Q8_0"), "q5_1": ("Q5_1", "MOSTLY_Q5_1"), "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
          "q4_1": ("Q4_1", "MOSTLY_Q4_1"), "q4_0": ("Q4_0", "MOSTLY_Q4_0")}
_LOW_BIT = {"q5_1", "q5_0", "q4_1", "q4_0"}


# K-quants: the gguf package has only their dequantisers, so these go through llama.cpp's own C
# quantiser (llama_model_quantize, from llama-cpp-python) applied to an f16 file we wrote.
K_QUANTS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")


def _llama_cpp():
    try:
        import llama_cpp

        return llama_cpp
    except ImportError:
        return None


def check_quant(quant: str) -> None:
    """Raise ExportError naming the supported quant types unless `quant` is one of them."""
    if quant in QUANTS:
        return
    if quant in K_QUANTS:
        if _llama_cpp() is None:
            raise ExportError(f"--quant {quant} needs llama.cpp's own quantiser (llama-cpp-python), which is not "
                              f"installed; the gguf package alone writes: {', '.join(QUANTS)}",
                              "pip install 'maximusllm[llamacpp]', or pick one of those")
        return
    raise ExportError(f"--quant {quant} is not supported (the gguf package writes: {', '.join(QUANTS)}; "
                      f"with llama-cpp-python installed, llama.cpp's quantiser adds: {', '.join(K_QUANTS)})",
                      "pick one of those")


def quantize_with_llama_cpp(f16_path: Path, out: Path, quant: str, threads: int = 0) -> None:
    """llama.cpp's llama_model_quantize on an f16 GGUF (metadata, marker included, is copied)."""
    llama_cpp = _llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}")
    params.nthread = threads
    code = llama_cpp.llama_model_quantize(str(f16_path).encode(), str(out).encode(), params)
    if code != 0:
        raise RuntimeError(f"llama_model_quantize({quant}) failed with code {code}")


def check_architecture(config) -> str:
    """The llama.cpp architecture name for a HF config; ExportError for anything else."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "vision_config", None) is not None:
        raise ExportError(f"model type {model_type!r} is a vision-language model: its GGUF needs llama.cpp's separate "
                          "mmproj file for the vision tower, which the gguf package does not write",
                          "export --format merged (or the adapter) and convert with llama.cpp's own tools")
    if model_type not in SUPPORTED_ARCHS:
        raise ExportError(f"model type {model_type!r} has no GGUF export",
                          f"supported: {', '.join(SUPPORTED_ARCHS)}; --format merged works for any model")
    return "qwen2" if model_type == "qwen2" else "llama"


def permute_for_llama_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's half-split RoPE layout -> llama.cpp's interleaved pairs, per head, along the output rows."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _rope(config) -> tuple[float, dict]:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    return theta, params


def llama3_rope_factors(config, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama-3 RoPE scaling (what llama.cpp reads from `rope_freqs`)."""
    theta, p = _rope(config)
    factor, low, high = float(p["factor"]), float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old_ctx = float(p["original_max_position_embeddings"])
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    out = np.where(wavelen < old_ctx / high, 1.0,
                   np.where(wavelen > old_ctx / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def _write_hparams(writer, config, arch: str, head_dim: int, notices: list[str]) -> np.ndarray | None:
    import gguf

    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    context = int(config.max_position_embeddings)
    writer.add_context_length(context)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(head_dim)
    if head_dim * heads != config.hidden_size:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    theta, rope = _rope(config)
    writer.add_rope_freq_base(theta)
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    factors = None
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "llama3":
        factors = llama3_rope_factors(config, head_dim)
    elif kind != "default":
        raise ExportError(f"RoPE scaling {kind!r} has no GGUF export yet", "supported: default, linear, llama3")
    window = getattr(config, "sliding_window", None)
    if getattr(config, "model_type", "") == "qwen2" and not getattr(config, "use_sliding_window", False):
        window = None
    if window is not None and window < context:
        notices.append(f"sliding_window={window} is not representable in llama.cpp's {arch} architecture: "
                       f"it attends over all {context} positions (identical up to {window} tokens)")
    return factors


def _tensor_type(name: str, array: np.ndarray, quant: str):
    import gguf

    if array.ndim == 1 or quant == "f32":
        return gguf.GGMLQuantizationType.F32
    qname = "Q8_0" if quant in _LOW_BIT and name in ("output.weight",) else QUANTS[quant][0]
    qtype = gguf.GGMLQuantizationType[qname]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if array.shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return qtype


def write_gguf(model, tokenizer, path: str | Path, *, quant: str = "f16", name: str | None = None,
               source: dict | None = None, progress=None) -> list[str]:
    """Write `model` (a merged Hugging Face Llama / Mistral / Qwen2 causal LM) and `tokenizer` to
    the GGUF file `path`, then read it back (`check_written`). Returns notices (what the file
    cannot express) for the user to read. `progress` hears "tensors" (n of N), "writing",
    "quantizing" and "checking" (`maximus.export.progress.ExportProgress`).

    Raises ExportError for an unsupported architecture, RoPE scaling, tokenizer or quant type."""
    import gguf

    check_quant(quant)
    progress = progress or (lambda *a: None)
    if quant in K_QUANTS:
        f16 = Path(path).with_name(Path(path).name + ".f16.tmp")
        try:
            notices = write_gguf(model, tokenizer, f16, quant="f16", name=name, source={**(source or {}), "quant": quant},
                                 progress=progress)
            progress("quantizing")
            quantize_with_llama_cpp(f16, Path(path), quant)
            progress("checking")
            check_written(Path(path), len(gguf.GGUFReader(str(f16)).tensors))
        finally:
            f16.unlink(missing_ok=True)
        return notices
    config = model.config
    arch = check_architecture(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    notices: list[str] = []
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    vocab_rows = state["model.embed_tokens.weight"].shape[0]
    tied = bool(getattr(config, "tie_word_embeddings", False)) or (
        "lm_head.weight" in state and state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr())

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name or Path(getattr(config, "_name_or_path", "") or "model").name)
    writer.add_string(GGUF_MARKER_KEY, json.dumps({"quant": quant, **(source or {})}))
    writer.add_file_type(int(gguf.LlamaFileType[QUANTS[quant][1]]))
    if quant not in ("f32", "f16", "bf16"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    factors = _write_hparams(writer, config, arch, head_dim, notices)
    write_vocab(writer, tokenizer, config, vocab_rows)
    writer.add_vocab_size(vocab_rows)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2 if arch == "qwen2" else gguf.MODEL_ARCH.LLAMA,
                                     config.num_hidden_layers)
    written = [hf for hf in state if not (hf == "lm_head.weight" and tied)]
    total = len(written) + (factors is not None)
    progress("tensors", 0, total)
    if factors is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)
    for done, hf_name in enumerate(written, start=1 + (factors is not None)):
        tensor = state[hf_name]
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ExportError(f"tensor {hf_name!r} has no place in llama.cpp's {arch} architecture",
                              "was the model changed (e.g. Kronecker sketching)? --format merged keeps it as is")
        tensor = tensor.detach().to(torch.float32)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = permute_for_llama_rope(tensor, heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = permute_for_llama_rope(tensor, kv_heads)
        array = tensor.cpu().numpy()
        qtype = _tensor_type(gguf_name, array, quant)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        progress("tensors", done, total)
    progress("writing")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    progress("checking")
    check_written(Path(path), total)
    return notices


def check_written(path: Path, tensors: int) -> None:
    """Read the GGUF file back: it must carry our marker and `tensors` tensors (a file llama.cpp
    would refuse is caught here, before it replaces anything)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    if GGUF_MARKER_KEY not in reader.fields or len(reader.tensors) != tensors:
        raise RuntimeError(f"the GGUF file written holds {len(reader.tensors)} tensors, expected {tensors}")


def is_maximus_gguf(path: Path) -> bool:
    """True for a GGUF file a Maximus export wrote (its metadata carries GGUF_MARKER_KEY)."""
    try:
        import gguf

        return GGUF_MARKER_KEY in gguf.GGUFReader(str(path)).fields
    except Exception:  # not a GGUF file at all (or a truncated one): not ours
        return False
