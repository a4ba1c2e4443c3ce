"""Predict the peak memory of one training step from a model's config.json alone.

No weights are loaded and nothing is allocated: an 8B or 70B Llama is estimated in
milliseconds. The model is analytic, for Llama / Mistral / Qwen2-style decoders (embedding,
attention q/k/v/o with grouped-query heads, gated MLP, RMSNorm, tied or untied head), and its
per-token activation coefficients were measured, not guessed: they are the bytes autograd saves
in one Transformers decoder layer (SDPA attention), counted with `saved_tensors_hooks` on real
layers of several shapes (see docs/planner.md). They hold on CUDA too, since the same Python
code runs there; what differs per device is the workspace (CUDA: dequantised 4-bit weights,
cuBLAS) and the optimizer's temporaries (foreach on CUDA, one tensor at a time on CPU).

Memory of a step = static part (weights, adapters, optimizer state) + the largest of three
phases:

* ``loss``: the start of backward: every layer's saved activations, the output head and the
  loss's working set (the naive loss holds several tokens x vocab tensors), plus gradients
  left from earlier micro-steps when accumulating;
* ``backward``: backward's walk down the layers: what the lower layers keep, the layer in its
  backward and the gradients formed so far (full fine-tuning: the head's and the upper layers';
  every gradient at the end);
* ``optimizer``: the optimizer step: all gradients plus the step's temporaries.

`Estimate.breakdown` splits the peak into weights, adapters, gradients, optimizer, activations,
loss and workspace, summing exactly to `peak_bytes`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Sequence

from maximus.errors import ConfigError, ModelError
from maximus.gguf_base import gguf_config, is_gguf
from maximus.memory.adapter_terms import AdapterTerms, adapter_terms
from maximus.config import DEFAULT_H2D_BYTES_PER_S
from maximus.memory.streamed_weights import STAGING_LAYERS, STREAMED_IN_FLIGHT, streamed_layer_bytes
from maximus.memory.coefficients import (ATTENTION_BACKWARD_PROBS, ATTENTION_PROBS, ATTENTION_SINK_MASKS, QK_EXTRA, EXPERT_GATE_TENSORS, DEVICE_FLOPS, DTYPE_BYTES, KRONECKER_COEF,  # noqa: F401
                                         LAYER_COEF)
from maximus.memory.optimizer_state import (in_backward_gradient_bytes, optimizer_kwargs, optimizer_note,
                                              optimizer_settings, optimizer_state_bytes, optimizer_step_bytes,
                                              head_block_bytes, steps_outer_rows)

Method = Literal["full", "lora", "qlora"]
Attention = Literal["sdpa", "kronecker"]
Objective = Literal["sft", "dpo", "contrastive", "grpo"]
DpoReference = Literal["adapter_off", "precomputed", "none"]
LossMode = Literal["naive", "exact", "ghost"]
Checkpointing = Literal["off", "full", "selective"]

__all__ = ["Estimate", "ModelShape", "KNOWN_SHAPES", "estimate_peak", "model_shape", "load_model_config",
           "DTYPE_BYTES", "DEVICE_FLOPS", "KroneckerLayout", "kronecker_layout", "technique_kwargs"]



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
    "Qwen/Qwen2.5-72B-Instruct": "Qwen/Qwen2.5-72B",
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


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
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


def _moe_layers(cfg: Any, layers: int) -> int | None:
    """How many layers route to experts, as Qwen3-MoE decides it (a layer is sparse unless listed
    in ``mlp_only_layers``, and only every ``decoder_sparse_step``-th one); None: every layer."""
    step = _get(cfg, "decoder_sparse_step")
    dense = set(_get(cfg, "mlp_only_layers", default=None) or [])
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


# ------------------------------------------------------------------------------------------------
# Saved activations of one decoder layer, bytes per token (coefficients: maximus.memory.coefficients).



def lean_layer_bytes_per_token(shape: ModelShape, dtype_bytes: int, lora_r: int, n_targets: int,
                               n_mlp_targets: int, lora_bytes: int | None = None) -> tuple[float, float]:
    """(whole layer, its MLP): bytes a LoRA / QLoRA decoder layer with lean LoRA projections
    (`maximus.kernels.lean_lora`) keeps for backward, per token, with autocast or without.

    Measured with saved_tensors_hooks on Transformers 5 LlamaDecoderLayer (SDPA, CPU), varying one
    dimension at a time, bf16 and fp32 (docs/benchmarks/long_context.md): exact on every shape
    measured. Each projection keeps its input once in the compute dtype (q/k/v and gate/up share
    one) and its rank-r product; the MLP keeps its input, gate, up, act(gate) and the product.
    `lora_bytes`: bytes per element of the rank-r products, the adapters' compute dtype (default
    `dtype_bytes`: the trainer runs 16-bit steps under autocast; 4 for float32 adapters without it).
    """
    b = dtype_bytes
    rb = b if lora_bytes is None else lora_bytes
    h, i = shape.hidden_size, shape.intermediate_size
    whole = ((2 * b + 4) * h + 4 * b * i + 2 * b * (shape.q_dim + shape.kv_dim) + 4 * shape.num_heads
             + 2 * b * shape.head_dim + rb * lora_r * n_targets + 4)
    mlp = b * h + 4 * b * i + rb * lora_r * n_mlp_targets
    return float(whole), float(mlp)


def tiled_layer_bytes_per_token(whole: float, mlp: float, dtype_bytes: int, hidden_size: int,
                                tile_fraction: float) -> float:
    """Bytes per token a recomputed layer holds in backward when its MLP runs over tiles that are
    `tile_fraction` of the tokens: everything but the MLP for all tokens, the MLP's input for all
    tokens, the rest of the MLP for one tile."""
    tile_fraction = min(1.0, max(0.0, tile_fraction))
    return whole - (mlp - dtype_bytes * hidden_size) * (1.0 - tile_fraction)


def layer_activation_bytes_per_token(shape: ModelShape, method: str, dtype_bytes: int, lora_r: int,
                                     n_targets: int, policy: str = "off", lean_lora: bool = False,
                                     n_mlp_targets: int = 3) -> float:
    """Bytes one decoder layer keeps for backward, per token, under a checkpointing policy.

    ``off``: everything autograd saves; ``full``: the layer input only; ``selective``: the
    outputs of matmuls and attention (the cheap element-wise ops are recomputed). `lean_lora`:
    the adapters' projections are Maximus' lean ones (`lean_layer_bytes_per_token`), else PEFT's.
    """
    b = dtype_bytes
    if policy == "full":
        return shape.hidden_size * b
    if policy == "off" and lean_lora and method != "full":
        return lean_layer_bytes_per_token(shape, b, lora_r, n_targets, n_mlp_targets)[0]
    if policy == "selective":
        h, i = shape.hidden_size, shape.intermediate_size
        kept = h + shape.q_dim + 2 * shape.kv_dim + shape.q_dim + h + 2 * i + h
        return kept * b + 4 * shape.num_heads + (4 * lora_r * n_targets if method != "full" else 0)
    kind = "full" if method == "full" else "adapter"
    ch, ci, cq, ckv = LAYER_COEF[(kind, 4 if b >= 4 else 2)]
    per = (ch * shape.hidden_size + ci * shape.intermediate_size + cq * shape.q_dim + ckv * shape.kv_dim
           + 4 * shape.num_heads)
    if method != "full":
        per += 4 * lora_r * n_targets
    return float(per)


def eager_attention_bytes_per_token(shape: ModelShape, seq_len: int) -> float:
    """One float32 heads x tokens x tokens attention tensor, per token of one layer (0 when the
    model's attention keeps none)."""
    return 4.0 * shape.num_heads * seq_len if shape.attention_probs else 0.0


def masked_attention_bytes_per_token(shape: ModelShape, dtype_bytes: int, seq_len: int) -> float:
    """What one layer keeps beyond unmasked SDPA when its attention gets a ``[rows, 1, T, T]``
    document mask (many short packed documents: `maximus.attention.varlen`), per token: the mask,
    which SDPA turns into the compute dtype and saves, and keys and values repeated to every query
    head (Transformers passes SDPA no ``enable_gqa`` with a mask). Measured with
    saved_tensors_hooks on the embedded default's layers, float32 and bf16."""
    return float(dtype_bytes * (seq_len + 2 * (shape.q_dim - shape.kv_dim)))


def shape_extra_bytes_per_token(shape: ModelShape, dtype_bytes: int, seq_len: int, lora_experts: bool = True) -> float:
    """What a layer keeps beyond a Llama layer of the same (active) shape, per token: the router and
    routed copies of a mixture of experts, the attention tensors (`ModelShape.attention_probs`),
    Gemma's extra norms (their inputs)."""
    return (shape.routing_bytes_per_token(dtype_bytes, lora_experts) + shape.attention_probs * eager_attention_bytes_per_token(shape, seq_len)
            + shape.extra_norms * dtype_bytes * shape.hidden_size
            + shape.qk_extra[0] * dtype_bytes * (shape.q_dim + shape.kv_dim) + shape.qk_extra[1] * 4 * (shape.num_heads + shape.num_kv_heads))


# ------------------------------------------------------------------------------------------------
# The estimate


@dataclass
class Estimate:
    """Predicted peak memory of one training step, in bytes, and a throughput guess."""

    peak_bytes: int
    breakdown: dict[str, int]
    flops_per_token: float
    tokens_per_s_guess: float
    phase: str
    settings: dict[str, Any] = field(default_factory=dict)
    #: What the estimate bounds rather than models (a conservative figure is used), one line each.
    notes: list[str] = field(default_factory=list)
    #: Host memory the plan's offloading fills (checkpointed layer inputs, optimizer state and
    #: masters, streamed frozen weights); 0 when nothing is offloaded. Not part of ``peak_bytes``.
    host_bytes: int = 0
    #: Streamed frozen weights (`optimization.offload.params`): the file they fill (``disk``), the
    #: bytes copied to the device per micro-step (every streamed layer in forward and again in
    #: backward), and the tokens/s of the compute alone (`tokens_per_s_guess` is the slower of the
    #: compute and the copies at `DEFAULT_H2D_BYTES_PER_S`: they overlap, one layer ahead).
    disk_bytes: int = 0
    streamed_bytes_per_step: int = 0
    compute_tokens_per_s: float = 0.0

    @property
    def transfer_bound(self) -> bool:
        """Whether the copies of streamed weights, not the compute, set the step time."""
        return bool(self.streamed_bytes_per_step) and self.tokens_per_s_guess < self.compute_tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "host_bytes": self.host_bytes, "disk_bytes": self.disk_bytes,
                "streamed_bytes_per_step": self.streamed_bytes_per_step,
                "compute_tokens_per_s": self.compute_tokens_per_s, "breakdown": dict(self.breakdown),
                "phase": self.phase,
                "flops_per_token": self.flops_per_token, "tokens_per_s_guess": self.tokens_per_s_guess,
                "settings": dict(self.settings), "notes": list(self.notes)}


def _targets(shape: ModelShape, lora_targets: str | Sequence[str]) -> list[str]:
    if lora_targets == "all-linear" or lora_targets is None:
        return list(ALL_LINEAR)
    names = [lora_targets] if isinstance(lora_targets, str) else list(lora_targets)
    known = [n for n in names if n in ALL_LINEAR]
    if not known:
        raise ConfigError(f"lora.target_modules {names} names no linear layer of a Llama-style decoder",
                          f"use all-linear or some of {', '.join(ALL_LINEAR)}")
    return known


def default_loss_chunk(num_tokens: int, vocab_size: int, dtype_bytes: int, trainable_head: bool = False) -> int:
    """Tokens per chunk the exact loss uses when none is given (the loss module's default; a
    trainable head, as in full fine-tuning, has a larger floor)."""
    from maximus.losses.linear_cross_entropy import default_chunk_size

    return default_chunk_size(num_tokens, vocab_size, dtype_bytes, trainable_head)


# ------------------------------------------------------------------------------------------------
# Techniques beyond plain SFT on SDPA (issue 16): each piece measured on the real code path.


def technique_kwargs(cfg: Any) -> dict[str, Any]:
    """The `estimate_peak` keywords that a `maximus.Config` switches on, read in one place (the
    planner forwards them to every estimate): ghost candidates, Kronecker Sketching, the
    objective and its rows, the DPO reference, the Matryoshka pass, parameter offload, the lean
    RMSNorm, and LoRA's modules_to_save, DoRA and dropout."""
    opt = cfg.optimization
    kron = opt.kronecker
    dpo_reference = "none"
    if cfg.objective == "dpo":
        from maximus.losses.preference import needs_reference

        dpo_reference = cfg.dpo.reference if needs_reference(cfg.dpo.loss) else "none"
    mat = opt.matryoshka
    return dict(ghost_candidates=opt.ghost_logit.candidates,
                attention="kronecker" if kron is not None else "sdpa",
                kronecker=None if kron is None else {k: getattr(kron, k) for k in ("detail_tokens", "sketch_slots", "block")},
                # GRPO's backward is an SFT-shaped step over completion rows whose head runs over the
                # completion tokens only (completion_loss_bytes)
                objective=cfg.objective, dpo_reference=dpo_reference,
                completion_tokens=cfg.grpo.max_completion_tokens if cfg.objective == "grpo" else None,
                matryoshka_dims=None if mat is None else list(mat.dims),
                matryoshka_token_fraction=0.0625 if mat is None else mat.token_fraction,
                offload_params=opt.offload.params,
                # adapters only: estimate_peak ignores them for full fine-tuning
                modules_to_save=list(cfg.lora.modules_to_save), use_dora=cfg.lora.use_dora,
                lora_dropout=cfg.lora.dropout,
                lean_norm=opt.lean_norm and opt.kernels != "compile", lora_experts=lora_reaches_experts(cfg),
                grouped_experts=opt.grouped_experts and opt.kernels != "compile", vision=_vision_spec(cfg),
                qat=cfg.training.qat, **optimizer_kwargs(cfg))


def _vision_spec(cfg: Any):
    from maximus.memory.vision_terms import vision_spec

    try:
        config = load_model_config(cfg.model)
    except ModelError:  # the caller reports an unreadable model; no tower to add
        return None
    return vision_spec(cfg, config)


def lora_reaches_experts(cfg: Any) -> bool:
    """Whether LoRA adapts a mixture of experts' experts: `lora.experts` when set, else with
    ``target_modules: all-linear`` (as `maximus.models.lora_targets` resolves it)."""
    return cfg.lora.experts if cfg.lora.experts is not None else cfg.lora.target_modules == "all-linear"


def _check_techniques(loss_mode: str, attention: str, objective: str, dpo_reference: str, token_fraction: float) -> None:
    if attention not in ("sdpa", "kronecker"):
        raise ConfigError(f"unknown attention {attention!r}", "use sdpa or kronecker")
    if objective not in ("sft", "dpo", "contrastive", "grpo"):
        raise ConfigError(f"unknown objective {objective!r}", "use sft, dpo, contrastive or grpo")
    if dpo_reference not in ("adapter_off", "precomputed", "none"):
        raise ConfigError(f"unknown dpo reference {dpo_reference!r}", "use adapter_off, precomputed or none")
    if loss_mode == "ghost" and objective != "sft":
        raise ConfigError(f"optimization.use_ghost_logit does not apply to objective {objective}",
                          "the Ghost Logit loss replaces the SFT vocabulary softmax; set use_ghost_logit: false")
    if not 0.0 < token_fraction <= 1.0:
        raise ConfigError(f"matryoshka token_fraction must be in (0, 1], got {token_fraction}", "e.g. 0.0625")


def _rows_per_example(objective: str) -> int:
    """Rows one example adds to a forward: DPO pairs run chosen + rejected, contrastive pairs
    query + positive, in one forward of 2N rows (both padded to the same length)."""
    return 2 if objective in ("dpo", "contrastive") else 1


@dataclass(frozen=True)
class KroneckerLayout:
    """The shapes of Kronecker Sketching attention (`maximus.attention.sketch_module`)."""

    block: int
    local_blocks: int
    select_blocks: int
    sub_slots: int
    buckets: int

    @property
    def detail_tokens(self) -> int:
        return (self.local_blocks + self.select_blocks) * self.block

    @property
    def slots(self) -> int:
        return self.sub_slots * self.buckets

    @property
    def columns(self) -> int:
        """Keys each query's softmax spans: detail tokens plus sketch slots."""
        return self.detail_tokens + self.slots

    def params(self, head_dim: int) -> int:
        """Parameters of one layer's sketch (B factor, bucket scales, the block scorer)."""
        return self.sub_slots * self.block + self.buckets + 2 * head_dim * head_dim + head_dim

    def to_dict(self) -> dict[str, int]:
        return {"detail_tokens": self.detail_tokens, "sketch_slots": self.slots, "block": self.block}


def kronecker_layout(kronecker: Any = None) -> KroneckerLayout:
    """The layout a `KroneckerConfig` (or a dict of its fields; None = defaults) builds, by the
    rules of `KroneckerSketch`: detail_tokens // block blocks (two local), sub_slots =
    min(block, isqrt(sketch_slots)), buckets = sketch_slots // sub_slots."""
    get = (lambda k, d: kronecker.get(k, d)) if isinstance(kronecker, dict) else (lambda k, d: getattr(kronecker, k, d))
    if kronecker is None or kronecker is True:
        get = lambda k, d: d  # noqa: E731
    detail, slots, block = int(get("detail_tokens", 256)), int(get("sketch_slots", 64)), int(get("block", 64))
    if detail < block:
        raise ConfigError(f"optimization.kronecker_sketching.detail_tokens ({detail}) must be at least block ({block})",
                          "raise detail_tokens or lower block; detail_tokens is rounded down to whole blocks")
    blocks = detail // block
    sub = max(1, min(block, math.isqrt(slots)))
    return KroneckerLayout(block=block, local_blocks=min(2, blocks), select_blocks=blocks - min(2, blocks),
                           sub_slots=sub, buckets=max(1, slots // sub))




def policy_names(checkpointing: Any) -> set[str]:
    """The recompute modes a checkpointing argument of `estimate_peak` names."""
    if isinstance(checkpointing, str):
        return {checkpointing}
    if isinstance(checkpointing, int):
        return {"full", "off"}
    return {"full" if f else "off" for f in checkpointing}


def _block_padding(seq_len: int, block: int) -> float:
    """The sketch pads every sequence to whole blocks: its per-token cost grows by this factor."""
    return math.ceil(seq_len / block) * block / seq_len


def kronecker_saved_bytes_per_token(shape: ModelShape, method: str, dtype_bytes: int, layout: KroneckerLayout,
                                    seq_len: int) -> float:
    """Extra bytes per token one layer saves for backward with the sketch instead of SDPA."""
    H, kv, D, Lb = shape.num_heads, shape.num_kv_heads, shape.head_dim, layout.block
    C, K = layout.columns, layout.slots
    terms = (H * C, kv * C * D / Lb, kv * C, kv * D, H * D, kv * K * D / Lb,
             kv * layout.select_blocks * layout.sub_slots * D / Lb)
    coef = KRONECKER_COEF[("full" if method == "full" else "adapter", 4 if dtype_bytes >= 4 else 2)]
    return max(0.0, sum(c * t for c, t in zip(coef, terms))) * _block_padding(seq_len, Lb)


def reference_forward_bytes_per_token(shape: ModelShape, dtype_bytes: int, layout: KroneckerLayout | None,
                                      seq_len: int) -> float:
    """Transients of one decoder layer's forward without gradients (the DPO reference pass):
    its input and output, q / k / v and the attention output, the gated MLP's three
    intermediates; with the sketch, its float32 logits and probabilities and gathered keys."""
    h, i = shape.hidden_size, shape.intermediate_size
    per = (2 * h + 2 * shape.q_dim + 2 * shape.kv_dim + 3 * i) * dtype_bytes
    if layout is not None:
        H, kv, D, Lb, C = shape.num_heads, shape.num_kv_heads, shape.head_dim, layout.block, layout.columns
        per += (8 * H * C + 2 * kv * C * D * dtype_bytes / Lb) * _block_padding(seq_len, Lb)
    return float(per)


def head_loss_bytes(shape: ModelShape, loss_mode: str, T: int, b: int, trainable_head: bool,
                    chunk_tokens: int | None, default_chunk: int, ghost_candidates: int = 1024,
                    with_grad: bool = True, head_block: int = 0) -> int:
    """Working set of the vocabulary loss over T tokens (bytes).

    ``naive``: Transformers' loss: float32 logits, log-softmax output and, in backward, its
    incoming and outgoing gradients; the 16-bit logits die after forward (the trainer keeps only
    the loss): 12 bytes per logit at the start of backward (10 during forward; 4 + b without
    gradients). ``exact``: one chunk of logits (float32 + 16-bit matmul output) plus the hidden
    state's gradient buffer and the shifted hidden copy. ``ghost``: see `ghost_loss_bytes`.
    ``head_block``: the exact loss's backward steps the head one block of vocabulary rows at a
    time, with this working set (`head_block_bytes`), instead of accumulating the whole V x H
    gradient.
    """
    V, h = shape.vocab_size, shape.hidden_size
    if loss_mode == "naive":
        loss = T * V * (12 if with_grad else 4 + b)
    elif loss_mode == "ghost":
        loss = ghost_loss_bytes(shape, T, b, trainable_head, chunk_tokens, ghost_candidates)
    else:
        chunk = max(1, min(chunk_tokens or default_chunk, T))
        loss = chunk * V * (4 + (b if b < 4 else 0)) + (2 * T * h * b if with_grad else T * h * b)
        if shape.logit_softcap and with_grad:  # the chunk's tanh, kept for the cap's backward
            loss += chunk * V * 4
        if trainable_head and with_grad and head_block:  # the hidden gradient, and one block or one chunk
            loss = max(loss, 2 * T * h * b + head_block)
        elif trainable_head and with_grad:  # float32 gradient accumulator over chunks
            loss += V * h * 4
    # Per-token scratch of the head (labels, log-sum-exp, losses): small but not zero.
    return int(loss + T * 24)


def ghost_loss_bytes(shape: ModelShape, T: int, b: int, trainable_head: bool, chunk_tokens: int | None,
                     candidates: int) -> int:
    """Working set of `maximus.losses.ghost_logit_loss` (bytes): per call the centred prefix of
    every vocabulary row (`prefix_dims` = 64 columns), the per-row best score and position, one
    candidate-scan block; per chunk of C tokens (the user's `loss_chunk_size`, else 256) the K =
    candidates + C gathered rows and C x K logits (16-bit matmul output, float32 logits and
    their gradient, 16-bit gradient); the hidden-state gradient over all T tokens."""
    from maximus.losses.ghost_logit import DEFAULT_GHOST_CHUNK_TOKENS, SCAN_BLOCK_BYTES

    V, h = shape.vocab_size, shape.hidden_size
    chunk = max(1, min(chunk_tokens or DEFAULT_GHOST_CHUNK_TOKENS, T))
    K = min(V, candidates + chunk)
    # The candidate scan runs over blocks of vocabulary rows; the next block's scores exist
    # before the previous block's are freed.
    block_rows = max(1, SCAN_BLOCK_BYTES // (chunk * b))
    scan = min(V, block_rows) * chunk * b * (2 if V > block_rows else 1)
    # per call: centred prefix rows, best score (16-bit and float32), position, the scan;
    # per chunk: gathered rows, C x K logits and gradients; the hidden-state gradient
    loss = 2 * T * h * b + V * (64 * b + b + 4 + 8) + scan + K * h * b + chunk * (K + 1) * (8 + 2 * b)
    # The vocabulary statistics pass before it: two float32 blocks of weight rows (measured).
    loss = max(loss, 2 * min(V * h * 4, SCAN_BLOCK_BYTES))
    if trainable_head:
        loss += V * h * 4
    return int(loss)


def matryoshka_loss_bytes(shape: ModelShape, main_loss: int, loss_mode: str, T: int, b: int, trainable_head: bool,
                          dims: Sequence[int], token_fraction: float, chunk_tokens: int | None = None) -> int:
    """The loss working set with the SFT Matryoshka auxiliary pass (bytes).

    With every token (fraction 1) and the exact loss, main and prefix losses share one nested
    chunked pass whose chunk holds one more stored C x V gradient per prefix. Otherwise the prefix
    levels run after the main loss, over the sampled tokens gathered together (`sampled_tokens`:
    ceil(fraction x 64) of every 64), while the main loss's hidden-state gradient is still held.
    A chunk the plan sets (`loss_chunk_size`) is the nested pass's chunk too (the trainer passes it)."""
    from maximus.losses.matryoshka import SAMPLE_GROUP_TOKENS, default_nested_chunk_size

    V, h = shape.vocab_size, shape.hidden_size
    levels = len([d for d in dims if 0 < d < h])
    if not levels:
        return main_loss
    per_token = lambda n: V * (b + max(b, 4) + (n - 1) * b)  # noqa: E731  (default_nested_chunk_size's)
    if token_fraction >= 1.0 and loss_mode == "exact":
        chunk = min(T, chunk_tokens or default_nested_chunk_size(T, V, b, levels + 1, trainable_head))
        return int(chunk * per_token(levels + 1) + 2 * T * h * b + (V * h * 4 if trainable_head else 0) + T * 24)
    sampled = min(T, math.ceil(T / SAMPLE_GROUP_TOKENS) * math.ceil(token_fraction * SAMPLE_GROUP_TOKENS))
    chunk = min(sampled, chunk_tokens or default_nested_chunk_size(sampled, V, b, levels, trainable_head))
    aux = chunk * per_token(levels) + sampled * h * (2 * b + 4) + (V * h * 4 if trainable_head else 0)
    return int(max(main_loss, 2 * T * h * b + T * 24 + aux))


def completion_loss_bytes(spec, trainable_head: bool) -> tuple[int, int]:
    """(working set of GRPO's log-prob pass over one micro-batch, the chunk it uses when none is
    given) for an `estimate_peak` step spec with `objective="grpo"` and the exact head.

    `maximus.losses.token_outputs.label_log_probs` gathers the labelled rows, L =
    `micro_batch x completion_tokens` (not every prompt + completion position), and runs the head
    over them in chunks: one chunk x V float32 buffer (plus the 16-bit matmul output), one row
    block of probabilities (`ROW_BLOCKS_PER_CHUNK`: 1/8 of the chunk), the gathered rows and the
    log-prob gradient basis (L x hidden each); a trainable head adds its float32 gradient
    accumulator and the rows' gradient in backward. Measured with the CPU meter (V = 32,000,
    hidden 256, fp32, forward and backward): 8.92 MiB for 4 rows of 68 tokens with 16 labelled
    (this formula: 8.92), 35.66 for 4 x 128 with 64 (35.67), 74.36 for 8 x 300 with 256 (chunk
    512: 74.37)."""
    from maximus.losses.token_outputs import ROW_BLOCKS_PER_CHUNK

    shape, b = spec.shape, spec.b
    V, h = shape.vocab_size, shape.hidden_size
    labelled = spec.micro_batch * min(spec.completion_tokens or spec.seq_len, spec.seq_len)
    default_chunk = default_loss_chunk(labelled, V, b, trainable_head=trainable_head)
    chunk = max(1, min(spec.loss_chunk_tokens or default_chunk, labelled))
    block = -(-chunk // ROW_BLOCKS_PER_CHUNK)
    loss = chunk * V * (4 + (b if b < 4 else 0)) + block * V * 4 + 2 * labelled * h * b
    if trainable_head:
        loss += V * h * 4 + labelled * h * b
    # Per-position scratch (labels, the scattered log-probs): small but not zero.
    return int(loss + spec.T * 24), default_chunk


def contrastive_loss_bytes(shape: ModelShape, T: int, b: int) -> int:
    """The contrastive loss never touches the vocabulary: pooled float32 vectors of every row, an
    N x N similarity matrix, and the pooled gradient spread back over T tokens x hidden."""
    return int(T * shape.hidden_size * (b + 4) + T * 24)


def _streamed_weight_bytes(shape: ModelShape, method: str, b: int, device_type: str, notes: list[str]) -> int:
    """Device bytes that `optimization.offload.params` moves off the device: every decoder layer's
    frozen weights (QLoRA: 4-bit data with its quantization state, and the norms; LoRA: the plain
    weights) but the three in flight (the running layer, the prefetched one, the one being
    released in backward). Trainable weights never stream."""
    if device_type == "cpu":
        notes.append("offload.params on a CPU: host and device memory are the same, nothing is saved")
        return 0
    if method == "full":
        notes.append("offload.params streams frozen weights only: full fine-tuning has none")
        return 0
    return max(0, shape.num_layers - STREAMED_IN_FLIGHT) * streamed_layer_bytes(shape, method, b)


# ------------------------------------------------------------------------------------------------
# One step, described once


@dataclass(frozen=True)
class StepSpec:
    """One training step as the estimate reads it: `estimate_peak`'s arguments, validated, with the
    model's shape read once and the per-layer recompute policy spelled out (`step_spec`)."""

    shape: ModelShape
    method: str
    dtype: str
    micro_batch: int
    seq_len: int
    #: The checkpointing argument as given (recorded in the settings), and one mode per layer.
    checkpointing: Any
    policy: tuple[str, ...]
    offload_activations: bool
    offload_optimizer: bool
    loss_mode: str
    optimizer: str
    lora_r: int
    targets: tuple[str, ...]
    world_size: int
    #: Ranks the weights are split over (1: unsharded, DDP or one device).
    shard: int
    loss_chunk_tokens: int | None
    grad_accum: int
    ghost_candidates: int
    device_type: str
    attention: str
    layout: KroneckerLayout | None
    objective: str
    dpo_reference: str
    matryoshka_dims: tuple[int, ...] | None
    matryoshka_token_fraction: float
    offload_params: bool
    #: Where streamed layers live: ``host`` (pinned host memory) or ``disk`` (a memory-mapped file).
    params_store: str
    tile_tokens: int | None
    #: Lean LoRA projections in use (an adapter and `lean_lora`).
    lean: bool
    lean_norm: bool
    optimizer_rank: int | None
    optimizer_in_backward: bool
    master_weights: str
    #: A mixture of experts' MLP adapters reach the experts; the grouped expert forward runs them.
    lora_experts: bool = True
    grouped_experts: bool = True
    modules_to_save: tuple[str, ...] = ()
    use_dora: bool = False
    embedding_optimizer: str = "adamw"
    lora_dropout: float = 0.0
    #: A vision-language model's tower and projector (`maximus.memory.vision_terms.VisionSpec`).
    vision: Any = None
    #: Attention runs as one SDPA call per row with a document mask (`masked_attention_bytes_per_token`).
    masked_attention: bool = False
    #: GRPO: the completion tokens of a row (the labelled ones: the head runs over them only).
    completion_tokens: int | None = None
    #: `training.qat`: one rounded copy of each quantized matrix is kept (`qat_copy_bytes`).
    qat: str = "off"

    @property
    def b(self) -> int:
        """Bytes per element of the compute dtype."""
        return DTYPE_BYTES[self.dtype]

    @property
    def adapter(self) -> bool:
        return self.method != "full"

    @property
    def T(self) -> int:
        """Tokens of one micro-batch (DPO and contrastive run 2 rows per example)."""
        return self.micro_batch * self.seq_len * _rows_per_example(self.objective)

    @property
    def master(self) -> bool:
        """16-bit full fine-tuning keeps float32 master weights and computes under autocast."""
        return self.method == "full" and self.b < 4 and self.master_weights != "bf16"

    @property
    def weight_bytes(self) -> int:
        return 4 if self.master else self.b


def _policy(checkpointing: Any, num_layers: int) -> tuple[str, ...]:
    """One recompute mode (off | full | selective) per layer from `estimate_peak`'s argument."""
    L = num_layers
    if isinstance(checkpointing, str):
        if checkpointing not in ("off", "full", "selective"):
            raise ConfigError(f"unknown checkpointing {checkpointing!r}", "use off, full or selective")
        return (checkpointing,) * L
    if isinstance(checkpointing, int):
        k = max(0, min(L, checkpointing))
        return ("full",) * k + ("off",) * (L - k)
    flags = list(checkpointing)
    if len(flags) != L:
        raise ConfigError(f"per-layer checkpointing needs {L} entries, got {len(flags)}",
                          "one recompute mode (none, selective, full) per layer")
    # Per layer: a recompute mode (`Plan.recompute`: none | selective | full) or a boolean (True = full).
    modes = {True: "full", False: "off", "full": "full", "none": "off", "off": "off", "selective": "selective"}
    if any(f not in modes for f in flags):
        raise ConfigError(f"unknown per-layer recompute mode in {flags}", "use none, selective or full")
    return tuple(modes[f] for f in flags)


def _check_step(method: str, dtype: str, loss_mode: str, micro_batch: int, seq_len: int, world_size: int) -> None:
    """`estimate_peak`'s ConfigErrors for a method, dtype, loss mode or size it does not know."""
    if method not in ("full", "lora", "qlora"):
        raise ConfigError(f"method must be full, lora or qlora for an estimate, got {method!r}",
                          "the planner resolves method: auto")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}", "use bf16, fp16 or fp32")
    if loss_mode not in ("naive", "exact", "ghost"):
        raise ConfigError(f"unknown loss mode {loss_mode!r}", "use exact, naive or ghost")
    if micro_batch < 1 or seq_len < 1 or world_size < 1:
        raise ConfigError("micro_batch, seq_len and world_size must be positive", "check training.* keys")


def step_spec(model_config: Any, *, method: Method = "lora", dtype: str = "bf16", micro_batch: int = 1,
              seq_len: int = 2048, checkpointing: Any = "off", offload_activations: bool = False,
              offload_optimizer: bool = False, loss_mode: LossMode = "exact", optimizer: str = "adamw",
              lora_r: int = 16, lora_targets: str | Sequence[str] = "all-linear", world_size: int = 1,
              loss_chunk_tokens: int | None = None, grad_accum: int = 1, ghost_candidates: int = 1024,
              device: str = "cuda", sharded: bool | None = None, attention: Attention = "sdpa", kronecker: Any = None,
              objective: Objective = "sft", dpo_reference: DpoReference = "adapter_off",
              matryoshka_dims: Sequence[int] | None = None, matryoshka_token_fraction: float = 0.0625,
              offload_params: bool | str = False, tile_tokens: int | None = None, lean_lora: bool = False,
              lean_norm: bool = True, optimizer_rank: int | None = None, optimizer_in_backward: bool = False,
              master_weights: str = "fp32", lora_experts: bool = True, grouped_experts: bool = True,
              modules_to_save: Sequence[str] = (), use_dora: bool = False, lora_dropout: float = 0.0,
              vision: Any = None, embedding_optimizer: str = "adamw", masked_attention: bool = False,
              completion_tokens: int | None = None, qat: str = "off") -> StepSpec:
    """The `StepSpec` of `estimate_peak`'s arguments (documented there); raises its ConfigErrors."""
    shape = model_shape(model_config)
    _check_step(method, dtype, loss_mode, micro_batch, seq_len, world_size)
    _check_techniques(loss_mode, attention, objective, dpo_reference, matryoshka_token_fraction)
    layout = kronecker_layout(kronecker) if attention == "kronecker" else None
    adapter = method != "full"
    targets = tuple(_targets(shape, lora_targets)) if adapter else ()
    if sharded is None:
        sharded = world_size > 1
    return StepSpec(
        shape=shape, method=method, dtype=dtype, micro_batch=micro_batch, seq_len=seq_len,
        checkpointing=checkpointing if isinstance(checkpointing, (str, int)) else list(checkpointing),
        policy=_policy(checkpointing, shape.num_layers), offload_activations=offload_activations,
        offload_optimizer=offload_optimizer, loss_mode=loss_mode, optimizer=optimizer, lora_r=lora_r, targets=targets,
        world_size=world_size, shard=world_size if (sharded and world_size > 1 and method != "qlora") else 1,
        loss_chunk_tokens=loss_chunk_tokens, grad_accum=grad_accum, ghost_candidates=ghost_candidates,
        device_type=str(device).split(":")[0], attention=attention, layout=layout, objective=objective,
        dpo_reference=dpo_reference, matryoshka_dims=None if matryoshka_dims is None else tuple(matryoshka_dims),
        matryoshka_token_fraction=matryoshka_token_fraction, offload_params=offload_params in (True, "on", "disk"),
        params_store="disk" if offload_params == "disk" else "host", tile_tokens=tile_tokens,
        lean=bool(lean_lora and adapter), lean_norm=lean_norm, optimizer_rank=optimizer_rank,
        optimizer_in_backward=optimizer_in_backward, master_weights=master_weights, lora_experts=lora_experts,
        grouped_experts=grouped_experts, modules_to_save=tuple(modules_to_save or ()), use_dora=use_dora, lora_dropout=lora_dropout,
        vision=vision, embedding_optimizer=embedding_optimizer, masked_attention=masked_attention and attention == "sdpa",
        completion_tokens=completion_tokens if objective == "grpo" else None, qat=qat)


# ------------------------------------------------------------------------------------------------
# The estimate's parts: static + activations + backward walk + loss + workspace


@dataclass(frozen=True)
class StaticTerms:
    """Bytes that live through the whole step (per rank), and what the phases need of them."""

    weights_dev: int
    adapters: int
    opt_dev: int
    grads: int
    step_temporaries: int
    host_opt: int
    streamed: int
    trainable: int
    trainable_head: bool
    extras: AdapterTerms
    notes: list[str]
    vision: Any = None  # `maximus.memory.vision_terms.VisionTerms` of a VLM


def _weight_bytes(spec: StepSpec, notes: list[str]) -> tuple[int, int, int]:
    """(device bytes of the weights, bytes streamed from the host, tied-embedding parameters kept whole)."""
    shape, b, wb, shard = spec.shape, spec.b, spec.weight_bytes, spec.shard
    L = shape.num_layers
    non_linear = L * shape.layer_other_params + shape.embedding_params + shape.head_params + shape.hidden_size
    linear = L * shape.layer_linear_params
    if spec.method == "qlora":
        # NF4: 4 bits per weight; blocks of 64 with a uint8 absmax, itself quantised in blocks of
        # 256 with a float32 absmax (double quantisation): 0.127 extra bits per weight.
        weights = int(linear * (0.5 + 1 / 64 + 4 / (64 * 256))) + non_linear * b
    else:
        weights = (linear + non_linear) * wb
    # A head tied to the embedding stays whole on every rank (maximus.train.distributed).
    whole = shape.embedding_params if (shard > 1 and shape.tied_embeddings) else 0
    weights_dev = (weights - whole * wb) // shard + whole * wb
    if shard > 1:
        # Gathered at once: two decoder layers (the running one, the prefetched one), the root
        # unit (embedding, final norm) for the whole step, the head while the loss runs.
        weights_dev += (2 * (shape.layer_linear_params + shape.layer_other_params)
                        + (shape.embedding_params + shape.head_params if not whole else 0)) * wb
    streamed = _streamed_weight_bytes(shape, spec.method, b, spec.device_type, notes) if spec.offload_params else 0
    return weights_dev - streamed + qat_copy_bytes(spec), streamed, whole


def qat_copy_bytes(spec: StepSpec) -> int:
    """`training.qat`'s cache (`maximus.qat.install`): one rounded copy of every quantized matrix,
    kept between weight updates. GGUF targets round the decoder's linears, the embedding and an
    untied head; int4 the linears only. A copy is in the weight's dtype (float32 for QLoRA's
    dequantized base)."""
    if spec.qat == "off":
        return 0
    shape = spec.shape
    matrices = shape.num_layers * shape.layer_linear_params
    if spec.qat != "int4":
        matrices += shape.embedding_params + shape.head_params
    return matrices * (4 if spec.method == "qlora" else spec.weight_bytes) // spec.shard


def _mlp_targets(targets: Sequence[str]) -> int:
    """How many of the targeted linears are MLP projections (which reach a mixture's experts)."""
    return sum(1 for t in targets if t in ("gate_proj", "up_proj", "down_proj"))


def _trainable_terms(spec: StepSpec, notes: list[str]) -> tuple[int, int, AdapterTerms]:
    """(device bytes of the adapters, trainable parameters, `adapter_terms`): the LoRA matrices,
    the Kronecker sketch, `lora.modules_to_save` copies and DoRA magnitudes (no tower)."""
    shape, shard, adapter = spec.shape, spec.shard, spec.adapter
    L, lin, r = shape.num_layers, shape.linear_shapes(), spec.lora_r
    n_adapter = L * sum(r * (lin[t][0] + lin[t][1]) for t in spec.targets)
    dense_mlp = _mlp_targets(spec.targets)
    if dense_mlp or spec.lora_experts:  # lora.experts: every expert's adapter, whatever target_modules says
        n_adapter += L * shape.expert_lora_params(r, experts=spec.lora_experts, dense_targets=dense_mlp)
    adapters = 4 * n_adapter // shard  # PEFT keeps adapters in float32 (autocast_adapter_dtype)
    trainable = n_adapter if adapter else shape.num_params
    if spec.layout is not None:
        # The sketch's own parameters: float32, trainable; PEFT (modules_to_save) keeps a frozen
        # original beside the trained copy.
        n_sketch = L * spec.layout.params(shape.head_dim)
        adapters += 4 * n_sketch * (2 if adapter else 1)
        trainable += n_sketch if adapter else 0
    # lora.modules_to_save copies, DoRA magnitudes (float32, trainable), and what they and dropout save.
    extras = (adapter_terms(shape, spec.targets, spec.b, modules_to_save=spec.modules_to_save, use_dora=spec.use_dora,
                            lora_dropout=spec.lora_dropout) if adapter else AdapterTerms())
    notes.extend(extras.notes)
    adapters += 4 * extras.trainable_params // shard
    trainable += extras.trainable_params
    return adapters, trainable, extras


def _vision_static(spec: StepSpec):
    """The tower and the projector of a VLM (`maximus.memory.vision_terms.VisionTerms`); None for text."""
    if spec.vision is None:
        return None
    from maximus.memory.vision_terms import vision_terms

    return vision_terms(spec.vision, rows=spec.T // spec.seq_len, seq_len=spec.seq_len, text=spec.shape,
                        method=spec.method, dtype_bytes=spec.b, lora_r=spec.lora_r, checkpointing=spec.checkpointing,
                        grad_accum=spec.grad_accum)


def _optimizer_terms(spec: StepSpec, trainable: int, whole: int, notes: list[str]) -> tuple[int, int, int, int]:
    """(gradients, optimizer state on the device, the step's temporaries, host optimizer bytes), per rank."""
    shape, shard, adapter = spec.shape, spec.shard, spec.adapter
    p_bytes = 4 if adapter else spec.weight_bytes
    opt = dict(full=not adapter, trainable=trainable, p_bytes=p_bytes)
    # Per trainable parameter, on average (maximus.memory.optimizer_state: one row per optimizer).
    state_bytes = optimizer_state_bytes(shape, spec.optimizer, rank=spec.optimizer_rank,
                                        embedding_optimizer=spec.embedding_optimizer, **opt) / max(1, trainable)
    replicated = 0 if adapter else whole  # a trainable tied embedding: whole gradient and moments
    per_rank_trainable = (trainable - replicated) / shard + replicated
    grads = int(per_rank_trainable * p_bytes)
    if spec.optimizer_in_backward:
        grads = in_backward_gradient_bytes(shape, rows=_outer_rows(spec), **opt)
    step_temporaries = (optimizer_step_bytes(shape, spec.optimizer, device=spec.device_type, rank=spec.optimizer_rank,
                                             master_weights=spec.master_weights, rows=_outer_rows(spec),
                                             in_backward=spec.optimizer_in_backward,
                                             embedding_optimizer=spec.embedding_optimizer, **opt) // shard
                        if not spec.offload_optimizer else 0)
    note = optimizer_note(spec.optimizer, spec.optimizer_rank, spec.optimizer_in_backward, spec.master_weights,
                          spec.embedding_optimizer)
    if note:
        notes.append(note)
    states = int(per_rank_trainable * state_bytes)
    # `OffloadedAdamW` keeps, per trainable parameter, a float32 master, a float32 gradient buffer
    # and the moments in host memory.
    host_opt = int(per_rank_trainable * 8) + states if spec.offload_optimizer else 0
    return grads, 0 if spec.offload_optimizer else states, step_temporaries, host_opt


def _static_terms(spec: StepSpec) -> StaticTerms:
    """Weights, adapters (with the sketch and `adapter_terms`), gradients and optimizer state."""
    notes: list[str] = []
    weights_dev, streamed, whole = _weight_bytes(spec, notes)
    adapters, trainable, extras = _trainable_terms(spec, notes)
    vision = _vision_static(spec)
    if vision is not None:
        weights_dev += vision.weights
        adapters += vision.adapters if spec.adapter else 0
        trainable += vision.trainable
    grads, opt_dev, step_temporaries, host_opt = _optimizer_terms(spec, trainable, whole, notes)
    return StaticTerms(weights_dev=weights_dev, adapters=adapters, opt_dev=opt_dev, grads=grads,
                       step_temporaries=step_temporaries, host_opt=host_opt, streamed=streamed, trainable=trainable,
                       trainable_head=not spec.adapter or extras.trains_head, extras=extras, notes=notes, vision=vision)


@dataclass(frozen=True)
class LayerTerms:
    """Bytes per token the decoder layers keep for backward (`_layer_terms`)."""

    per_layer: tuple[float, ...]  # what each layer keeps under its policy (0: offloaded)
    stored: float  # all layers, plus an offloaded layer in flight
    acts: int  # bytes at the start of backward: every layer, the head's input, the extras
    host_acts: int
    per_off: float
    per_recomputed: float  # a fully recomputed layer during its backward
    grad_work: float  # the gradients flowing through a layer in backward
    norm_moment: float  # a recomputed layer at its post-attention norm's backward
    tile_fraction: float
    notes: list[str]


def _layer_saved_bytes(spec: StepSpec, extras: AdapterTerms) -> tuple[float, float, float, float]:
    """(off, full, selective, attention work): bytes per token one layer keeps per recompute mode."""
    n_t, n_mlp_t = len(spec.targets), _mlp_targets(spec.targets)
    act = spec.shape.active_shape()  # mixture of experts: each token's activations go through top-k experts
    per_off = layer_activation_bytes_per_token(act, spec.method, spec.b, spec.lora_r, n_t, "off", spec.lean, n_mlp_t)
    per_full = layer_activation_bytes_per_token(act, spec.method, spec.b, spec.lora_r, n_t, "full")
    per_sel = layer_activation_bytes_per_token(act, spec.method, spec.b, spec.lora_r, n_t, "selective")
    for term, selective_too in _layer_saved_extras(spec, extras):
        per_off += term
        if selective_too:
            per_sel += term
    return per_off, per_full, per_sel, _sketch_backward_bytes(spec)


def _layer_saved_extras(spec: StepSpec, extras: AdapterTerms):
    """What a layer not fully recomputed keeps beyond its projections and attention, in order:
    (bytes per token, whether a selectively recomputed layer keeps it too)."""
    shape, b, r, T, lin, targets = spec.shape, spec.b, spec.lora_r, spec.T, spec.shape.linear_shapes(), spec.targets
    expert_adapters = spec.adapter and spec.lora_experts and shape.num_experts > 0  # whatever the MLP targets
    yield shape_extra_bytes_per_token(shape, b, spec.seq_len, expert_adapters) + extras.layer_bytes_per_token, True
    if spec.masked_attention:  # the mask and the repeated keys / values, saved by SDPA
        yield masked_attention_bytes_per_token(shape, b, spec.seq_len), True
    yield shape.gate_bytes_per_token(b, spec.grouped_experts and spec.device_type == "cpu"), False
    if expert_adapters and not (spec.grouped_experts and spec.device_type == "cpu"):
        # PEFT's merged expert weights, kept per layer until its backward (a per-layer constant)
        yield shape.merged_expert_bytes(b) / T, False
    if spec.lean_norm and b < 4:  # the lean norm keeps its input, not Transformers' float32 copy (16-bit steps)
        yield -4 * shape.hidden_size, False
    if spec.adapter and b < 4 and not spec.lean:
        # Autocast caches a 16-bit copy of each float32 adapter weight per forward, saved for
        # backward: a per-layer constant (measured; it dominates short sequences).
        yield 2 * sum(r * (lin[t][0] + lin[t][1]) for t in targets) / T, True
    if spec.master:  # autocast's 16-bit copies of the float32 linear weights, saved for backward
        yield 2 * shape.layer_linear_params / T, True
    if spec.layout is not None:
        # Selective recompute keeps the attention's outputs; for the sketch that is bounded by
        # everything it saves (its probabilities are the attention's output here).
        yield kronecker_saved_bytes_per_token(shape, spec.method, b, spec.layout, spec.seq_len), True


def _sketch_backward_bytes(spec: StepSpec) -> float:
    """What the Kronecker sketch's backward adds per token to a layer's backward."""
    if spec.layout is None or spec.b >= 4:
        return 0.0
    # In backward each gradient of the sketch (probabilities, logits, gathered keys) mostly
    # replaces a saved tensor that its node frees as it runs: nothing extra in float32; in
    # 16-bit the casts' gradients add ~3 bytes per head and softmax column (measured with
    # the meter on real trainer steps, full recompute, 2 x 1,024 tokens).
    return 3.0 * spec.shape.num_heads * spec.layout.columns * _block_padding(spec.seq_len, spec.layout.block)


def _kept_by_policy(spec: StepSpec, kept: dict[str, float]) -> tuple[tuple[float, ...], float, int]:
    """(what each layer keeps under its policy, 0 when offloaded; all layers plus an offloaded
    layer in flight; bytes on the host), from the bytes per token `kept` per recompute mode."""
    policy, offload = spec.policy, spec.offload_activations
    per_layer = tuple(0.0 if (p == "full" and offload) else kept[p] for p in policy)  # offloaded: on host
    host_acts = int(spec.T * kept["full"] * sum(1 for p in policy if p == "full")) if offload else 0
    in_flight = 2 * kept["full"] if (offload and any(p != "off" for p in policy)) else 0.0  # prefetch one layer ahead
    return per_layer, sum(per_layer) + in_flight, host_acts


def _tile_fraction(spec: StepSpec) -> float:
    """Tiling: the share of the tokens a fully recomputed layer's MLP holds at once (1: untiled)."""
    if spec.tile_tokens is not None and "full" in spec.policy:
        return min(1.0, max(1, int(spec.tile_tokens)) / spec.T)
    return 1.0


def _mlp_saved_bytes(spec: StepSpec) -> float:
    """Bytes per token the MLP of a layer keeps for backward (what tiling divides)."""
    shape, b, h = spec.shape, spec.b, spec.shape.hidden_size
    n_mlp_t = _mlp_targets(spec.targets)
    if spec.lean:
        return lean_layer_bytes_per_token(shape, b, spec.lora_r, len(spec.targets), n_mlp_t)[1]
    # PEFT: gate and up each keep a float32 copy of the input (adapters) or share it (full)
    return 4 * b * shape.active_shape().intermediate_size + (8 * h + 12 * spec.lora_r * n_mlp_t if spec.adapter else b * h)


def _norm_work_bytes(spec: StepSpec) -> int:
    """A later moment of a layer's backward: its post-attention RMSNorm, after the MLP's tensors
    are gone. Transformers' norm computes in float32: five float32 hidden-size temporaries in its
    backward, plus its float32 copy of the input (16-bit steps) and the incoming and residual
    gradients (measured at the peak with the CPU meter, reference shape, bf16, 16k-32k tokens).
    Untiled, the MLP moment is larger; tiled, this one sets the peak unless the norm is lean
    (`maximus.kernels.lean_norm`, or the Triton one): float32 work for one block of rows, the input kept once."""
    b, h = spec.b, spec.shape.hidden_size
    norm_copy = 4 * h if b < 4 else 0
    return 2 * b * h if spec.lean_norm else 5 * 4 * h + norm_copy + 2 * b * h


def _layer_terms(spec: StepSpec, extras: AdapterTerms) -> LayerTerms:
    """What the layers keep for backward under the policy (offloaded, tiled), and a layer's backward."""
    shape, b, T = spec.shape, spec.b, spec.T
    h, wb, notes = shape.hidden_size, spec.weight_bytes, []
    per_off, per_full, per_sel, attn_work = _layer_saved_bytes(spec, extras)
    if spec.layout is not None and "selective" in policy_names(spec.checkpointing):
        notes.append("selective recompute with Kronecker Sketching: bounded by everything the sketch saves")
    per_layer, stored, host_acts = _kept_by_policy(spec, {"off": per_off, "full": per_full, "selective": per_sel})
    tile_fraction = _tile_fraction(spec)
    mlp_part = _mlp_saved_bytes(spec)
    # Attention masks shared by the layers of a kind live through forward and backward; an eager
    # attention's only when a checkpointed layer holds them for its recompute.
    masks = shape.sink_masks if not shape.attention_probs or any(m != "off" for m in spec.policy) else 0
    shared_masks = masks * (b + 1) * (spec.seq_len + 1)
    # Backward of one layer also holds the gradients flowing through it (hidden and MLP
    # intermediate, partly in float32): ~2*b*(h + i) bytes per token, measured, plus the
    # incoming hidden-state gradient; tiled, the intermediate part exists for one tile.
    grad_work = (shared_masks + 2 * b * (h + shape.active_shape().intermediate_size * tile_fraction) + 2 * h * b + attn_work
                 + shape.attention_backward_probs * eager_attention_bytes_per_token(shape, spec.seq_len))
    # Embedding output, final norm (float32 copy) and the head's input; a float32 master model
    # keeps a float32 residual stream; the lean final norm keeps its input, not a float32 copy.
    norm_copy = 4 * h if b < 4 else 0
    head_acts = ((2 * wb + 4) * h + extras.stream_bytes_per_token - (norm_copy if spec.lean_norm else 0)
                 + shared_masks)
    return LayerTerms(per_layer=per_layer, stored=stored, acts=int(T * (stored + head_acts)), host_acts=host_acts,
                      per_off=per_off, per_recomputed=tiled_layer_bytes_per_token(per_off, mlp_part, b, h, tile_fraction),
                      grad_work=grad_work, norm_moment=per_off - mlp_part + _norm_work_bytes(spec),
                      tile_fraction=tile_fraction, notes=notes)


def _backward_walk(spec: StepSpec, layers: LayerTerms) -> list[float]:
    """Bytes per token at each point of backward's walk, from the last layer down: at layer l, the
    layers below still hold what they kept, and a recomputed layer holds its full set of saved
    tensors again (one MLP tile of it when tiled) plus the gradients through it."""
    below, points = layers.stored, []
    for l in range(len(spec.policy) - 1, -1, -1):
        mode = spec.policy[l]
        below -= layers.per_layer[l]
        here = layers.per_recomputed if mode == "full" else layers.per_off if mode != "off" else layers.per_layer[l]
        points.append(max(below + here + layers.grad_work, below + layers.norm_moment if mode == "full" else 0.0))
    return points


def _backward_peak(spec: StepSpec, static: StaticTerms, walk: list[int]) -> tuple[int, int]:
    """(gradients, activations) at backward's worst moment, for the walk's bytes `walk` (from the
    last layer down). Full fine-tuning, one micro-step, gradients in .grad: a layer's weight
    gradients appear at its own backward, so at layer l only the head's (formed with the loss) and
    those of the layers from l up exist, and the embedding's is formed last, when the layers'
    activations are gone; otherwise every gradient is counted beside the walk's worst point."""
    worst = max(walk, default=0)
    if (spec.adapter or spec.optimizer_in_backward or spec.grad_accum > 1 or spec.shard > 1
            or static.vision is not None or not walk):
        return static.grads, worst
    shape = spec.shape
    per_param = static.grads / max(1, static.trainable)
    per_layer = (shape.layer_linear_params + shape.layer_other_params) * per_param
    head = ((shape.head_params or shape.embedding_params) + shape.hidden_size) * per_param
    at = max(range(len(walk)), key=lambda i: walk[i] + per_layer * (i + 1))
    grads_then = int(head + per_layer * (at + 1))
    # The end of backward: every gradient, the layers' tensors gone. A tied embedding's lookup
    # gradient meets the head's, which autograd held through the walk, and the two are summed out
    # of place: three vocabulary-sized buffers at once (measured: 776 MiB against 780 predicted,
    # the reference shape tied, 2 layers, fp32, CPU).
    end = static.grads + (2 * int(shape.embedding_params * per_param) if shape.tied_embeddings else 0)
    if walk[at] + grads_then <= end:
        return end, 0
    return grads_then, walk[at]


def _loss_terms(spec: StepSpec, trainable_head: bool) -> tuple[int, int]:
    """(working set of the loss, the chunk the loss uses when none is given)."""
    shape, T, b, V, h = spec.shape, spec.T, spec.b, spec.shape.vocab_size, spec.shape.hidden_size
    # A trainable head (full fine-tuning, a saved lm_head) has a larger chunk floor.
    default_chunk = default_loss_chunk(T, V, b, trainable_head=trainable_head)
    if spec.objective == "contrastive":
        return contrastive_loss_bytes(shape, T, b), default_chunk
    if spec.objective == "grpo" and spec.loss_mode == "exact":  # the head over the completion tokens only
        return completion_loss_bytes(spec, trainable_head)
    head_block = (head_block_bytes(shape, T, b, spec.master_weights)
                  if _outer_rows(spec) and spec.loss_mode == "exact" else 0)
    loss = head_loss_bytes(shape, spec.loss_mode, T, b, trainable_head=trainable_head,
                           chunk_tokens=spec.loss_chunk_tokens, default_chunk=default_chunk,
                           ghost_candidates=spec.ghost_candidates, head_block=head_block)
    if spec.matryoshka_dims and spec.objective == "sft":
        loss = matryoshka_loss_bytes(shape, loss, spec.loss_mode, T, b, trainable_head=trainable_head,
                                     dims=spec.matryoshka_dims, token_fraction=spec.matryoshka_token_fraction,
                                     chunk_tokens=spec.loss_chunk_tokens)
    if spec.master:  # the loss casts the float32 head to the 16-bit matmul dtype once per call
        loss += V * h * 2
    return loss, default_chunk


def _outer_rows(spec: StepSpec) -> bool:
    """The embedding and head updated row block by row block inside the backward (`steps_outer_rows`)."""
    return steps_outer_rows(spec.shape, spec.optimizer, full=spec.method == "full", in_backward=spec.optimizer_in_backward,
                            master_weights=spec.master_weights, embedding_optimizer=spec.embedding_optimizer)


def _workspace_terms(spec: StepSpec) -> int:
    """Scratch the step needs whatever the phase: dequantised 4-bit weights, CUDA's workspaces."""
    workspace = 0
    if spec.method == "qlora":
        # bitsandbytes dequantises a whole 4-bit weight to the compute dtype for each matmul.
        workspace += max(a * c for a, c in spec.shape.linear_shapes().values()) * spec.b
    if spec.device_type == "cuda":
        workspace += 64 * 2**20  # cuBLAS / attention workspaces and allocator slack
    return workspace


def _phases(spec: StepSpec, static: StaticTerms, layers: LayerTerms, walk: list[float], loss: int,
            workspace: int) -> dict[str, dict[str, int]]:
    """Each phase's gradients, activations, loss and workspace (the static part aside)."""
    T, grads = spec.T, static.grads
    # The head's weight gradient appears only after the loss's large buffers are gone, so the
    # loss phase holds gradients only when they accumulate over micro-steps.
    grads_before = grads if spec.grad_accum > 1 else 0
    step = static.step_temporaries
    bwd_grads, bwd_acts = _backward_peak(spec, static, [int(T * (v + static.extras.stream_bytes_per_token))
                                                        for v in walk])
    phases = {
        "loss": {"gradients": grads_before, "activations": layers.acts, "loss": loss, "workspace": workspace},
        # In backward, each weight's step runs there: its temporaries join the backward's peak.
        "backward": {"gradients": bwd_grads, "activations": bwd_acts, "loss": 0, "workspace": workspace,
                     "workspace_extra": step if spec.optimizer_in_backward else 0},
        "optimizer": {"gradients": grads, "activations": 0, "loss": 0, "workspace": workspace, "workspace_extra": step},
    }
    if spec.objective == "dpo" and spec.dpo_reference != "none":
        # The reference log-probs: a no-grad forward of the same rows (before each policy forward,
        # or once before training when precomputed): one layer's transients and one loss chunk.
        phases["reference"] = {
            "gradients": grads_before if spec.dpo_reference == "adapter_off" else 0,
            "activations": int(T * reference_forward_bytes_per_token(spec.shape, spec.b, spec.layout, spec.seq_len)),
            "loss": head_loss_bytes(spec.shape, spec.loss_mode, T, spec.b, trainable_head=False,
                                    chunk_tokens=spec.loss_chunk_tokens,
                                    default_chunk=default_loss_chunk(T, spec.shape.vocab_size, spec.b),
                                    ghost_candidates=spec.ghost_candidates, with_grad=False),
            "workspace": workspace}
    return phases


def _settings(spec: StepSpec, static: StaticTerms, tile_fraction: float) -> dict[str, Any]:
    """`Estimate.settings`: what the estimate assumed."""
    settings = dict(method=spec.method, dtype=spec.dtype, micro_batch=spec.micro_batch, seq_len=spec.seq_len,
                    checkpointing=spec.checkpointing, offload_activations=spec.offload_activations,
                    offload_optimizer=spec.offload_optimizer, loss_mode=spec.loss_mode,
                    loss_chunk_tokens=spec.loss_chunk_tokens if spec.loss_mode != "naive" else None,
                    optimizer=spec.optimizer, lora_r=spec.lora_r if spec.adapter else None,
                    world_size=spec.world_size, sharded=spec.shard > 1, device=spec.device_type,
                    tile_tokens=spec.tile_tokens if tile_fraction < 1.0 else None, lean_lora=spec.lean,
                    lean_norm=spec.lean_norm, attention=spec.attention, objective=spec.objective)
    if spec.layout is not None:
        settings["kronecker"] = spec.layout.to_dict()
    if spec.objective == "dpo":
        settings["dpo_reference"] = spec.dpo_reference
    if spec.objective == "grpo":
        settings["completion_tokens"] = spec.completion_tokens
    if spec.loss_mode == "ghost":
        settings["ghost_candidates"] = spec.ghost_candidates
    if spec.matryoshka_dims and spec.objective == "sft":
        settings.update(matryoshka_dims=list(spec.matryoshka_dims),
                        matryoshka_token_fraction=spec.matryoshka_token_fraction)
    if spec.offload_params:
        settings["offload_params"] = spec.params_store
    if spec.masked_attention:
        settings["masked_attention"] = True
    if static.extras.trainable_params or static.extras.layer_bytes_per_token:
        settings["adapter_terms"] = static.extras.to_dict()
    if static.vision is not None:
        settings["vision"] = static.vision.to_dict()
    settings.update(optimizer_settings(spec.optimizer, spec.optimizer_rank, spec.optimizer_in_backward,
                                       spec.master_weights, spec.embedding_optimizer))
    return settings


def estimate_peak(model_config: Any, *, method: Method = "lora", dtype: str = "bf16", micro_batch: int = 1,
                  seq_len: int = 2048, checkpointing: Checkpointing | Sequence[bool] | int = "off",
                  offload_activations: bool = False, offload_optimizer: bool = False, loss_mode: LossMode = "exact",
                  optimizer: str = "adamw", lora_r: int = 16, lora_targets: str | Sequence[str] = "all-linear",
                  world_size: int = 1, loss_chunk_tokens: int | None = None, grad_accum: int = 1,
                  ghost_candidates: int = 1024, device: str = "cuda", sharded: bool | None = None,
                  attention: Attention = "sdpa", kronecker: Any = None, objective: Objective = "sft",
                  dpo_reference: DpoReference = "adapter_off", matryoshka_dims: Sequence[int] | None = None,
                  matryoshka_token_fraction: float = 0.0625, offload_params: bool | str = False,
                  tile_tokens: int | None = None, lean_lora: bool = False, lean_norm: bool = True,
                  optimizer_rank: int | None = None, optimizer_in_backward: bool = False,
                  master_weights: str = "fp32", lora_experts: bool = True, grouped_experts: bool = True,
                  modules_to_save: Sequence[str] = (), use_dora: bool = False, lora_dropout: float = 0.0,
                  vision: Any = None, embedding_optimizer: str = "adamw", masked_attention: bool = False,
                  completion_tokens: int | None = None, qat: str = "off") -> Estimate:
    """Predict the peak memory of one training step (forward, backward, optimizer step).

    Args:
        model_config: transformers config, config.json dict or path, model directory, or a hub id
            in `KNOWN_SHAPES`.
        method: ``full``, ``lora`` or ``qlora`` (NF4 base with double quantisation).
        dtype: compute / weight dtype: ``bf16``, ``fp16`` or ``fp32``.
        micro_batch, seq_len: sequences per forward pass and tokens per sequence.
        checkpointing: ``off``, ``full``, ``selective``; or per layer a list of recompute modes
            (``none`` | ``selective`` | ``full``, as `Plan.recompute`) or of booleans (True = fully
            checkpointed); or an int = how many layers (the first ones) are fully checkpointed.
        offload_activations: checkpointed layer inputs live in host memory (prefetched back).
        offload_optimizer: optimizer state lives in host memory.
        loss_mode: ``naive`` (Transformers' loss on full logits), ``exact`` (chunked linear
            cross-entropy), ``ghost`` (sampled vocabulary).
        optimizer: a `training.optimizer` name (`maximus.memory.optimizer_state.OPTIMIZERS`).
        optimizer_rank: projection rank of apollo / apollo_mini / galore (None: their default).
        optimizer_in_backward: each parameter steps inside the backward and its gradient is freed
            (`training.optimizer_in_backward`): gradients of one or two weights at a time.
        master_weights: ``fp32`` (float32 master weights for 16-bit full fine-tuning) or ``bf16``
            (bf16 weights, stochastic rounding: no master copy).
        embedding_optimizer: ``adamw`` or ``adamw_4bit``: the embedding's and the head's moments
            under apollo / apollo_mini / galore / muon (`training.embedding_optimizer`).
        lora_r, lora_targets: adapter rank and targeted linear layers.
        lora_experts: a mixture of experts' MLP targets reach every expert (`lora.experts`);
            False: its expert layers carry no MLP adapters (no expert LoRA state).
        grouped_experts: `maximus.kernels.grouped_experts` runs the experts (on CPU,
            `optimization.grouped_experts`): the adapters stay factored; else Transformers'
            forward keeps PEFT's merged copy of each layer's expert weights for backward.
        world_size: data-parallel ranks; the estimate is per rank.
        sharded: whether FSDP2 shards the model over the ranks (`training.distributed: fsdp`).
            Default: yes for full and LoRA when world_size > 1 (what `auto` picks when one
            device cannot hold the run). QLoRA is never sharded (Maximus runs it under DDP:
            `fully_shard` cannot split NF4 weights). Sharded: weights, adapters, gradients and
            optimizer state are 1/world_size per rank, except a head tied to the embedding
            (kept whole); plus what FSDP2 gathers at once (two decoder layers, the embedding
            for the whole step, the head while the loss runs). Unsharded (DDP): every rank
            holds what one process would.
        loss_chunk_tokens: tokens per chunk of the exact / ghost loss (default: the loss's own).
        grad_accum: micro-steps per optimizer step (>1 keeps gradients alive during backward).
        device: ``cuda`` or ``cpu``: decides workspace and optimizer temporaries.
        ghost_candidates: hard-negative rows per chunk of the ghost loss
            (`optimization.ghost_logit.candidates`).
        attention: ``sdpa`` or ``kronecker`` (Kronecker Sketching, `kronecker` = its
            `KroneckerConfig` or a dict of detail_tokens / sketch_slots / block; None = defaults).
        objective: ``sft``, ``dpo`` (a micro-batch of N pairs is 2N rows: chosen and rejected),
            ``contrastive`` (2N rows: queries and positives; no vocabulary loss) or ``grpo`` (rows
            of prompt + completion, `seq_len` tokens each, of which `completion_tokens` carry the
            loss: the exact head runs over those only, `completion_loss_bytes`).
        dpo_reference: ``adapter_off`` (a no-grad reference forward of the same rows before
            each policy forward), ``precomputed`` (log-probs cached before training) or
            ``none`` (SimPO / ORPO need no reference).
        matryoshka_dims, matryoshka_token_fraction: the SFT Matryoshka auxiliary pass (prefix
            losses over a sampled share of the tokens); None = off.
        offload_params: frozen decoder weights (4-bit ones too) stream to the device one layer ahead
            (`optimization.offload.params`): True or ``on`` from pinned host memory, ``disk`` from a
            memory-mapped file (host memory then holds two pinned staging layers on CUDA); ``auto``
            and ``off`` are False here (the planner decides ``auto``).
        tile_tokens: the MLP of each fully recomputed layer runs over tiles of this many tokens
            in backward (`optimization.tile_tokens`); None: untiled.
        lean_norm: the RMSNorms are Maximus' lean ones (`optimization.lean_norm`, or the Triton
            kernel), else Transformers' float32 path with its float32 temporaries in backward.
        lean_lora: the adapters' projections are Maximus' lean ones (the input kept once, in the
            compute dtype); False: PEFT's own layers (what a plain Transformers + PEFT step keeps).
        vision: a vision-language model's tower and projector (`maximus.memory.vision_terms.VisionSpec`,
            from `vision_spec(cfg, config)`); None for a text model. The rows' image tokens are in `seq_len`.
        modules_to_save, use_dora, lora_dropout: `lora.modules_to_save` (full trained copies, e.g.
            embed_tokens, lm_head), DoRA and LoRA dropout (`maximus.memory.adapter_terms`); adapters only.
        masked_attention: SDPA gets a document mask (`MicroBatch.masked`: many short packed
            documents), which it keeps with keys and values repeated to every head.
        qat: `training.qat` (``off`` or a target): the cache of rounded weights joins the weights
            term (`qat_copy_bytes`).

    Returns:
        An `Estimate` whose breakdown (weights, adapters, gradients, optimizer, activations,
        loss, workspace) sums to `peak_bytes`.
    """
    return estimate_step(step_spec(
        model_config, method=method, dtype=dtype, micro_batch=micro_batch, seq_len=seq_len,
        checkpointing=checkpointing, offload_activations=offload_activations, offload_optimizer=offload_optimizer,
        loss_mode=loss_mode, optimizer=optimizer, lora_r=lora_r, lora_targets=lora_targets, world_size=world_size,
        loss_chunk_tokens=loss_chunk_tokens, grad_accum=grad_accum, ghost_candidates=ghost_candidates, device=device,
        sharded=sharded, attention=attention, kronecker=kronecker, objective=objective, dpo_reference=dpo_reference,
        matryoshka_dims=matryoshka_dims, matryoshka_token_fraction=matryoshka_token_fraction,
        offload_params=offload_params, tile_tokens=tile_tokens, lean_lora=lean_lora, lean_norm=lean_norm,
        optimizer_rank=optimizer_rank, optimizer_in_backward=optimizer_in_backward, master_weights=master_weights,
        lora_experts=lora_experts, grouped_experts=grouped_experts,
        modules_to_save=modules_to_save, use_dora=use_dora, lora_dropout=lora_dropout, vision=vision,
        embedding_optimizer=embedding_optimizer, masked_attention=masked_attention,
        completion_tokens=completion_tokens, qat=qat))


def estimate_step(spec: StepSpec) -> Estimate:
    """The `Estimate` of one step: static part + the largest of its phases (`estimate_peak`)."""
    static = _static_terms(spec)
    layers = _layer_terms(spec, static.extras)
    walk = _backward_walk(spec, layers)
    loss, default_chunk = _loss_terms(spec, static.trainable_head)
    phases = _phases(spec, static, layers, walk, loss, _workspace_terms(spec))
    if static.vision is not None:
        static.vision.add_to_phases(phases, static.grads if spec.grad_accum > 1 else 0)
    totals = {k: sum(v.values()) for k, v in phases.items()}
    phase = max(totals, key=totals.get)
    chosen = phases[phase]
    breakdown = {"weights": static.weights_dev, "adapters": static.adapters, "gradients": chosen["gradients"],
                 "optimizer": static.opt_dev, "activations": chosen["activations"], "loss": chosen["loss"],
                 "workspace": chosen["workspace"] + chosen.get("workspace_extra", 0)}
    peak = sum(breakdown.values())
    chunk_used = None if spec.loss_mode == "naive" else max(1, min(spec.loss_chunk_tokens or default_chunk, spec.T))
    flops, tps = _throughput(spec.shape, spec.method, spec.T, spec.seq_len, list(spec.policy), spec.offload_activations,
                             spec.offload_optimizer, spec.loss_mode, static.trainable, spec.grad_accum, spec.device_type,
                             spec.b, chunk_used, spec.lora_r, len(spec.targets), layers.tile_fraction)
    L = spec.shape.num_layers
    streamed_layers = static.streamed // max(1, L - STREAMED_IN_FLIGHT) * L  # every layer lives off the device
    per_layer = streamed_layers // L
    host_streamed, disk = (STAGING_LAYERS * per_layer, streamed_layers) if spec.params_store == "disk" else (
        streamed_layers, 0)
    # Forward fetches every layer but the first (resident since the last backward); backward every
    # layer but the last again (for the recompute and the input gradients).
    per_step = 2 * max(0, L - 1) * per_layer
    step_tps = tps
    if per_step:
        transfer_s = (per_step + per_layer) / DEFAULT_H2D_BYTES_PER_S  # the first layer's copy is not hidden
        step_tps = spec.T / max(spec.T / tps, transfer_s)
    return Estimate(peak_bytes=int(peak), breakdown={k: int(v) for k, v in breakdown.items()},
                    flops_per_token=flops, tokens_per_s_guess=step_tps, phase=phase,
                    settings=_settings(spec, static, layers.tile_fraction), notes=static.notes + layers.notes,
                    host_bytes=int(layers.host_acts + static.host_opt + host_streamed), disk_bytes=int(disk),
                    streamed_bytes_per_step=int(per_step), compute_tokens_per_s=tps)


def _throughput(shape: ModelShape, method: str, T: int, seq_len: int, policy: list[str], offload_act: bool,
                offload_opt: bool, loss_mode: str, trainable: int, grad_accum: int, device_type: str,
                dtype_bytes: int = 2, loss_chunk: int | None = None, lora_r: int = 16,
                lora_targets: int = 7, tile_fraction: float = 1.0) -> tuple[float, float]:
    """(training FLOPs per token, a tokens/s guess) used to rank plans against each other. The
    time is `maximus.memory.step_time.step_seconds`: op class by op class, measured rates."""
    from maximus.memory.step_time import step_seconds

    L = shape.num_layers
    layer_fwd = 2 * shape.layer_linear_params + 2 * seq_len * shape.q_dim  # causal attention: half of 4*s*d
    head_fwd = 2 * shape.vocab_size * shape.hidden_size
    fwd = L * layer_fwd + head_fwd
    # Backward: input gradients always (2x forward FLOPs for matmuls ~ 1x); weight gradients only
    # for trainable weights (full fine-tuning).
    bwd = fwd * (2.0 if method == "full" else 1.0)
    recompute = sum(layer_fwd if p == "full" else 0.08 * layer_fwd if p == "selective" else 0 for p in policy)
    flops = float(fwd + bwd + recompute)
    parts = step_seconds(hidden=shape.hidden_size, intermediate=shape.intermediate_size, q_dim=shape.q_dim,
                         kv_dim=shape.kv_dim, num_heads=shape.num_heads, head_dim=shape.head_dim,
                         vocab_size=shape.vocab_size, layer_linear_params=shape.layer_linear_params, tokens=T,
                         seq_len=seq_len, policy=policy, method=method, lora_r=lora_r, lora_targets=lora_targets,
                         dtype_bytes=dtype_bytes, device=device_type, loss_mode=loss_mode, loss_chunk=loss_chunk,
                         offload_activations=offload_act)
    seconds = sum(parts.values())
    if tile_fraction < 1.0:
        # Tiles run smaller MLP matmuls (the MLP forward is not repeated: see kernels/tiled_mlp.py).
        seconds *= 1.01 + 0.01 * math.log2(1.0 / tile_fraction)
    # The optimizer step is memory-bound: ~16 bytes touched per trainable parameter, once per
    # optimizer step (spread over grad_accum micro-steps of T tokens).
    bandwidth = 2e12 if device_type == "cuda" else 20e9
    if offload_opt:
        bandwidth = 20e9  # host-side update
    seconds += 16 * trainable / bandwidth / max(1, grad_accum)
    return flops, T / seconds
