"""What context parallelism (`training.context_parallel`) does to the memory of one rank.

Over ``N`` ranks each rank holds ``1/N`` of every row's tokens: everything the one-card estimate
counts per token (saved layer inputs, tiles, the loss chunks, offloaded activations) is that of a
``T / N``-token row, and the weights and optimizer state are whole on every rank (DDP) or
``1/N`` of them (FSDP2, which shards over every rank, the ones that share rows included). On top,
Ulysses' exchange holds, while one layer's attention runs, copies of that layer's queries, keys
and values (sent, received, reordered to the row's order) and of its output (computed, reordered,
sent, received): `maximus.memory.context_exchange.exchange_bytes_per_token` per local token. The estimator counts both
(`maximus.memory.estimate.context_split_estimate`), and the planner picks the degree from it
(``context_parallel: auto``).
Under autograd the queries, keys and values reordered for the whole row are kept for SDPA's
backward (one copy); the output's way back holds at once the output, its reordered copy, the
send and the receive buffer (four copies of the output).

Ring attention is not counted here: its score tile is ``(T / 2N)^2`` per head (fp32), which only
suits rows of a few thousand tokens per rank; the planner's figures assume Ulysses (query heads
divisible by ``N``).
"""
from __future__ import annotations

from typing import Any, Callable

from maximus.memory.context_exchange import exchange_bytes_per_token


def longest_context_over_ranks(model_config: Any, budget_bytes: int, degree: int, *, micro_batch: int = 1,
                               sharded: bool = False, **plan_kw: Any) -> int:
    """The longest row (tokens, a multiple of ``2 * degree``) that `degree` ranks of `budget_bytes`
    each train together: the longest for which `plan_for_budget` finds a plan at
    ``context_parallel = degree`` (each rank's estimate: its ``1 / degree`` of the row plus the
    exchange buffers, `maximus.memory.estimate.context_split_estimate`), so it agrees with the
    degree ``context_parallel: auto`` picks. `model_config`: a `RunSpec`, or anything
    `model_shape` reads with `plan_for_budget` keywords in `plan_kw` (every memory knob allowed;
    the method defaults to qlora, as for `max_seq_len_for_budget`). ``sharded``: the ranks run FSDP2
    (weights, gradients and optimizer state 1 / `degree` on each: `RunSpec.strategy`); else DDP
    (whole on each)."""
    from maximus.memory.planner import fits_at, max_seq_len_for_budget, spec_of

    spec = spec_of(model_config, plan_kw, method="qlora").searching(context_parallel=1)
    alone = max_seq_len_for_budget(spec, budget_bytes, micro_batch=micro_batch)
    if degree == 1:
        return alone
    split = spec.searching(context_parallel=degree).strategy(sharded)
    fits, step = fits_at(split, budget_bytes, micro_batch), 2 * degree
    lo, hi = 0, (alone + 1) * degree // step + 1  # in steps of 2 x degree tokens: fits(lo) (or 0), not fits(hi)
    while sharded and fits(hi * step):  # sharded weights leave a rank more than one card has for its share
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step


def longest_over_cards(model_config: Any, budget_bytes: int, gpus: int,
                       shardings: Callable[[int], tuple[bool, ...]] = lambda cards: (False,),
                       **longest_kw: Any) -> dict[int, int]:
    """{cards: longest row in tokens} for 1, 2, 4, ... up to `gpus` cards of `budget_bytes` each.
    ``shardings(cards)``: the strategies the run may take over that many cards (False: DDP, True:
    FSDP2 over all of them; `maximus.memory.spec_from_config.fixed_strategy` decides); the longest
    of them counts (``distributed: auto`` shards when whole weights do not fit)."""
    degrees = [1 << k for k in range(gpus.bit_length()) if 1 << k <= gpus]
    return {n: max(longest_context_over_ranks(model_config, budget_bytes, n, sharded=sharded, **longest_kw)
                   for sharded in (shardings(n) if n > 1 else (False,))) for n in degrees}


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
