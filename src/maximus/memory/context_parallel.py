"""What context parallelism (`training.context_parallel`) does to the memory of one rank.

Over ``N`` ranks each rank holds ``1/N`` of every row's tokens: everything the one-card estimate
counts per token (saved layer inputs, tiles, the loss chunks, offloaded activations) is that of a
``T / N``-token row, and the weights and optimizer state are whole on every rank (DDP). On top,
Ulysses' exchange holds, while one layer's attention runs, copies of that layer's queries, keys
and values (sent, received, reordered to the row's order) and of its output (computed, reordered,
sent, received): `exchange_bytes_per_token` per local token. So the longest row over ``N`` ranks
is ``N`` times the longest local share whose one-card plan fits the budget less those buffers.
Under autograd the queries, keys and values reordered for the whole row are kept for SDPA's
backward (one copy); the output's way back holds at once the output, its reordered copy, the
send and the receive buffer (four copies of the output).

Ring attention is not counted here: its score tile is ``(T / 2N)^2`` per head (fp32), which only
suits rows of a few thousand tokens per rank; the planner's figures assume Ulysses (query heads
divisible by ``N``).
"""
from __future__ import annotations

from typing import Any

#: Copies of a layer's queries, keys and values, and of its attention output, the all-to-all holds at once.
QKV_COPIES = 1
OUTPUT_COPIES = 4


def exchange_bytes_per_token(model_config: Any, degree: int, dtype_bytes: int = 2) -> int:
    """Bytes per local token of Ulysses' exchange buffers for one layer (0 at degree 1). Key/value
    heads that do not divide by `degree` travel repeated up to the query heads."""
    from maximus.memory.shape import model_shape

    if degree == 1:
        return 0
    shape = model_shape(model_config)
    kv_heads = shape.num_kv_heads if shape.num_kv_heads % degree == 0 else shape.num_heads
    per_head = shape.head_dim * dtype_bytes
    return per_head * (QKV_COPIES * (shape.num_heads + 2 * kv_heads) + OUTPUT_COPIES * shape.num_heads)


def longest_context_over_ranks(model_config: Any, budget_bytes: int, degree: int, *, dtype_bytes: int = 2,
                               micro_batch: int = 1, **plan_kw: Any) -> int:
    """The longest row (tokens, a multiple of ``2 * degree``) that `degree` ranks of `budget_bytes`
    each train together: `degree` x the longest local share ``s`` whose one-card plan fits
    `budget_bytes` less ``s`` x `exchange_bytes_per_token`. `model_config`: a `RunSpec`, or
    anything `model_shape` reads with `plan_for_budget` keywords in `plan_kw` (every memory knob
    allowed; the method defaults to qlora, as for `max_seq_len_for_budget`)."""
    from maximus.memory.planner import fits_at, max_seq_len_for_budget, spec_of

    spec = spec_of(model_config, plan_kw, method="qlora")
    alone = max_seq_len_for_budget(spec, budget_bytes, micro_batch=micro_batch)
    per_token = exchange_bytes_per_token(spec.shape, degree, dtype_bytes) * micro_batch
    if not per_token:
        return alone

    def fits(local: int) -> bool:
        room = budget_bytes - per_token * local
        return room > 0 and fits_at(spec, room, micro_batch)(local)

    lo, hi = 0, alone + 1  # invariant: fits(lo) (or lo = 0), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * degree // (2 * degree) * (2 * degree)


def longest_over_cards(model_config: Any, budget_bytes: int, gpus: int, **longest_kw: Any) -> dict[int, int]:
    """{cards: longest row in tokens} for 1, 2, 4, ... up to `gpus` cards of `budget_bytes` each."""
    degrees = [1 << k for k in range(gpus.bit_length()) if 1 << k <= gpus]
    return {n: longest_context_over_ranks(model_config, budget_bytes, n, **longest_kw) for n in degrees}


def fewest_cards(longest: dict[int, int], seq_len: int) -> int | None:
    """The smallest context-parallel degree of `longest` ({cards: tokens}) whose row holds
    `seq_len` tokens; None when none does."""
    return next((n for n, tokens in sorted(longest.items()) if tokens >= seq_len), None)


def rank_activation_bytes(model_config: Any, seq_len: int, degree: int, *, dtype_bytes: int = 2,
                          **estimate_kw: Any) -> int:
    """Predicted activation bytes of one rank (the step's peak less weights, gradients and
    optimizer state) for rows of `seq_len` tokens split over `degree` ranks: the one-card
    estimate (`estimate_peak` keywords in `estimate_kw`) at ``seq_len / degree`` tokens plus
    Ulysses' exchange buffers for those tokens."""
    from maximus.memory.estimate import estimate_peak

    local = seq_len // degree
    activations = estimate_peak(model_config, seq_len=local, **estimate_kw).breakdown["activations"]
    return int(activations + exchange_bytes_per_token(model_config, degree, dtype_bytes) * local)
