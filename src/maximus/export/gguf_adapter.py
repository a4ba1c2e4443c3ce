"""A LoRA adapter as llama.cpp's own LoRA file, to serve beside a quantized base.

`maximus export RUN --format gguf-lora --out DIR` writes `DIR/model.gguf` (the base model alone,
quantized at `--quant` like `--format gguf`) and `DIR/adapter.gguf`, which llama.cpp applies at
load time (`llama-cli -m DIR/model.gguf --lora DIR/adapter.gguf`; llama-cpp-python's `lora_path`):
each adapted matrix computes `x Q(W)^T + x (s B A)^T`, the base rounded, the adapter in float32
(or f16, `--adapter-dtype`). That is the forward a `training.qat_adapter: separate` run trains against.

The adapter file is what llama.cpp's `convert_lora_to_gguf.py` writes: `general.type` ``adapter``,
`adapter.type` ``lora``, and per adapted matrix `<base tensor>.lora_a` (rank x columns) and
`<base tensor>.lora_b` (rows x rank), named and row-ordered as the base file's tensor (Q and K rows
permuted for llama.cpp's RoPE where the family needs it). llama.cpp scales B A by
`adapter.lora.alpha / rank`; here each layer's own PEFT scaling (alpha / r, rsLoRA's alpha / sqrt(r),
a rank or alpha pattern) is folded into its B and alpha is written as 0, which llama.cpp reads as a
scale of 1, so every layer keeps its exact scaling.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from maximus.errors import ExportError
from maximus.export.gguf_arch import gguf_arch, permute_for_llama_rope

ADAPTER_FILE = "adapter.gguf"
BASE_FILE = "model.gguf"


def _is_lora_layer(module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "lora_B") and hasattr(module, "get_base_layer")


def lora_tensors(peft_model, correction: dict | None = None) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(base tensor's GGUF name, A (rank x columns), B x scaling (rows x rank)) of every LoRA layer of
    `peft_model` (a PEFT model with one active adapter), float32, in the model's order. A layer with
    a `correction` ({path in the causal LM: (L, R)}, `maximus.qat.correction`) gets [A; R] and
    [s B, L]: one LoRA of both ranks, whose product is s B A + L R.

    Raises ExportError for what a llama.cpp LoRA file cannot hold: DoRA, fully trained modules
    (modules_to_save), an adapted embedding, a matrix with no place in the architecture."""
    import gguf

    config = peft_model.config
    spec, arch = gguf_arch(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    peft_config = next(iter(peft_model.peft_config.values()))
    if getattr(peft_config, "use_dora", False):
        raise ExportError("--format gguf-lora cannot hold a DoRA adapter (llama.cpp applies plain LoRA only)",
                          "use --format gguf (merged)")
    if getattr(peft_config, "modules_to_save", None):
        raise ExportError(f"--format gguf-lora cannot hold fully trained modules (lora.modules_to_save: "
                          f"{list(peft_config.modules_to_save)}): a llama.cpp LoRA file holds only A and B",
                          "use --format gguf (merged)")
    prefix = "base_model.model."
    for path, module in peft_model.named_modules():
        if not _is_lora_layer(module):
            continue
        adapters = [n for n in module.active_adapters if n in module.lora_A]
        if not adapters:
            continue
        if len(adapters) > 1:
            raise ExportError(f"{path} has {len(adapters)} active adapters; --format gguf-lora writes one",
                              "merge them first or export with --format gguf")
        if not isinstance(module.get_base_layer(), torch.nn.Linear):
            raise ExportError(f"--format gguf-lora holds adapters on linear layers only, and {path} is a "
                              f"{type(module.get_base_layer()).__name__}", "use --format gguf (merged)")
        name = adapters[0]
        hf_name = path[len(prefix):] if path.startswith(prefix) else path
        gguf_name = names.get_name(hf_name + ".weight", try_suffixes=(".weight",))
        if gguf_name is None:
            raise ExportError(f"the adapted matrix {hf_name!r} has no place in llama.cpp's {spec.arch.lower()} "
                              "architecture", "use --format merged or adapter")
        a = module.lora_A[name].weight.detach().float()
        b = module.lora_B[name].weight.detach().float() * float(module.scaling[name])
        if correction and hf_name in correction:
            left, right = correction[hf_name]
            a, b = torch.cat([a, right.to(a)]), torch.cat([b, left.to(b)], dim=1)
        if spec.permute_qk and hf_name.endswith("q_proj"):
            b = permute_for_llama_rope(b, heads)
        elif spec.permute_qk and hf_name.endswith("k_proj"):
            b = permute_for_llama_rope(b, kv_heads)
        yield gguf_name, np.ascontiguousarray(a.cpu().numpy()), np.ascontiguousarray(b.cpu().numpy())


#: The types `write_gguf_adapter` writes A and B in (`maximus export --adapter-dtype`).
ADAPTER_DTYPES = {"f32": np.float32, "f16": np.float16}


def write_gguf_adapter(peft_model, path: str | Path, *, marker: str, name: str | None = None,
                       correction: dict | None = None, dtype: str = "f32") -> int:
    """Write `peft_model`'s adapter (`lora_tensors`, with the run's `correction` beside it) as the
    llama.cpp LoRA file `path`, A and B in `dtype` (an `ADAPTER_DTYPES` key: f16 rounds them to
    nearest, half the file), with the export's `marker` (JSON) under `maximus.export`. Returns the
    number of adapted matrices."""
    import gguf

    from maximus.export.target import GGUF_MARKER_KEY

    _, arch = gguf_arch(peft_model.config)
    tensors = list(lora_tensors(peft_model, correction))
    if not tensors:
        raise ExportError("the run's model has no LoRA layer to write", "use --format gguf")
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)  # 0: scale 1, B carries each layer's scaling
    writer.add_name(name or "adapter")
    writer.add_string(GGUF_MARKER_KEY, marker)
    for gguf_name, a, b in tensors:
        writer.add_tensor(f"{gguf_name}.lora_a", a.astype(ADAPTER_DTYPES[dtype]))
        writer.add_tensor(f"{gguf_name}.lora_b", b.astype(ADAPTER_DTYPES[dtype]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(tensors)
