"""What a GRPO step adds to a training step's memory: sampling the group with the KV cache.

A GRPO step (`objective: grpo`, `maximus.train.objectives.grpo`) has two phases that never overlap:

1. **generation**, in `no_grad`: one prompt's `group_size` completions at a time, each decoding
   step holding the KV cache of `group_size x (prompt + completion)` tokens (K and V for every
   layer, `num_kv_heads x head_dim` each, in the compute dtype), the last position's logits
   `[group_size, V]` in float32 with the sampler's softmax / top-p copies of that size, and the
   resident state (weights, adapters, optimizer moments). Then the reference and sampling-policy
   log-prob passes (`no_grad`, one micro-batch at a time) cost less than the backward below.
2. **the backward**: an ordinary training step over `batch_size x group_size` completion rows of
   `seq_len + max_completion_tokens` tokens, `micro_batch_size` of them at a time, with the
   chunked head. That is what `maximus.memory.estimate.estimate_peak` models;
   `rollout_rows` gives it the rows and their length.

The step's peak is the larger of the two; `generation_peak_bytes` is phase 1.
"""
from __future__ import annotations

from typing import Any

#: Float32 copies of the last position's logits alive while sampling: the logits, the tempered
#: and top-p-filtered scores, the softmax probabilities.
SAMPLER_LOGIT_COPIES = 3


def rollout_rows(cfg) -> tuple[int, int]:
    """(completion rows per optimizer step, tokens per row) of a GRPO config: what the backward
    trains on, for the planner (`batch_size` prompts x `group_size`; prompt + completion tokens)."""
    g = cfg.grpo
    return cfg.training.batch_size * g.group_size, cfg.training.seq_len + g.max_completion_tokens


def kv_cache_bytes(model_config: Any, *, sequences: int, tokens: int, dtype_bytes: int) -> int:
    """K and V of every layer for `sequences` x `tokens` positions."""
    from maximus.memory.estimate import model_shape

    shape = model_shape(model_config)
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * sequences * tokens * dtype_bytes


def generation_peak_bytes(model_config: Any, *, resident_bytes: int, group_size: int, tokens: int,
                          dtype_bytes: int) -> dict[str, int]:
    """Phase 1 of the module doc: {"resident", "kv_cache", "logits", "total"} in bytes, for one
    group of `group_size` sequences of up to `tokens` (prompt + completion) tokens."""
    from maximus.memory.estimate import model_shape

    shape = model_shape(model_config)
    kv = kv_cache_bytes(shape, sequences=group_size, tokens=tokens, dtype_bytes=dtype_bytes)
    logits = SAMPLER_LOGIT_COPIES * group_size * shape.vocab_size * 4
    return {"resident": resident_bytes, "kv_cache": kv, "logits": logits, "total": resident_bytes + kv + logits}


def check_generation(model_config: Any, plan, cfg, *, budget: int | None) -> dict[str, int]:
    """`generation_peak_bytes` for a GRPO config and its training `plan` (the resident state is
    the plan's weights, adapters and optimizer moments; gradients are freed between steps).

    Raises BudgetError when a budget is set and generation does not fit in it."""
    from maximus.config import format_bytes
    from maximus.errors import BudgetError
    from maximus.memory.estimate import DTYPE_BYTES

    resident = sum(plan.breakdown.get(k, 0) for k in ("weights", "adapters", "optimizer"))
    g = cfg.grpo
    # The longest prompt the data has (planned from it) or the cap, plus the longest completion.
    tokens = plan.rows_tokens_max or cfg.training.seq_len + g.max_completion_tokens
    parts = generation_peak_bytes(model_config, resident_bytes=resident, group_size=g.group_size, tokens=tokens,
                                  dtype_bytes=DTYPE_BYTES[plan.dtype])
    if budget is not None and parts["total"] > budget:
        raise BudgetError(f"GRPO generation needs about {format_bytes(parts['total'])} (KV cache "
                          f"{format_bytes(parts['kv_cache'])} for {g.group_size} x {tokens} tokens, on top of "
                          f"{format_bytes(resident)} of weights and optimizer state), over the budget of "
                          f"{format_bytes(budget)}", "lower grpo.group_size, grpo.max_completion_tokens or "
                          "training.seq_len (the longest prompt), or use method: qlora")
    return parts
