"""Predicted longest context over 1, 2, 4 and 8 cards with `training.context_parallel` (Ulysses).

Llama-3.1-8B QLoRA r=32, batch 1, default 10 % margin, every memory knob allowed, per card
`maximus.memory.context_parallel.longest_context_over_ranks`: N x the longest local share whose
one-card plan fits the card less Ulysses' exchange buffers. Predictions, not measurements.

    python benchmarks/context_parallel_plan.py            # the table in docs/long_context.md (~5 s)
"""
from __future__ import annotations

EIGHT_B = "meta-llama/Llama-3.1-8B"
CARDS = ("80GB", "24GB")
RANKS = (1, 2, 4, 8)
GIB = 2**30


def table() -> list[str]:
    from maximus.memory.context_exchange import exchange_bytes_per_token
    from maximus.memory.context_parallel import longest_context_over_ranks
    from maximus.memory.shape import load_model_config
    from maximus.memory.planner import plan_for_budget, resolve_budget

    shape = load_model_config(EIGHT_B)
    lines = ["| cards | longest row (tokens) | tokens per card | exchange buffers per card | plan per card "
             "| host RAM per card |", "|---|---|---|---|---|---|"]
    for card in CARDS:
        budget = resolve_budget(card)
        for n in RANKS:
            longest = longest_context_over_ranks(EIGHT_B, budget, n, method="qlora", lora_r=32)
            local = longest // n
            buffers = exchange_bytes_per_token(shape, n) * local
            plan = plan_for_budget(EIGHT_B, budget - buffers, method="qlora", lora_r=32, batch_size=1, seq_len=local)
            knobs = [plan.checkpointing_label] + [k for k, on in (("activation offload", plan.offload_activations),
                                                                  ("optimizer offload", plan.offload_optimizer)) if on]
            knobs.append(f"tiles {plan.tile_tokens}" if plan.tile_tokens else "untiled")
            lines.append(f"| {n} x {card} | **{longest:,}** | {local:,} | {buffers / GIB:.1f} GiB | {', '.join(knobs)} "
                         f"| {plan.host_bytes / GIB:.1f} GiB |")
    return lines


if __name__ == "__main__":
    print("\n".join(table()))
