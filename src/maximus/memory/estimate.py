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
* ``backward``: the end of backward: all gradients plus one layer being recomputed;
* ``optimizer``: the optimizer step: all gradients plus the step's temporaries.

`Estimate.breakdown` splits the peak into weights, adapters, gradients, optimizer, activations,
loss and workspace, summing exactly to `peak_bytes`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

from maximus.errors import ConfigError, ModelError

Method = Literal["full", "lora", "qlora"]
LossMode = Literal["naive", "exact", "ghost"]
Checkpointing = Literal["off", "full", "selective"]

__all__ = ["Estimate", "ModelShape", "KNOWN_SHAPES", "estimate_peak", "model_shape", "load_model_config",
           "DTYPE_BYTES", "DEVICE_FLOPS"]

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}

#: Sustained matmul rate assumed when ranking plans, in FLOP/s (bf16). Only ratios matter:
#: the planner compares plans on one device. CPU: measured on the 2-core reference machine.
DEVICE_FLOPS = {"cuda": 300e12, "cpu": 0.83e12, "mps": 10e12}

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
    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in self.linear_shapes().values())

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
    return ModelShape(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_layers=layers, num_heads=heads,
                      num_kv_heads=kv, head_dim=head_dim, tied_embeddings=bool(_get(cfg, "tie_word_embeddings", default=False)),
                      qkv_bias=qkv_bias, mlp_bias=bool(_get(cfg, "mlp_bias", default=False)))


# ------------------------------------------------------------------------------------------------
# Saved activations of one decoder layer, bytes per token.
#
# Measured with saved_tensors_hooks on Transformers 5 LlamaDecoderLayer (SDPA), varying one
# dimension at a time (docs/planner.md "Where the coefficients come from"):
#   bytes/token = ch*h + ci*i + cq*q_dim + ckv*kv_dim + 4*heads (float32 log-sum-exp)
#                 + 4*r per LoRA-targeted linear (its float32 down-projection output).
# "adapter" = LoRA/QLoRA (frozen base, float32 adapters: PEFT casts each adapter input to
# float32, hence the larger hidden coefficient in 16-bit); "full" = every weight trainable.
_LAYER_COEF = {  # (trainable, dtype bytes) -> (ch, ci, cq, ckv)
    ("full", 2): (16, 8, 4, 4),
    ("full", 4): (24, 16, 8, 8),
    ("adapter", 2): (28, 10, 8, 4),
    ("adapter", 4): (16, 16, 8, 8),
}


def layer_activation_bytes_per_token(shape: ModelShape, method: str, dtype_bytes: int, lora_r: int,
                                     n_targets: int, policy: str = "off") -> float:
    """Bytes one decoder layer keeps for backward, per token, under a checkpointing policy.

    ``off``: everything autograd saves; ``full``: the layer input only; ``selective``: the
    outputs of matmuls and attention (the cheap element-wise ops are recomputed).
    """
    b = dtype_bytes
    if policy == "full":
        return shape.hidden_size * b
    if policy == "selective":
        h, i = shape.hidden_size, shape.intermediate_size
        kept = h + shape.q_dim + 2 * shape.kv_dim + shape.q_dim + h + 2 * i + h
        return kept * b + 4 * shape.num_heads + (4 * lora_r * n_targets if method != "full" else 0)
    kind = "full" if method == "full" else "adapter"
    ch, ci, cq, ckv = _LAYER_COEF[(kind, 4 if b >= 4 else 2)]
    per = (ch * shape.hidden_size + ci * shape.intermediate_size + cq * shape.q_dim + ckv * shape.kv_dim
           + 4 * shape.num_heads)
    if method != "full":
        per += 4 * lora_r * n_targets
    return float(per)


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

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "breakdown": dict(self.breakdown), "phase": self.phase,
                "flops_per_token": self.flops_per_token, "tokens_per_s_guess": self.tokens_per_s_guess,
                "settings": dict(self.settings)}


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


def estimate_peak(model_config: Any, *, method: Method = "lora", dtype: str = "bf16", micro_batch: int = 1,
                  seq_len: int = 2048, checkpointing: Checkpointing | Sequence[bool] | int = "off",
                  offload_activations: bool = False, offload_optimizer: bool = False, loss_mode: LossMode = "exact",
                  optimizer: str = "adamw", lora_r: int = 16, lora_targets: str | Sequence[str] = "all-linear",
                  world_size: int = 1, loss_chunk_tokens: int | None = None, grad_accum: int = 1,
                  ghost_candidates: int = 1024, device: str = "cuda", sharded: bool | None = None) -> Estimate:
    """Predict the peak memory of one training step (forward, backward, optimizer step).

    Args:
        model_config: transformers config, config.json dict or path, model directory, or a hub id
            in `KNOWN_SHAPES`.
        method: ``full``, ``lora`` or ``qlora`` (NF4 base with double quantisation).
        dtype: compute / weight dtype: ``bf16``, ``fp16`` or ``fp32``.
        micro_batch, seq_len: sequences per forward pass and tokens per sequence.
        checkpointing: ``off``, ``full``, ``selective``; or per layer a list of booleans
            (True = fully checkpointed) or an int = how many layers are fully checkpointed.
        offload_activations: checkpointed layer inputs live in host memory (prefetched back).
        offload_optimizer: optimizer state lives in host memory.
        loss_mode: ``naive`` (Transformers' loss on full logits), ``exact`` (chunked linear
            cross-entropy), ``ghost`` (sampled vocabulary).
        optimizer: ``adamw``, ``adamw_8bit`` or ``paged_adamw_8bit``.
        lora_r, lora_targets: adapter rank and targeted linear layers.
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

    Returns:
        An `Estimate` whose breakdown (weights, adapters, gradients, optimizer, activations,
        loss, workspace) sums to `peak_bytes`.
    """
    shape = model_shape(model_config)
    if method not in ("full", "lora", "qlora"):
        raise ConfigError(f"method must be full, lora or qlora for an estimate, got {method!r}",
                          "the planner resolves method: auto")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}", "use bf16, fp16 or fp32")
    if loss_mode not in ("naive", "exact", "ghost"):
        raise ConfigError(f"unknown loss mode {loss_mode!r}", "use exact, naive or ghost")
    if micro_batch < 1 or seq_len < 1 or world_size < 1:
        raise ConfigError("micro_batch, seq_len and world_size must be positive", "check training.* keys")
    b = DTYPE_BYTES[dtype]
    device_type = str(device).split(":")[0]
    L, h, V = shape.num_layers, shape.hidden_size, shape.vocab_size
    T = micro_batch * seq_len
    adapter = method != "full"
    targets = _targets(shape, lora_targets) if adapter else []
    lin = shape.linear_shapes()

    # -- static: weights, adapters, optimizer state ---------------------------------------------
    non_linear = L * shape.layer_other_params + shape.embedding_params + shape.head_params + h
    linear = L * shape.layer_linear_params
    if method == "qlora":
        # NF4: 4 bits per weight; blocks of 64 with a uint8 absmax, itself quantised in blocks of
        # 256 with a float32 absmax (double quantisation): 0.127 extra bits per weight.
        weights = int(linear * (0.5 + 1 / 64 + 4 / (64 * 256))) + non_linear * b
    else:
        weights = (linear + non_linear) * b
    if sharded is None:
        sharded = world_size > 1
    shard = world_size if (sharded and world_size > 1 and method != "qlora") else 1
    # A head tied to the embedding stays whole on every rank (maximus.train.distributed).
    whole = shape.embedding_params if (shard > 1 and shape.tied_embeddings) else 0
    weights_dev = (weights - whole * b) // shard + whole * b
    if shard > 1:
        # Gathered at once: two decoder layers (the running one, the prefetched one), the root
        # unit (embedding, final norm) for the whole step, the head while the loss runs.
        weights_dev += (2 * (shape.layer_linear_params + shape.layer_other_params)
                        + (shape.embedding_params + shape.head_params if not whole else 0)) * b

    n_adapter = L * sum(lora_r * (lin[t][0] + lin[t][1]) for t in targets)
    adapters = 4 * n_adapter // shard  # PEFT keeps adapters in float32 (autocast_adapter_dtype)
    trainable = n_adapter if adapter else shape.num_params
    p_bytes = 4 if adapter else b
    if optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        state_bytes = 2  # per trainable parameter
    elif optimizer == "adamw":
        state_bytes = 2 * p_bytes
    else:
        raise ConfigError(f"unknown optimizer {optimizer!r}", "use adamw, adamw_8bit or paged_adamw_8bit")
    replicated = 0 if adapter else whole  # a trainable tied embedding: whole gradient and moments
    per_rank_trainable = (trainable - replicated) / shard + replicated
    grads = int(per_rank_trainable * p_bytes)
    states = int(per_rank_trainable * state_bytes)
    opt_dev = 0 if offload_optimizer else states

    # -- activations ----------------------------------------------------------------------------
    n_t = len(targets)
    per_off = layer_activation_bytes_per_token(shape, method, b, lora_r, n_t, "off")
    per_full = layer_activation_bytes_per_token(shape, method, b, lora_r, n_t, "full")
    per_sel = layer_activation_bytes_per_token(shape, method, b, lora_r, n_t, "selective")
    if isinstance(checkpointing, str):
        if checkpointing not in ("off", "full", "selective"):
            raise ConfigError(f"unknown checkpointing {checkpointing!r}", "use off, full or selective")
        policy = [checkpointing] * L
    elif isinstance(checkpointing, int):
        k = max(0, min(L, checkpointing))
        policy = ["full"] * k + ["off"] * (L - k)
    else:
        flags = list(checkpointing)
        if len(flags) != L:
            raise ConfigError(f"per-layer checkpointing needs {L} entries, got {len(flags)}", "one boolean per layer")
        policy = ["full" if f else "off" for f in flags]
    kept = {"off": per_off, "full": per_full, "selective": per_sel}
    per_layer = [0.0 if (p == "full" and offload_activations) else kept[p] for p in policy]  # offloaded: on host
    recomputing = any(p != "off" for p in policy)
    in_flight = 2 * per_full if (offload_activations and recomputing) else 0.0  # prefetch one layer ahead
    stored = sum(per_layer) + in_flight
    # Backward walks the layers from the last: at layer l, the layers below still hold what they
    # kept, and a recomputed layer holds its full set of saved tensors again.
    below = stored
    bwd_layers = 0.0
    for l in range(L - 1, -1, -1):
        below -= per_layer[l]
        here = per_off if policy[l] != "off" else per_layer[l]
        bwd_layers = max(bwd_layers, below + here)
    # Backward of one layer also holds the gradients flowing through it (hidden and MLP
    # intermediate, partly in float32): ~2*b*(h + i) bytes per token, measured, plus the
    # incoming hidden-state gradient.
    grad_work = 2 * b * (h + shape.intermediate_size) + 2 * h * b
    # Embedding output, final norm (float32 copy) and the head's input.
    head_acts = (2 * b + 4) * h
    acts = int(T * (stored + head_acts))

    # -- loss working set -----------------------------------------------------------------------
    # The chunk the loss uses when none is given (a trainable head has a larger floor).
    default_chunk = default_loss_chunk(T, V, b, trainable_head=not adapter)
    if loss_mode == "naive":
        # Transformers' loss: float32 logits, log-softmax output and, in backward, its incoming
        # and outgoing gradients; the 16-bit logits die after forward (the trainer keeps only
        # the loss): 12 bytes per logit at the start of backward (10 during forward).
        loss = T * V * 12
    else:
        chunk = max(1, min(loss_chunk_tokens or default_chunk, T))
        per_logit = 4 + (b if b < 4 else 0)
        if loss_mode == "exact":
            width = V
        else:
            width = min(V, ghost_candidates + chunk)
        # one chunk of logits + the hidden-state gradient buffer and the shifted hidden copy
        loss = chunk * width * per_logit + 2 * T * h * b
        if not adapter:  # trainable head: float32 gradient accumulator over chunks
            loss += V * h * 4
    # Per-token scratch of the head (labels, log-sum-exp, losses): small but not zero.
    loss += T * 24

    # -- workspace ------------------------------------------------------------------------------
    workspace = 0
    if method == "qlora":
        # bitsandbytes dequantises a whole 4-bit weight to the compute dtype for each matmul.
        workspace += max(a * c for a, c in lin.values()) * b
    if device_type == "cuda":
        workspace += 64 * 2**20  # cuBLAS / attention workspaces and allocator slack

    # -- phases ---------------------------------------------------------------------------------
    # The head's weight gradient appears only after the loss's large buffers are gone, so the
    # loss phase holds gradients only when they accumulate over micro-steps.
    grads_before = grads if grad_accum > 1 else 0
    phases = {
        "loss": {"gradients": grads_before, "activations": acts, "loss": loss},
        "backward": {"gradients": grads, "activations": int(T * (bwd_layers + grad_work)), "loss": 0},
        "optimizer": {"gradients": grads, "activations": 0,
                      "loss": 0, "workspace_extra": _optimizer_temporaries(trainable, p_bytes, optimizer, device_type,
                                                                           shape, adapter, offload_optimizer) // shard},
    }
    totals = {k: sum(v.values()) for k, v in phases.items()}
    phase = max(totals, key=totals.get)
    chosen = phases[phase]
    breakdown = {
        "weights": weights_dev,
        "adapters": adapters,
        "gradients": chosen["gradients"],
        "optimizer": opt_dev,
        "activations": chosen["activations"],
        "loss": chosen["loss"],
        "workspace": workspace + chosen.get("workspace_extra", 0),
    }
    peak = sum(breakdown.values())

    chunk_ratio = 1.0
    if loss_mode != "naive":
        chunk_ratio = max(1.0, default_chunk / max(1, min(loss_chunk_tokens or T, T)))
    flops, tps = _throughput(shape, method, T, seq_len, policy, offload_activations, offload_optimizer,
                             loss_mode, trainable, grad_accum, device_type, chunk_ratio)
    settings = dict(method=method, dtype=dtype, micro_batch=micro_batch, seq_len=seq_len,
                    checkpointing=checkpointing if isinstance(checkpointing, (str, int)) else list(checkpointing),
                    offload_activations=offload_activations, offload_optimizer=offload_optimizer,
                    loss_mode=loss_mode, loss_chunk_tokens=loss_chunk_tokens if loss_mode != "naive" else None,
                    optimizer=optimizer, lora_r=lora_r if adapter else None, world_size=world_size, sharded=shard > 1,
                    device=device_type)
    return Estimate(peak_bytes=int(peak), breakdown={k: int(v) for k, v in breakdown.items()},
                    flops_per_token=flops, tokens_per_s_guess=tps, phase=phase, settings=settings)


def _optimizer_temporaries(trainable: int, p_bytes: int, optimizer: str, device_type: str, shape: ModelShape,
                           adapter: bool, offloaded: bool) -> int:
    """Bytes the optimizer step allocates on the device besides its state."""
    if offloaded:
        return 0
    if optimizer != "adamw":
        return 0  # bitsandbytes updates in place, block by block
    if device_type == "cuda":
        return trainable * p_bytes  # foreach AdamW: one list-sized temporary (sqrt of exp_avg_sq)
    # CPU AdamW runs one tensor at a time: two temporaries of the largest parameter.
    largest = max(shape.embedding_params, shape.intermediate_size * shape.hidden_size) if not adapter else 0
    return 2 * largest * p_bytes


def _throughput(shape: ModelShape, method: str, T: int, seq_len: int, policy: list[str], offload_act: bool,
                offload_opt: bool, loss_mode: str, trainable: int, grad_accum: int, device_type: str,
                chunk_ratio: float = 1.0) -> tuple[float, float]:
    """(training FLOPs per token, a tokens/s guess) used to rank plans against each other."""
    L = shape.num_layers
    layer_fwd = 2 * shape.layer_linear_params + 2 * seq_len * shape.q_dim  # causal attention: half of 4*s*d
    head_fwd = 2 * shape.vocab_size * shape.hidden_size
    fwd = L * layer_fwd + head_fwd
    # Backward: input gradients always (2x forward FLOPs for matmuls ~ 1x); weight gradients only
    # for trainable weights (full fine-tuning).
    bwd = fwd * (2.0 if method == "full" else 1.0)
    recompute = sum(layer_fwd if p == "full" else 0.08 * layer_fwd if p == "selective" else 0 for p in policy)
    flops = float(fwd + bwd + recompute)
    rate = DEVICE_FLOPS.get(device_type, DEVICE_FLOPS["cuda"])
    efficiency = T / (T + 1024.0)  # small micro-batches leave the device under-used
    seconds = flops / (rate * 0.5 * efficiency)
    if method == "qlora":
        seconds *= 1.15  # dequantising NF4 weights on every matmul
    if loss_mode == "exact":
        seconds *= 1.02
    # Chunks smaller than the loss's default run smaller, less efficient matmuls.
    seconds *= 1 + 0.02 * math.log2(chunk_ratio)
    if offload_act:
        seconds *= 1.05  # copies mostly hidden behind compute
    # The optimizer step is memory-bound: ~16 bytes touched per trainable parameter, once per
    # optimizer step (spread over grad_accum micro-steps of T tokens).
    bandwidth = 2e12 if device_type == "cuda" else 20e9
    if offload_opt:
        bandwidth = 20e9  # host-side update
    seconds += 16 * trainable / bandwidth / max(1, grad_accum) / max(T, 1)
    return flops, 1.0 / seconds
