"""A merged model as one GGUF file for llama.cpp, Ollama and LM Studio.

The file format and the quantisers are the `gguf` package's (llama.cpp's own Python writer); this
module decides only what goes in:

- the architecture, its hyperparameters and its tensors per family (`maximus.export.gguf_arch`:
  Llama, Mistral, Mixtral, Granite, Qwen2, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3, Phi-3, OLMo 2,
  gpt-oss), tensor names from the package's HF -> GGUF map (`gguf.get_tensor_name_map`);
- the tokenizer (`maximus.export.gguf_vocab`);
- a tied head is written once (token_embd); llama.cpp reuses it as the output layer;
- quantisation (`--quant`): norms, biases and routers stay f32 (llama.cpp's rule); a matrix whose rows do
  not divide into the quant's blocks falls back to f16; under a 4- or 5-bit quant the output
  layer is q8_0, as llama.cpp's own quantiser keeps it at higher precision (6-bit there).
  K-quants (q4_k_m ...) are not in the package: with llama-cpp-python installed they are made by
  llama.cpp's own quantiser from an f16 file written first; without it they are refused by name.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from maximus.errors import ExportError
from maximus.export.gguf_arch import gguf_arch, gguf_tensors, write_hparams
from maximus.export.gguf_vocab import write_vocab
from maximus.export.target import GGUF_MARKER_KEY

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
    """The llama.cpp architecture name for a HF config; ExportError naming the family for anything
    llama.cpp or the installed gguf package cannot take (`maximus.export.gguf_arch`)."""
    import gguf

    return gguf.MODEL_ARCH_NAMES[gguf_arch(config)[1]]


def _tensor_type(name: str, array: np.ndarray, quant: str):
    import gguf

    # llama.cpp's own rule: biases (experts' are 2-D), norms and the router stay f32
    if array.ndim == 1 or quant == "f32" or not name.endswith(".weight") or "ffn_gate_inp" in name:
        return gguf.GGMLQuantizationType.F32
    qname = "Q8_0" if quant in _LOW_BIT and name in ("output.weight",) else QUANTS[quant][0]
    qtype = gguf.GGMLQuantizationType[qname]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if array.shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return qtype


def write_gguf(model, tokenizer, path: str | Path, *, quant: str = "f16", name: str | None = None,
               source: dict | None = None, progress=None) -> list[str]:
    """Write `model` (a merged Hugging Face causal LM of a family in `GGUF_ARCHS`) and `tokenizer`
    to the GGUF file `path`, then read it back (`check_written`). Returns notices (what the file
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
    spec, arch = gguf_arch(config)
    notices: list[str] = []
    vocab_rows = model.get_input_embeddings().weight.shape[0]

    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name or Path(getattr(config, "_name_or_path", "") or "model").name)
    writer.add_string(GGUF_MARKER_KEY, json.dumps({"quant": quant, **(source or {})}))
    writer.add_file_type(int(gguf.LlamaFileType[QUANTS[quant][1]]))
    if quant not in ("f32", "f16", "bf16"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    factors = write_hparams(writer, config, spec, notices)
    write_vocab(writer, tokenizer, config, vocab_rows)
    writer.add_vocab_size(vocab_rows)
    tensors = list(gguf_tensors(model, spec, arch))
    total = len(tensors) + (factors is not None)
    progress("tensors", 0, total)
    if factors is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)
    for done, (gguf_name, array) in enumerate(tensors, start=1 + (factors is not None)):
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
