"""What each optimizer keeps per trainable parameter, and what its step allocates: the data table
the estimator reads (`estimate_peak`), one row per `training.optimizer` name.

The figures follow the optimizers' own code (the packages named in `OPTIMIZERS`):

* AdamW keeps two moments of the parameter's size and dtype; bitsandbytes' 8-bit AdamW two uint8
  moments with a float32 absmax per block of 256 (~2 bytes); torchao's 4-bit AdamW two 4-bit
  moments with a scale per block of 128 for tensors of at least 4,096 values (~1.06 bytes), the
  small ones in full precision.
* APOLLO / APOLLO-Mini / GaLore project the gradient of each 2-D decoder weight (out x in) onto
  ``rank`` directions: the two moments are ``rank x max(out, in)`` and the projection
  ``rank x min(out, in)``; the embedding, the head and the norms get plain AdamW moments.
* Adam-mini keeps the first moment whole and one second moment per block (head, neuron, token):
  ~1 parameter-sized state.
* Muon keeps one momentum buffer per 2-D decoder weight; the embedding, the head and the norms are
  updated by AdamW (two moments), as Muon's authors prescribe.

`optimizer_state_bytes` and `optimizer_step_bytes` are what `estimate_peak` adds for the state
and for the step's temporaries; `in_backward_gradient_bytes` is what the gradients cost when each
parameter is updated inside the backward (`training.optimizer_in_backward`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["OPTIMIZERS", "OptimizerSpec", "PROJECTED", "optimizer_state_bytes", "optimizer_step_bytes",
           "in_backward_gradient_bytes", "projection_settings", "uses_bf16_weights", "optimizer_kwargs",
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

#: torchao's 4-bit moments: 4 bits each plus a scale per block of 128 (`torchao.optim.AdamW4bit`),
#: only for tensors of at least 4,096 values.
_FOUR_BIT_BYTES = 2 * (0.5 + 4 / 128)


def uses_bf16_weights(cfg: Any) -> bool:
    """Full fine-tuning with bf16 weights and stochastic rounding (`training.master_weights: bf16`)."""
    return cfg.method == "full" and cfg.training.master_weights == "bf16"


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


def optimizer_state_bytes(shape: Any, optimizer: str, *, full: bool, trainable: int, p_bytes: int,
                          rank: int | None = None) -> int:
    """Bytes of optimizer state for the trainable parameters of one process (before sharding).

    `full`: every weight trains (else `trainable` adapter values in float32, each a 2-D matrix);
    `p_bytes`: bytes per trainable value (the state's dtype follows the parameter's); `rank`: the
    projection rank (`training.optimizer_rank`) for apollo / apollo_mini / galore."""
    if optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        return 2 * trainable  # uint8 moments (absmax and code books: < 2 % on a real model)
    if optimizer == "adamw_4bit":
        # torchao quantises only tensors of at least 4,096 values, in whole blocks of 128.
        quantised = sum(n for n in _matrix_sizes(shape) if n >= 4096 and n % 128 == 0) if full else trainable
        return int(_FOUR_BIT_BYTES * quantised + 2 * p_bytes * (trainable - quantised))
    if optimizer == "adamw":
        return 2 * p_bytes * trainable
    if optimizer == "adam_mini":
        rows = shape.vocab_size * (1 if shape.tied_embeddings else 2)  # a second moment per token row
        return p_bytes * trainable + 4 * rows if full else p_bytes * trainable
    if optimizer == "muon":
        if not full:
            return p_bytes * trainable  # every adapter weight is a 2-D matrix: a momentum buffer
        return p_bytes * (shape.num_layers * shape.layer_linear_params + 2 * _other_params(shape))
    if optimizer in PROJECTED:
        r = projection_settings(optimizer, rank)["rank"]
        projected = sum(p_bytes * (2 * r * max(o, i) + r * min(o, i)) for o, i in _hidden_matrices(shape))
        return projected + 2 * p_bytes * _other_params(shape)
    from maximus.errors import ConfigError

    raise ConfigError(f"unknown optimizer {optimizer!r}", f"use one of {', '.join(OPTIMIZERS)}")


def optimizer_step_bytes(shape: Any, optimizer: str, *, full: bool, trainable: int, p_bytes: int, device: str,
                         rank: int | None = None) -> int:
    """Bytes the optimizer step allocates besides its state (its temporaries), on `device`.

    AdamW on CUDA runs foreach (one list-sized temporary); every other optimizer (and AdamW on a
    CPU) updates one tensor at a time, so its temporaries are a few copies of the largest one."""
    if optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        return 0  # bitsandbytes updates in place, block by block
    if optimizer == "adamw" and device == "cuda":
        return trainable * p_bytes
    if not full:
        return 0 if optimizer == "adamw" else 2 * p_bytes * max(1, trainable // (7 * 2 * max(1, shape.num_layers)))
    h, i, V = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    largest_hidden = max(o * n for o, n in _hidden_matrices(shape))
    embedding = V * h
    if optimizer == "adamw":
        return 2 * p_bytes * max(embedding, i * h)
    if optimizer == "adamw_4bit":
        # Compiled: float32 copies of the moments of the tensor being updated.
        return 2 * 4 * max(embedding, i * h)
    if optimizer == "adam_mini":
        return 2 * p_bytes * max(embedding, i * h)  # the update and the step size of one tensor
    if optimizer == "muon":
        # AdamW on the embedding (two temporaries); Newton-Schulz on the largest 2-D weight.
        return max(2 * p_bytes * embedding, 4 * p_bytes * largest_hidden)
    if optimizer in PROJECTED:
        # AdamW on the embedding; on a projected weight the scaled (or projected-back) gradient.
        return max(2 * p_bytes * embedding, 2 * p_bytes * largest_hidden)
    return 0


def in_backward_gradient_bytes(shape: Any, *, full: bool, trainable: int, p_bytes: int) -> int:
    """Gradient bytes alive at once when each parameter is stepped and its gradient freed inside
    the backward: the largest parameter's gradient, and the one autograd produces next to it."""
    if not full:
        return 2 * p_bytes * max(1, trainable // (7 * max(1, shape.num_layers)))
    h, i, V = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    return p_bytes * (V * h + i * h)


def optimizer_kwargs(cfg: Any) -> dict[str, Any]:
    """The `estimate_peak` keywords a Config's optimizer settings decide (`technique_kwargs`)."""
    t = cfg.training
    return dict(optimizer_rank=t.optimizer_rank, optimizer_in_backward=t.optimizer_in_backward,
                master_weights="bf16" if uses_bf16_weights(cfg) else "fp32")


def optimizer_settings(optimizer: str, rank: int | None, in_backward: bool, master_weights: str) -> dict[str, Any]:
    """What an estimate records of its optimizer beyond the name (only what is not the default)."""
    out: dict[str, Any] = {}
    if optimizer in PROJECTED:
        out["optimizer_rank"] = projection_settings(optimizer, rank)["rank"]
    if in_backward:
        out["optimizer_in_backward"] = True
    if master_weights != "fp32":
        out["master_weights"] = master_weights
    return out
