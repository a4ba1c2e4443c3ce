"""What each optimizer keeps per trainable parameter, and what its step allocates: the data table
the estimator reads (`estimate_peak`), one row per `training.optimizer` name.

The figures follow the optimizers' own code (the packages named in `OPTIMIZERS`):

* AdamW keeps two moments of the parameter's size and dtype; bitsandbytes' 8-bit AdamW two uint8
  moments with a float32 absmax per block of 256 (~2 bytes); torchao's 4-bit AdamW two 4-bit
  moments with a scale per block of 128 for tensors of at least 4,096 values (~1.06 bytes), the
  small ones in full precision; torchao's 8-bit AdamW (`adamw_8bit_torchao`) two uint8 moments
  with a scale per block of 256 (~2.03 bytes), under the same rule.
* APOLLO / APOLLO-Mini / GaLore project the gradient of each 2-D decoder weight (out x in) onto
  ``rank`` directions: the two moments are ``rank x max(out, in)`` and the projection
  ``rank x min(out, in)``; the embedding, the head and the norms get plain AdamW moments.
* Adam-mini keeps the first moment whole and one second moment per block (head, neuron, token):
  ~1 parameter-sized state.
* Muon keeps one momentum buffer per 2-D decoder weight; the embedding, the head and the norms are
  updated by AdamW (two moments), as Muon's authors prescribe.
* `training.embedding_optimizer: adamw_4bit` gives the embedding and the head of those four
  (APOLLO, APOLLO-Mini, GaLore, Muon) torchao's 4-bit moments instead of float32 AdamW ones.
* torchao's step (`adamw_4bit`, `adamw_8bit_torchao`, and AdamW with bf16 weights) runs on row chunks of at most
  `TORCHAO_CHUNK_VALUES` values (`maximus.train.optimizers`): its float32 copies of the weight,
  the gradient and the moments are those of one chunk, not of the whole embedding.

`optimizer_state_bytes` and `optimizer_step_bytes` are what `estimate_peak` adds for the state
and for the step's temporaries; `in_backward_gradient_bytes` is what the gradients cost when each
parameter is updated inside the backward (`training.optimizer_in_backward`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["OPTIMIZERS", "OptimizerSpec", "PROJECTED", "EMBEDDING_ON_ADAMW", "TORCHAO_ADAMW", "TORCHAO_CHUNK_VALUES", "optimizer_state_bytes", "optimizer_step_bytes",
           "in_backward_gradient_bytes", "steps_outer_rows", "row_block_rows", "head_block_bytes", "projection_settings", "optimizer_note",
           "optimizer_settings"]


@dataclass(frozen=True)
class OptimizerSpec:
    """One `training.optimizer` choice: where it comes from and where it applies."""

    name: str
    package: str | None  # import name; None = torch itself
    pip: str | None  # what `pip install` needs
    lora: bool  # meaningful on adapters (LoRA / QLoRA) too
    summary: str


OPTIMIZERS: dict[str, OptimizerSpec] = {s.name: s for s in (
    OptimizerSpec("adamw", None, None, True, "torch AdamW: two float32 moments per parameter"),
    OptimizerSpec("adamw_8bit", "bitsandbytes", "bitsandbytes", True, "bitsandbytes 8-bit AdamW"),
    OptimizerSpec("paged_adamw_8bit", "bitsandbytes", "bitsandbytes", True, "bitsandbytes paged 8-bit AdamW"),
    OptimizerSpec("adamw_4bit", "torchao", "torchao", True, "torchao 4-bit AdamW (4-bit moments, blocks of 128)"),
    OptimizerSpec("adamw_8bit_torchao", "torchao", "torchao", True,
                  "torchao 8-bit AdamW (8-bit moments, blocks of 256); inside the backward its embedding and head "
                  "step row block by row block, which bitsandbytes' adamw_8bit cannot"),
    OptimizerSpec("apollo", "apollo_torch", "apollo-torch", False,
                  "APOLLO: AdamW moments of a random rank-256 projection scale the raw gradient per channel"),
    OptimizerSpec("apollo_mini", "apollo_torch", "apollo-torch", False,
                  "APOLLO-Mini: rank 1, one scale per tensor: SGD-like memory"),
    OptimizerSpec("galore", "galore_torch", "galore-torch", False,
                  "GaLore: AdamW in the gradient's top-rank SVD subspace, refreshed every update_gap steps"),
    OptimizerSpec("adam_mini", "adam_mini", "adam-mini", True, "Adam-mini: one second moment per block"),
    OptimizerSpec("muon", None, None, True,
                  "Muon (torch.optim.Muon) for 2-D decoder weights, AdamW for embedding, head and norms"),
)}

#: Defaults of the gradient-projecting optimizers (their authors' recipes): rank, scale, and
#: APOLLO's scale granularity. `training.optimizer_rank` / `optimizer_scale` override them.
PROJECTED: dict[str, dict[str, Any]] = {
    "apollo": {"rank": 256, "scale": 1.0, "scale_type": "channel"},
    "apollo_mini": {"rank": 1, "scale": 128.0, "scale_type": "tensor"},
    "galore": {"rank": 128, "scale": 0.25},
}

#: The optimizers that leave the embedding, the head and the norms to AdamW; for them
#: `training.embedding_optimizer` may give the embedding and the head 4-bit moments instead.
EMBEDDING_ON_ADAMW = ("apollo", "apollo_mini", "galore", "muon")

#: torchao's quantised AdamW choices -> the bits of their moments.
TORCHAO_ADAMW = {"adamw_4bit": 4, "adamw_8bit_torchao": 8}

#: torchao's step runs on row chunks of at most this many values (a multiple of its block of 128).
TORCHAO_CHUNK_VALUES = 1 << 20

#: Chunk-sized float32 tensors alive at once in torchao's eager step (`single_param_adam`, the
#: 4-bit quantiser's int64 codes included), measured with the CPU meter on a 4 M-value tensor in
#: 1 M-value chunks: 6.0 with float32 weights, 10.25 with bf16 weights (stochastic rounding).
_TORCHAO_COPIES = {"fp32": 6, "bf16": 10.25}

#: Bytes per value of an APOLLO / GaLore step on a float32 copy of a bf16 weight rounded back
#: stochastically (`training.master_weights: bf16` inside the backward), measured with the CPU meter.
_ROUNDED_STEP_BYTES = 25

#: torchao's 4-bit moments: 4 bits each plus a scale per block of 128 (`torchao.optim.AdamW4bit`),
#: only for tensors of at least 4,096 values.
_FOUR_BIT_BYTES = 2 * (0.5 + 4 / 128)

#: torchao's 8-bit moments: a uint8 code each plus a scale per block of 256 (`torchao.optim.AdamW8bit`),
#: only for tensors of at least 4,096 values.
_EIGHT_BIT_BYTES = 2 * (1 + 4 / 256)


def projection_settings(optimizer: str, rank: int | None = None, scale: float | None = None) -> dict[str, Any]:
    """Rank, scale (and APOLLO's scale type) for a projecting optimizer; {} for the others."""
    if optimizer not in PROJECTED:
        return {}
    out = dict(PROJECTED[optimizer])
    if rank is not None:
        out["rank"] = int(rank)
    if scale is not None:
        out["scale"] = float(scale)
    return out


def _hidden_matrices(shape: Any) -> list[tuple[int, int]]:
    """(out, in) of every 2-D decoder weight of the model (all layers)."""
    return [(o, i) for i, o in shape.linear_shapes().values()] * shape.num_layers


def _matrix_sizes(shape: Any) -> list[int]:
    """Values of every 2-D weight: the decoder's, the embedding, an untied head."""
    return [o * i for o, i in _hidden_matrices(shape)] + [shape.embedding_params] + (
        [shape.head_params] if shape.head_params else [])


def _other_params(shape: Any) -> int:
    """Trainable values outside the 2-D decoder weights: embedding, head, norms, biases."""
    return shape.num_params - shape.num_layers * shape.layer_linear_params


def _quantisable(n: int, block: int = 128) -> bool:
    """torchao keeps quantised moments for tensors of at least 4,096 values in whole blocks
    (128 values for 4-bit, 256 for 8-bit)."""
    return n >= 4096 and n % block == 0


def _outer_matrices(shape: Any) -> list[int]:
    """Values of the embedding and an untied head: the 2-D weights outside the decoder layers."""
    return [shape.embedding_params] + ([shape.head_params] if shape.head_params else [])


def optimizer_state_bytes(shape: Any, optimizer: str, *, full: bool, trainable: int, p_bytes: int,
                          rank: int | None = None, embedding_optimizer: str = "adamw") -> int:
    """Bytes of optimizer state for the trainable parameters of one process (before sharding).

    `full`: every weight trains (else `trainable` adapter values in float32, each a 2-D matrix);
    `p_bytes`: bytes per trainable value (the state's dtype follows the parameter's); `rank`: the
    projection rank (`training.optimizer_rank`) for apollo / apollo_mini / galore;
    `embedding_optimizer`: `adamw_4bit` = 4-bit moments for the embedding and the head of the
    optimizers in `EMBEDDING_ON_ADAMW` (`training.embedding_optimizer`)."""
    if optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        return 2 * trainable  # uint8 moments (absmax and code books: < 2 % on a real model)
    if optimizer in TORCHAO_ADAMW:
        # torchao quantises only tensors of at least 4,096 values, in whole blocks of 128 (256).
        bits = TORCHAO_ADAMW[optimizer]
        block, per_value = (256, _EIGHT_BIT_BYTES) if bits == 8 else (128, _FOUR_BIT_BYTES)
        tensors = [n for n in _matrix_sizes(shape) if _quantisable(n, block)] if full else []
        quantised = sum(tensors) if full else trainable
        # Each quantised moment also holds its code book: 2**bits float32 values.
        books = 2 * len(tensors) * 4 * 2 ** bits
        return int(per_value * quantised + books + 2 * p_bytes * (trainable - quantised))
    if optimizer == "adamw":
        return 2 * p_bytes * trainable
    if optimizer == "adam_mini":
        rows = shape.vocab_size * (1 if shape.tied_embeddings else 2)  # a second moment per token row
        return p_bytes * trainable + 4 * rows if full else p_bytes * trainable
    if optimizer == "muon" and not full:
        return p_bytes * trainable  # every adapter weight is a 2-D matrix: a momentum buffer
    if optimizer in EMBEDDING_ON_ADAMW:
        outer = 2 * p_bytes * _other_params(shape)  # AdamW on embedding, head, norms
        if embedding_optimizer == "adamw_4bit":
            four = [n for n in _outer_matrices(shape) if _quantisable(n)]
            outer -= int((2 * p_bytes - _FOUR_BIT_BYTES) * sum(four))
        if optimizer == "muon":
            return p_bytes * shape.num_layers * shape.layer_linear_params + outer
        r = projection_settings(optimizer, rank)["rank"]
        return sum(p_bytes * (2 * r * max(o, i) + r * min(o, i)) for o, i in _hidden_matrices(shape)) + outer
    from maximus.errors import ConfigError

    raise ConfigError(f"unknown optimizer {optimizer!r}", f"use one of {', '.join(OPTIMIZERS)}")


def _torchao_step_bytes(largest: int, master_weights: str = "fp32") -> int:
    """torchao's step on one row chunk of the largest tensor it updates: float32 copies of the
    weight, the gradient, both moments and their new values (`_TORCHAO_COPIES`, measured)."""
    return int(_TORCHAO_COPIES[master_weights] * 4 * min(largest, TORCHAO_CHUNK_VALUES))


def optimizer_step_bytes(shape: Any, optimizer: str, *, full: bool, trainable: int, p_bytes: int, device: str,
                         rank: int | None = None, master_weights: str = "fp32",
                         embedding_optimizer: str = "adamw", rows: bool = False, in_backward: bool = False) -> int:
    """Bytes the optimizer step allocates besides its state (its temporaries), on `device`.

    AdamW on CUDA runs foreach (one list-sized temporary); every other optimizer (and AdamW on a
    CPU) updates one tensor at a time, so its temporaries are a few copies of the largest one;
    torchao's (`adamw_4bit`, bf16 weights, a 4-bit `embedding_optimizer`) of one row chunk.
    With `rows` (`steps_outer_rows`) the embedding's and the head's steps run outside the layers'
    backward (the head's in the loss: `head_block_bytes`), so what meets a layer's backward is
    the step of a decoder weight."""
    if rows and optimizer in PROJECTED and master_weights == "fp32":
        return 2 * p_bytes * max(o * n for o, n in _hidden_matrices(shape))
    if rows and optimizer == "muon":
        return 4 * p_bytes * max(o * n for o, n in _hidden_matrices(shape))
    if optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        return 0  # bitsandbytes updates in place, block by block
    torchao = optimizer in TORCHAO_ADAMW or (optimizer == "adamw" and master_weights == "bf16" and full)
    if optimizer == "adamw" and device == "cuda" and not torchao:
        return trainable * p_bytes
    if not full:
        return 0 if optimizer == "adamw" else 2 * p_bytes * max(1, trainable // (7 * 2 * max(1, shape.num_layers)))
    h, i, V = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    largest_hidden = max(o * n for o, n in _hidden_matrices(shape))
    embedding = V * h
    if torchao:
        return _torchao_step_bytes(max(embedding, i * h), master_weights if full else "fp32")
    if optimizer == "adamw":
        return 2 * p_bytes * max(embedding, i * h)
    if optimizer == "adam_mini":
        return 2 * p_bytes * max(embedding, i * h)  # the update and the step size of one tensor
    # AdamW on the embedding (two temporaries), or torchao's 4-bit step on one chunk of it.
    outer = _torchao_step_bytes(embedding) if embedding_optimizer == "adamw_4bit" else 2 * p_bytes * embedding
    if embedding_optimizer != "adamw_4bit" and not in_backward:
        # (Inside the backward each tensor has its own optimizer: nothing outlives its step.)
        # Their AdamW step on one tensor makes two temporaries, and the previous tensor's are
        # still referenced by the loop: the embedding's, while the head (next in its group) makes
        # its two. Measured on the reference shape at seq 256: predicted 0.91-0.92x of the peak
        # with two copies, for galore, apollo_mini and muon.
        outer += p_bytes * (shape.head_params or 0)
    if optimizer == "muon":
        return max(outer, 4 * p_bytes * largest_hidden)  # Newton-Schulz on the largest 2-D weight
    if optimizer in PROJECTED and master_weights == "bf16":
        # Inside the backward on a float32 copy of one bf16 weight, rounded back stochastically:
        # 25 bytes per value measured (the copy, the update, torchao's rounding temporaries).
        return max(outer, _ROUNDED_STEP_BYTES * largest_hidden)
    if optimizer in PROJECTED:
        return max(outer, 2 * p_bytes * largest_hidden)  # the scaled (or projected-back) gradient
    return 0


def steps_outer_rows(shape: Any, optimizer: str, *, full: bool, in_backward: bool, master_weights: str = "fp32",
                     embedding_optimizer: str = "adamw") -> bool:
    """Whether the embedding and an untied head are updated row block by row block where their
    gradients are formed, inside the backward (`maximus.train.optimizers.InBackwardOptimizer`):
    full fine-tuning inside the backward with torchao's step on them (`adamw_4bit`,
    `adamw_8bit_torchao`, AdamW with bf16 weights, or a 4-bit `embedding_optimizer`)."""
    torchao = outer_rows_on_torchao(optimizer, master_weights, embedding_optimizer) is not None
    return bool(full and in_backward and torchao and not shape.tied_embeddings)


def outer_rows_on_torchao(optimizer: str, master_weights: str = "fp32", embedding_optimizer: str = "adamw") -> str | None:
    """The setting that puts a full fine-tune's embedding and head on torchao's step (the config
    key and value, for messages), or None: `adamw_4bit` / `adamw_8bit_torchao`, AdamW with bf16
    weights, or a 4-bit `embedding_optimizer` beside an optimizer that leaves them to AdamW."""
    if optimizer in TORCHAO_ADAMW:
        return f"training.optimizer: {optimizer}"
    if optimizer == "adamw" and master_weights == "bf16":
        return "training.master_weights: bf16"
    if embedding_optimizer == "adamw_4bit" and optimizer in EMBEDDING_ON_ADAMW:
        return "training.embedding_optimizer: adamw_4bit"
    return None


def row_block_rows(shape: Any) -> int:
    """Rows of one block of the embedding / head (torchao's step chunk, `TORCHAO_CHUNK_VALUES`)."""
    return max(1, min(shape.vocab_size, TORCHAO_CHUNK_VALUES // shape.hidden_size))


def head_block_bytes(shape: Any, T: int, b: int, master_weights: str = "fp32") -> int:
    """Working set of one row block of a head stepped inside the loss's backward (`steps_outer_rows`),
    over T tokens: the block's float32 logits for every token, its gradient, the token-weighted
    hidden states, and torchao's step on the block."""
    rows, h = row_block_rows(shape), shape.hidden_size
    return T * rows * 4 + rows * h * 4 + T * h * 4 + _torchao_step_bytes(rows * h, master_weights)


def in_backward_gradient_bytes(shape: Any, *, full: bool, trainable: int, p_bytes: int, rows: bool = False) -> int:
    """Gradient bytes alive at once when each parameter is stepped and its gradient freed inside
    the backward: the largest parameter's gradient, and the one autograd produces next to it.
    With `rows` (`steps_outer_rows`) the embedding's and the head's gradients exist one row block
    at a time: the two largest decoder weights' gradients and one block."""
    if not full:
        return 2 * p_bytes * max(1, trainable // (7 * max(1, shape.num_layers)))
    h, i, V = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    if rows:
        return p_bytes * (2 * max(o * n for o, n in _hidden_matrices(shape)) + row_block_rows(shape) * h)
    return p_bytes * (V * h + i * h)


def optimizer_note(optimizer: str, rank: int | None, in_backward: bool, master_weights: str,
                   embedding_optimizer: str = "adamw") -> str | None:
    """The plan's line on the optimizer's settings (None for plain AdamW with float32 weights)."""
    parts = []
    if optimizer in PROJECTED:
        parts.append(f"rank {projection_settings(optimizer, rank)['rank']}")
    if optimizer in EMBEDDING_ON_ADAMW:
        parts.append("embedding and head on " + ("torchao 4-bit AdamW" if embedding_optimizer == "adamw_4bit"
                                                 else "float32-moment AdamW" if master_weights == "fp32" else "AdamW"))
    if in_backward:
        parts.append("step inside the backward")
    if master_weights == "bf16":
        parts.append("bf16 weights with stochastic rounding")
    if not parts and optimizer == "adamw":
        return None
    return f"optimizer {optimizer}" + (f": {', '.join(parts)}" if parts else "")


def optimizer_settings(optimizer: str, rank: int | None, in_backward: bool, master_weights: str,
                       embedding_optimizer: str = "adamw") -> dict[str, Any]:
    """What an estimate records of its optimizer beyond the name (only what is not the default)."""
    out: dict[str, Any] = {}
    if optimizer in EMBEDDING_ON_ADAMW and embedding_optimizer != "adamw":
        out["embedding_optimizer"] = embedding_optimizer
    if optimizer in PROJECTED:
        out["optimizer_rank"] = projection_settings(optimizer, rank)["rank"]
    if in_backward:
        out["optimizer_in_backward"] = True
    if master_weights != "fp32":
        out["master_weights"] = master_weights
    return out
