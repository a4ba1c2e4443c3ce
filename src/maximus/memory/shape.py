"""The dimensions of a decoder that memory depends on (`ModelShape`), read from a model's
config.json alone (`model_shape`): a transformers config, a config.json dict or path, a model
directory, a GGUF file's metadata, or a hub id in `KNOWN_SHAPES` (no network)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from maximus.errors import ModelError
from maximus.gguf_base import gguf_config, is_gguf
from maximus.memory.coefficients import (ATTENTION_BACKWARD_PROBS, ATTENTION_PROBS, ATTENTION_SINK_MASKS,
                                         EXPERT_GATE_TENSORS, QK_EXTRA)

__all__ = ["ALL_LINEAR", "KNOWN_SHAPES", "ModelShape", "load_model_config", "model_shape"]

#: Public shapes (config.json fields) of popular hub models, so that `maximus plan` works
#: without network access. Sources: the models' config.json on the Hugging Face hub.
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.1-8B": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                    tie_word_embeddings=False, max_position_embeddings=131072),
    "meta-llama/Llama-3.1-70B": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                     num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                     tie_word_embeddings=False, max_position_embeddings=131072),
    "meta-llama/Llama-3.2-1B": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                    tie_word_embeddings=True, max_position_embeddings=131072),
    "meta-llama/Llama-3.2-3B": dict(model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                                    num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                                    tie_word_embeddings=True, max_position_embeddings=131072),
    "meta-llama/Llama-2-7b-hf": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                     tie_word_embeddings=False, max_position_embeddings=4096),
    "mistralai/Mistral-7B-v0.1": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                      tie_word_embeddings=False, max_position_embeddings=32768),
    "mistralai/Mistral-7B-v0.3": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                      tie_word_embeddings=False, max_position_embeddings=32768),
    "mistralai/Mistral-Nemo-Base-2407": dict(model_type="mistral", vocab_size=131072, hidden_size=5120,
                                             intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32,
                                             num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                                             max_position_embeddings=1024000),
    "Qwen/Qwen2.5-0.5B": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                              num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                              tie_word_embeddings=True, max_position_embeddings=32768),
    "Qwen/Qwen2.5-1.5B": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                              num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                              tie_word_embeddings=True, max_position_embeddings=131072),
    "Qwen/Qwen2.5-7B": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                            tie_word_embeddings=False, max_position_embeddings=131072),
    "Qwen/Qwen2.5-72B": dict(model_type="qwen2", vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                             num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                             tie_word_embeddings=False, max_position_embeddings=131072),
    # The instruct model's published config.json differs from the base's in its context only.
    "Qwen/Qwen2.5-72B-Instruct": dict(model_type="qwen2", vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                                      num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                      tie_word_embeddings=False, max_position_embeddings=32768),
    "mistralai/Mistral-Large-Instruct-2407": dict(model_type="mistral", vocab_size=32768, hidden_size=12288,
                                                  intermediate_size=28672, num_hidden_layers=88,
                                                  num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                                                  tie_word_embeddings=False, max_position_embeddings=131072),
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": dict(model_type="llama", vocab_size=32000, hidden_size=2048,
                                               intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                                               num_key_value_heads=4, tie_word_embeddings=False,
                                               max_position_embeddings=2048),
}
# Same shapes under other published names.
for _alias, _name in {
    "meta-llama/Meta-Llama-3-8B": "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B",
    "meta-llama/Meta-Llama-3.1-8B": "meta-llama/Llama-3.1-8B",
    "meta-llama/Meta-Llama-3-70B": "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-3.1-70B-Instruct": "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-3.2-1B-Instruct": "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B-Instruct": "meta-llama/Llama-3.2-3B",
    "mistralai/Mistral-7B-Instruct-v0.3": "mistralai/Mistral-7B-v0.3",
    "mistralai/Mistral-Nemo-Instruct-2407": "mistralai/Mistral-Nemo-Base-2407",
    # The config in the project's source article names this model; the 12B Mistral is Nemo.
    "mistralai/Mistral-12B-v0.1": "mistralai/Mistral-Nemo-Base-2407",
    "Qwen/Qwen2.5-7B-Instruct": "Qwen/Qwen2.5-7B",
    "mistralai/Mistral-Large-Instruct-2411": "mistralai/Mistral-Large-Instruct-2407",
    "Qwen/Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen2.5-1.5B-Instruct": "Qwen/Qwen2.5-1.5B",
}.items():
    KNOWN_SHAPES[_alias] = KNOWN_SHAPES[_name]

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------------------------------------
# Model shape


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that memory depends on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    qkv_bias: bool = False
    mlp_bias: bool = False
    #: Mixture of experts (0: dense): experts per layer, experts each token goes through, and the
    #: intermediate size of one expert. Every expert's weights are resident; activations follow top-k.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    #: Layers with experts (None: all); the others keep a dense MLP of `intermediate_size`
    #: (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``). Per-layer figures average them.
    moe_layers: int | None = None
    #: float32 heads x tokens x tokens attention tensors a layer holds for backward (0: SDPA without
    #: them): Transformers' eager attention (Gemma 2) keeps the soft-capped scores and the softmax.
    attention_probs: int = 0
    #: Such tensors a layer's backward holds on top (the gradients of the probabilities and scores).
    attention_backward_probs: int = 0
    #: Attention masks (rows x T x T in the compute dtype, and their boolean source) a step keeps,
    #: shared by the layers of a kind: attention sinks (gpt-oss), Gemma 3's sliding window on SDPA,
    #: Gemma 2's eager masks (`maximus.memory.coefficients.ATTENTION_SINK_MASKS`).
    sink_masks: int = 0
    #: Intermediate-sized tensors an expert's gate keeps beyond SiLU x up's: (grouped expert
    #: forward, Transformers' forward); gpt-oss's clamped SwiGLU (`EXPERT_GATE_TENSORS`).
    gate_tensors: tuple[int, int] = (0, 0)
    #: Norms per layer beyond the two of a Llama layer (Gemma's post-attention / post-MLP norms).
    extra_norms: int = 0
    #: What a layer keeps of q and k beyond a Llama layer: (compute-dtype elements per unit of
    #: q_dim + kv_dim, float32 values per head): q / k norms, a fused qkv projection (`QK_EXTRA`).
    qk_extra: tuple[float, int] = (0, 0)
    #: The head's logits are soft-capped (Gemma's ``final_logit_softcapping``): the exact loss keeps
    #: the tanh of a chunk beside its capped logits.
    logit_softcap: bool = False

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear layer of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def sparse_fraction(self) -> float:
        """The share of layers that route to experts (0.0 for a dense model)."""
        if not self.num_experts:
            return 0.0
        return 1.0 if self.moe_layers is None else self.moe_layers / self.num_layers

    @property
    def layer_linear_params(self) -> int:
        dense = sum(a * b for a, b in self.linear_shapes().values())
        if not self.num_experts:
            return dense
        h = self.hidden_size
        mlp = 3 * h * self.intermediate_size
        sparse = dense - mlp + self.num_experts * 3 * h * self.expert_intermediate_size + h * self.num_experts
        return round(self.sparse_fraction * sparse + (1 - self.sparse_fraction) * dense)

    def expert_lora_params(self, r: int, experts: bool = True, dense_targets: int = 3) -> int:
        """LoRA parameters of one layer's experts (fused gate_up and down, one adapter per expert)
        minus what the `dense_targets` gate/up/down adapters counted at the dense shape would,
        averaged over the layers; with `experts` False (``lora.experts: false``) the expert layers
        have no MLP adapters at all. `lora.experts: true` adapts the experts even when
        ``target_modules`` names no MLP projection (`maximus.models.lora_targets`)."""
        if not self.num_experts:
            return 0
        h, e, i = self.hidden_size, self.expert_intermediate_size, self.intermediate_size
        routed = self.num_experts * r * ((h + 2 * e) + (e + h)) if experts else 0
        return round(self.sparse_fraction * (routed - r * dense_targets * (h + i)))

    def active_shape(self) -> "ModelShape":
        """The shape one token's activations see: top-k experts' intermediate side by side (the
        average over the layers when some are dense)."""
        if not self.num_experts:
            return self
        f = self.sparse_fraction
        routed = self.experts_per_token * self.expert_intermediate_size
        return replace(self, intermediate_size=round(f * routed + (1 - f) * self.intermediate_size))

    def routing_bytes_per_token(self, dtype_bytes: int, lora_experts: bool = True) -> int:
        """What an expert layer keeps for backward per token beyond a dense MLP of the active shape
        (`active_shape`): the router's float32 logits and top-k, the routing indices, the experts'
        output rows for their weights; without expert adapters the gathered input rows and the
        gated rows are not kept (frozen expert weights need no input for a gradient). Measured with
        saved_tensors_hooks on Transformers' Mixtral, Qwen3-MoE and gpt-oss experts (grouped_mm and
        `maximus.kernels.grouped_experts` alike), averaged over the layers."""
        if not self.num_experts:
            return 0
        b, k, h = dtype_bytes, self.experts_per_token, self.hidden_size
        per = 4 * self.num_experts + 24 * k + 12 + b * (2 * k - 1) * h
        if not lora_experts:
            per -= b * k * (h + self.expert_intermediate_size)
        return round(self.sparse_fraction * per)

    def gate_bytes_per_token(self, dtype_bytes: int, grouped: bool) -> int:
        """What the experts' gate keeps per token beyond SiLU x up (`gate_tensors`), averaged over the layers."""
        tensors = self.gate_tensors[0 if grouped else 1]
        return round(self.sparse_fraction * tensors * dtype_bytes * self.experts_per_token * self.expert_intermediate_size)

    def merged_expert_bytes(self, dtype_bytes: int) -> int:
        """One layer's expert weights as PEFT folds the adapters into them on every forward
        (``target_parameters``), a copy Transformers' experts forward keeps for backward;
        averaged over the layers. `maximus.kernels.grouped_experts` keeps the adapters factored."""
        if not self.num_experts:
            return 0
        return round(self.sparse_fraction * self.num_experts * 3 * self.hidden_size * self.expert_intermediate_size
                     * dtype_bytes)

    @property
    def layer_other_params(self) -> int:
        """Norm weights and biases of one layer (never quantised)."""
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        if self.mlp_bias:
            bias += 2 * self.intermediate_size + self.hidden_size
        return 2 * self.hidden_size + bias

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        return (self.num_layers * (self.layer_linear_params + self.layer_other_params)
                + self.embedding_params + self.head_params + self.hidden_size)


def _get(fields: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` set in a model's config (a config.json dict or a PretrainedConfig)."""
    for name in names:
        value = fields.get(name) if isinstance(fields, dict) else getattr(fields, name, None)
        if value is not None:
            return value
    return default


def load_model_config(model: str | Path | dict | Any) -> Any:
    """A config for `model`: a transformers PretrainedConfig or dict is returned as is; a dict of
    known shapes for popular hub ids (`KNOWN_SHAPES`); a local directory or config.json path is
    read from disk; otherwise the local Hugging Face cache is tried (no network)."""
    if not isinstance(model, (str, Path)):
        return model
    text = str(model)
    if text in KNOWN_SHAPES:
        return dict(KNOWN_SHAPES[text])
    if is_gguf(text):  # the shape is in the file's metadata; weights count dequantized, at the run's dtype
        return gguf_config(text)
    path = Path(text).expanduser()
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelError(f"cannot read {path} as a config.json: {exc}", "pass a model directory or a valid config.json") from None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} has no config.json", "pass a Hugging Face model directory")
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(text, local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure means "not available offline"
        known = "meta-llama/Llama-3.1-8B, mistralai/Mistral-7B-v0.1, Qwen/Qwen2.5-7B (all: KNOWN_SHAPES)"
        raise ModelError(f"cannot find the config of '{text}' offline",
                         f"pass a local model directory or config.json, or a known id such as {known}") from None


def _moe_layers(fields: Any, layers: int) -> int | None:
    """How many layers route to experts, as Qwen3-MoE decides it (a layer is sparse unless listed
    in ``mlp_only_layers``, and only every ``decoder_sparse_step``-th one); None: every layer."""
    step = _get(fields, "decoder_sparse_step")
    dense = set(_get(fields, "mlp_only_layers", default=None) or [])
    if step is None and not dense:
        return None
    step = max(1, int(step or 1))
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def model_shape(model_config: Any) -> ModelShape:
    """Read a `ModelShape` from a transformers config, a config.json dict, a path or a hub id."""
    if isinstance(model_config, ModelShape):
        return model_config
    cfg = load_model_config(model_config)
    text_cfg = _get(cfg, "text_config")  # multimodal wrappers keep the decoder here
    if text_cfg is not None and _get(cfg, "hidden_size") is None:
        cfg = text_cfg
    h = _get(cfg, "hidden_size", "n_embd", "d_model")
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(cfg, "num_attention_heads", "n_head")
    vocab = _get(cfg, "vocab_size")
    if not all(isinstance(v, int) and v > 0 for v in (h, layers, heads, vocab)):
        raise ModelError("the model config lacks hidden_size / num_hidden_layers / num_attention_heads / vocab_size",
                         "the estimator supports Llama, Mistral and Qwen2-style decoder configs")
    kv = _get(cfg, "num_key_value_heads", default=heads)
    head_dim = _get(cfg, "head_dim", default=h // heads)
    inter = _get(cfg, "intermediate_size", "ffn_dim", "n_inner", default=4 * h)
    model_type = str(_get(cfg, "model_type", default=""))
    qkv_bias = bool(_get(cfg, "attention_bias", default=False)) or model_type == "qwen2"
    experts = int(_get(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    moe = dict(num_experts=experts, experts_per_token=int(_get(cfg, "num_experts_per_tok", default=2)),
               expert_intermediate_size=int(_get(cfg, "moe_intermediate_size", default=inter)),
               moe_layers=_moe_layers(cfg, layers)) if experts > 1 else {}
    return ModelShape(**moe, attention_probs=ATTENTION_PROBS.get(model_type, 0),
                      attention_backward_probs=ATTENTION_BACKWARD_PROBS.get(model_type, 0), sink_masks=ATTENTION_SINK_MASKS.get(model_type, 0),
                      gate_tensors=EXPERT_GATE_TENSORS.get(model_type, (0, 0)),
                      extra_norms=2 if model_type.startswith("gemma") else 0, qk_extra=QK_EXTRA.get(model_type, (0, 0)),
                      logit_softcap=bool(_get(cfg, "final_logit_softcapping")),vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_layers=layers, num_heads=heads,
                      num_kv_heads=kv, head_dim=head_dim, tied_embeddings=bool(_get(cfg, "tie_word_embeddings", default=False)),
                      qkv_bias=qkv_bias, mlp_bias=bool(_get(cfg, "mlp_bias", default=False)))

