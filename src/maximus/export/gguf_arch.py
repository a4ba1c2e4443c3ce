"""Which llama.cpp architecture each family is written as, its hyperparameters and its tensors.

llama.cpp implements each family in C++ (src/models/*.cpp) and reads from the file only what
that code asks for; anything else the Hugging Face model computes must match what the C++ does
by construction, or the export is refused by name. Per family (`GGUF_ARCHS`):

- **RoPE layout**: llama.cpp's `llama` and `granite` architectures rotate adjacent pairs where
  Hugging Face rotates halves, so Q and K rows are permuted per head (`permute_for_llama_rope`);
  every other architecture here uses the NeoX (halves) layout and is written as it is.
- **Gemma's norms** compute ``x * (1 + w)``: the file holds ``1 + w`` (llama.cpp's converter does
  the same). Gemma 2 / 3 also scale the embeddings by sqrt(hidden) and soft-cap their logits;
  llama.cpp does both itself, from `final_logit_softcapping` / `attn_logit_softcapping`.
- **Sliding windows**: Gemma 2 / 3, gpt-oss and OLMo 2 (llama.cpp's `gemma2`, `gemma3`,
  `gpt-oss`, `olmo2`) read the window and a per-layer pattern, written from `config.layer_types`.
  The `llama`, `qwen2`, `qwen3` and `phi3` architectures attend over the whole context: a window
  shorter than the context is a notice.
- **Mixture of experts**: Transformers 5 holds each layer's experts as fused 3-D parameters;
  llama.cpp wants `ffn_gate_exps`, `ffn_up_exps` and `ffn_down_exps` [experts, out, in]. Mixtral
  and Qwen3-MoE store ``gate_up_proj`` [experts, 2 x ffn, hidden] (gate rows, then up rows);
  gpt-oss stores [experts, hidden, 2 x ffn] with gate and up interleaved, plus biases.
- **Fixed behaviours** llama.cpp hard-codes are checked against the config: Qwen3-MoE always
  renormalises its top-k routing weights (``norm_topk_prob``) and has no dense layers; gpt-oss's
  clamped SwiGLU uses alpha 1.702 and limit 7; Gemma scales queries by 1/sqrt(head_dim) (by
  1/sqrt(hidden / heads) for the 27B shape); Gemma 2 has no separate output head.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from maximus.errors import ExportError
from maximus.families import FAMILIES


@dataclass(frozen=True)
class GGUFArch:
    """How one Transformers model type is written for llama.cpp."""

    model_type: str
    arch: str                    # the `gguf.MODEL_ARCH` member
    permute_qk: bool = False     # llama.cpp's adjacent-pair RoPE (`llama`, `granite`)
    norm_shift: float = 0.0      # Gemma: the norm weights are stored as 1 + w
    window_pattern: bool = False  # llama.cpp reads sliding_window and a per-layer pattern
    experts: str | None = None   # "rows": [E, 2 x ffn, hidden] gate|up; "columns": gpt-oss [E, hidden, 2 x ffn] interleaved
    head: str = "optional"       # "optional": omitted when tied; "required": written even when tied; "tied": never

    @property
    def name(self) -> str:
        family = FAMILIES.get(self.model_type)
        return family.name if family is not None else self.model_type


GGUF_ARCHS: dict[str, GGUFArch] = {a.model_type: a for a in (
    GGUFArch("llama", "LLAMA", permute_qk=True),
    GGUFArch("mistral", "LLAMA", permute_qk=True),
    GGUFArch("mixtral", "LLAMA", permute_qk=True, experts="rows"),
    GGUFArch("granite", "GRANITE", permute_qk=True),
    GGUFArch("qwen2", "QWEN2"),
    GGUFArch("qwen3", "QWEN3"),
    GGUFArch("qwen3_moe", "QWEN3MOE", experts="rows"),
    GGUFArch("gemma2", "GEMMA2", norm_shift=1.0, window_pattern=True, head="tied"),
    GGUFArch("gemma3_text", "GEMMA3", norm_shift=1.0, window_pattern=True),
    GGUFArch("phi3", "PHI3"),
    GGUFArch("olmo2", "OLMO2", window_pattern=True),
    GGUFArch("gpt_oss", "GPT_OSS", window_pattern=True, experts="columns", head="required"),
)}

#: Gemma's query scale in llama.cpp: 1/sqrt(hidden / heads) at the 27B layer count, else 1/sqrt(head_dim).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
#: gpt-oss's clamped SwiGLU constants, as llama.cpp hard-codes them (LLM_FFN_SWIGLU_OAI_MOE).
_OAI_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def gguf_arch(config):
    """(GGUFArch, gguf.MODEL_ARCH) for a Hugging Face config; ExportError naming the family for
    anything llama.cpp (or the installed gguf package) cannot take as it is."""
    import gguf

    model_type = getattr(config, "model_type", None)
    if getattr(config, "vision_config", None) is not None:
        raise ExportError(f"model type {model_type!r} is a vision-language model: its GGUF needs llama.cpp's separate "
                          "mmproj file for the vision tower, which the gguf package does not write",
                          "export --format merged (or the adapter) and convert with llama.cpp's own tools")
    spec = GGUF_ARCHS.get(model_type)
    if spec is None:
        raise ExportError(f"model type {model_type!r} has no GGUF export",
                          f"supported: {', '.join(GGUF_ARCHS)}; --format merged works for any model")
    arch = getattr(gguf.MODEL_ARCH, spec.arch, None)
    if arch is None:
        raise ExportError(f"{spec.name} ({model_type}) has no GGUF export with gguf {_gguf_version()}: the package does "
                          f"not know llama.cpp's {spec.arch.lower()} architecture",
                          "pip install -U gguf, or use --format merged")
    _check_fixed_behaviours(config, spec)
    return spec, arch


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"


def _refuse(spec: GGUFArch, what: str, hint: str = "--format merged keeps the model as it is") -> None:
    raise ExportError(f"{spec.name} ({spec.model_type}) has no GGUF export for this config: {what}", hint)


def _check_fixed_behaviours(config, spec: GGUFArch) -> None:
    layers = config.num_hidden_layers
    if spec.model_type == "qwen3_moe":
        if not getattr(config, "norm_topk_prob", False):
            _refuse(spec, "norm_topk_prob is false, but llama.cpp's qwen3moe always renormalises the top-k routing "
                          "weights")
        if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
            _refuse(spec, "it has dense MLP layers (mlp_only_layers / decoder_sparse_step), and llama.cpp's qwen3moe "
                          "makes every layer a mixture of experts")
    if spec.model_type == "gpt_oss":
        for key, value in _OAI_SWIGLU.items():
            if not math.isclose(float(getattr(config, key, value)), value, rel_tol=1e-6):
                _refuse(spec, f"{key} is {getattr(config, key)}, but llama.cpp's gpt-oss computes its SwiGLU with "
                              f"{key} {value}")
    if spec.model_type in _GEMMA_27B_LAYERS:
        head_dim = _head_dim(config)
        scalar = float(getattr(config, "query_pre_attn_scalar", head_dim) or head_dim)
        used = config.hidden_size / config.num_attention_heads if layers == _GEMMA_27B_LAYERS[spec.model_type] \
            else head_dim
        if not math.isclose(scalar, used):
            _refuse(spec, f"query_pre_attn_scalar is {scalar:g}, but llama.cpp scales this shape's queries by "
                          f"1/sqrt({used:g})")
    if spec.head == "tied" and not getattr(config, "tie_word_embeddings", True):
        _refuse(spec, "its output head is untied (tie_word_embeddings: false), but llama.cpp's gemma2 uses the "
                      "embeddings as the head")


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope(config) -> tuple[float, dict, dict | None]:
    """(theta, scaling parameters) of the full-attention layers, and the sliding layers' own
    parameters where the config gives them separately (Gemma 3), else None."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    sliding = None
    if "full_attention" in params:
        sliding = params.get("sliding_attention")
        params = dict(params["full_attention"])
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    return theta, params, sliding


def llama3_rope_factors(config, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama-3 RoPE scaling (what llama.cpp reads from `rope_freqs`)."""
    theta, p, _ = _rope(config)
    factor, low, high = float(p["factor"]), float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old_ctx = float(p["original_max_position_embeddings"])
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    out = np.where(wavelen < old_ctx / high, 1.0,
                   np.where(wavelen > old_ctx / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def _sliding_layers(config) -> list[bool]:
    """Which decoder layers attend through a sliding window."""
    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return [t == "sliding_attention" for t in types]
    return [getattr(config, "sliding_window", None) is not None] * layers


def write_hparams(writer, config, spec: GGUFArch, notices: list[str]) -> np.ndarray | None:
    """Add the architecture's hyperparameters to a `gguf.GGUFWriter`; returns Llama-3's RoPE
    factors when the file needs the `rope_freqs` tensor, else None."""
    import gguf

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = _head_dim(config)
    context = int(config.max_position_embeddings)
    writer.add_context_length(context)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    theta, rope, sliding_rope = _rope(config)
    partial = float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
    writer.add_rope_dimension_count(int(head_dim * partial))
    writer.add_rope_freq_base(theta)
    factors = _write_rope_scaling(writer, config, rope, head_dim, notices)
    if sliding_rope is not None:
        if (sliding_rope.get("rope_type") or "default") != "default":
            _refuse(spec, f"its sliding layers' RoPE scaling is {sliding_rope['rope_type']!r}, which llama.cpp does not "
                          "apply to them")
        writer.add_rope_freq_base_swa(float(sliding_rope.get("rope_theta", theta)))
    _write_window(writer, config, spec, context, notices)
    _write_family_hparams(writer, config, spec)
    return factors


def _write_rope_scaling(writer, config, rope: dict, head_dim: int, notices: list[str]) -> np.ndarray | None:
    import gguf

    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "llama3":
        return llama3_rope_factors(config, head_dim)
    elif kind == "yarn":
        unsupported = [k for k in ("attention_factor", "mscale", "mscale_all_dim") if rope.get(k) is not None]
        if unsupported:
            raise ExportError(f"YaRN RoPE with {', '.join(unsupported)} has no GGUF export yet",
                              "supported: YaRN with factor, original_max_position_embeddings, beta_fast, beta_slow")
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        writer.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32.0)))
        writer.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1.0)))
        if rope.get("truncate") is False:
            notices.append("YaRN RoPE with truncate: false: llama.cpp rounds the correction range to whole dimensions, "
                           "so a few rotary frequencies differ slightly from Transformers'")
    elif kind != "default":
        raise ExportError(f"RoPE scaling {kind!r} has no GGUF export yet", "supported: default, linear, llama3, yarn")
    return None


def _write_window(writer, config, spec: GGUFArch, context: int, notices: list[str]) -> None:
    window = getattr(config, "sliding_window", None)
    sliding = _sliding_layers(config)
    if window is None or not any(sliding):
        return
    if spec.window_pattern:
        writer.add_sliding_window(int(window))
        writer.add_sliding_window_pattern(sliding)
    elif window < context:
        notices.append(f"sliding_window={window} is not representable in llama.cpp's {spec.arch.lower()} architecture: "
                       f"it attends over all {context} positions (identical up to {window} tokens)")


def _write_family_hparams(writer, config, spec: GGUFArch) -> None:
    if spec.model_type in ("gemma2", "gemma3_text"):
        if getattr(config, "attn_logit_softcapping", None):
            writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        if getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    if spec.model_type == "granite":
        writer.add_attention_scale(float(config.attention_multiplier))
        writer.add_embedding_scale(float(config.embedding_multiplier))
        writer.add_residual_scale(float(config.residual_multiplier))
        writer.add_logit_scale(float(config.logits_scaling))
    if spec.experts is not None:
        writer.add_expert_count(int(getattr(config, "num_local_experts", None) or config.num_experts))
        writer.add_expert_used_count(int(config.num_experts_per_tok))
        expert_ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        writer.add_expert_feed_forward_length(int(expert_ffn))


def permute_for_llama_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's half-split RoPE layout -> llama.cpp's interleaved pairs, per head, along the output rows."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _expert_tensors(spec: GGUFArch, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """A fused expert parameter as llama.cpp's per-projection expert tensors, named as the gguf
    package's name map knows them (`...mlp.experts.gate_proj.weight`); None for any other tensor."""
    prefix, _, leaf = name.rpartition(".experts.")
    if not prefix or leaf not in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        return None
    base = f"{prefix}.experts."
    suffix = "bias" if leaf.endswith("_bias") else "weight"
    if spec.experts == "columns" and suffix == "weight":
        tensor = tensor.transpose(-1, -2)  # gpt-oss holds [E, in, out]
    if leaf.startswith("down_proj"):
        return [(f"{base}down_proj.{suffix}", tensor)]
    axis = -2 if suffix == "weight" else -1  # the 2 x ffn axis
    index = torch.arange(tensor.shape[axis], device=tensor.device)
    if spec.experts == "columns":  # interleaved: gate, up, gate, up, ...
        gate, up = index[0::2], index[1::2]
    else:  # gate rows, then up rows
        gate, up = index[: len(index) // 2], index[len(index) // 2:]
    return [(f"{base}gate_proj.{suffix}", tensor.index_select(axis, gate)),
            (f"{base}up_proj.{suffix}", tensor.index_select(axis, up))]


def gguf_tensors(model, spec: GGUFArch, arch) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every tensor llama.cpp reads, in the model's order.

    Raises ExportError for a tensor the architecture has no place for."""
    import gguf

    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    embed = state["model.embed_tokens.weight"]
    tied = bool(getattr(config, "tie_word_embeddings", False)) or (
        "lm_head.weight" in state and state["lm_head.weight"].data_ptr() == embed.data_ptr())
    if tied and spec.head == "required" and "lm_head.weight" not in state:
        state["lm_head.weight"] = embed
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and tied and spec.head != "required":
            continue
        if hf_name.endswith("self_attn.sinks"):
            hf_name += ".weight"  # the name map knows the sinks with the usual suffix
        for part_name, part in _expert_tensors(spec, hf_name, tensor) or [(hf_name, tensor)]:
            gguf_name = names.get_name(part_name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise ExportError(f"tensor {hf_name!r} has no place in llama.cpp's {spec.arch.lower()} architecture",
                                  "was the model changed (e.g. Kronecker sketching)? --format merged keeps it as is")
            part = part.detach().to(torch.float32)
            if spec.permute_qk and part_name.endswith(("q_proj.weight", "q_proj.bias")):
                part = permute_for_llama_rope(part, heads)
            elif spec.permute_qk and part_name.endswith(("k_proj.weight", "k_proj.bias")):
                part = permute_for_llama_rope(part, kv_heads)
            if spec.norm_shift and part_name.endswith("norm.weight"):
                part = part + spec.norm_shift
            yield gguf_name, np.ascontiguousarray(part.cpu().numpy())
