"""What a GRPO step adds to a training step's memory: sampling the groups with the KV cache.

A GRPO step (`objective: grpo`, `maximus.train.objectives.grpo`) has two phases that never overlap (with
`grpo.async_generation` they do: see below):

1. **generation**, in `no_grad` (`maximus.train.sampling`): `prompts_at_once` prompts at a time
   are prefilled once and their cache expanded to the group, so each decoding step holds the KV
   cache of `prompts_at_once x group_size` rows of up to `prompt + completion` tokens (K and V for
   every layer, `num_kv_heads x head_dim` each, in the compute dtype), the last position's logits
   `[rows, V]` in float32 (one step's at a time) with top-p's sort scratch, and the resident
   state (weights, adapters, optimizer moments). Then the reference and sampling-policy log-prob
   passes (`no_grad`, one micro-batch at a time) cost less than the backward below.
2. **the backward**: an ordinary training step over the step's share of the generation batch
   (`batch_size x group_size / steps_per_generation` completion rows of `seq_len +
   max_completion_tokens` tokens), `micro_batch_size` of them at a time, with the chunked head.
   That is what `maximus.memory.estimate.estimate_peak` models (`objective="grpo"`);
   `rollout_rows` gives it the rows and their length, and its loss term is
   `maximus.memory.estimate.completion_loss_bytes`: the head runs over the completion tokens only
   (prompt positions carry no loss).

The step's peak is the larger of the two (their sum under `async_generation`, where the next
batch is sampled during the backward); `check_generation` picks the largest `prompts_at_once`
(up to `training.batch_size`) whose generation fits the budget, or the free memory, and then
whether LoRA on float32 weights samples merged (`merge_lora`: a float32 copy of the adapted
projections for the generation, `merged_weight_bytes`) when that copy fits too.
"""
from __future__ import annotations

from typing import Any

#: Float32 `[rows, V]` tensors alive at a decode step (`maximus.train.sampling`): the step's
#: logits only (tempered, exponentiated and summed in place; the previous step's are freed before
#: the forward). Measured with the CPU meter over the whole sampler, 4 prompts x 8, vocabulary
#: 32,000: 1.06 (the 0.06: the prefill's per-prompt logits while they are repeated to the group).
SAMPLER_LOGIT_COPIES = 1
#: What top-p adds, in the same units: the sorted logits (4 bytes per entry), their order (8), the
#: softmax's cumulative sums (4) and two boolean masks (1 + 1): 4.5. Measured: 5.50 in all at top_p 0.9.
TOP_P_LOGIT_COPIES = 4.5
#: What recording the sampled tokens' log-probs adds (`sampler_records_logps`): the tempered
#: logits kept to read them from. Measured: 2.00 in all with them at top_p 1.
LOGPS_LOGIT_COPIES = 1


def sampler_records_logps(g, dtype: str) -> bool:
    """Whether GRPO keeps the sampling policy's log-probs (a step may train on completions its
    weights did not sample: `steps_per_generation` or `updates_per_generation` > 1, or
    `async_generation`) and takes them from the batched sampler, which draws them anyway: in
    float32 (`dtype` "fp32"), where they equal the loss pass's to float32 rounding. `g`: the run's
    `maximus.memory.run_spec.GrpoSettings`."""
    keeps = g.steps_per_generation * g.updates_per_generation > 1 or g.async_generation
    return keeps and g.sampler == "batched" and dtype == "fp32"


def merged_weight_bytes(model_config: Any) -> int:
    """A float32 copy of every decoder projection LoRA can adapt (q, k, v, o, gate, up, down:
    all seven charged, whichever are targeted), what `merged_for_sampling` forms for sampling."""
    from maximus.memory.shape import model_shape

    shape = model_shape(model_config)
    attention = 2 * shape.hidden_size * shape.head_dim * (shape.num_heads + shape.num_kv_heads)
    return 4 * shape.num_layers * (attention + 3 * shape.hidden_size * shape.intermediate_size)


def can_merge_lora(g, dtype: str) -> bool:
    """Whether sampling may run LoRA merged into a float32 copy of the weights
    (`maximus.kernels.lean_lora.merged_for_sampling`): LoRA on float32 weights, the batched
    sampler, and no second thread (`async_generation` samples while the step trains)."""
    return g.method == "lora" and dtype == "fp32" and g.sampler == "batched" and not g.async_generation


def rollout_rows(g) -> tuple[int, int]:
    """(completion rows per optimizer step, tokens per row) of GRPO's sampling `g`: what the
    backward trains on, for the planner (the step's share of `prompts` x `group_size`; prompt +
    completion tokens)."""
    return g.prompts * g.group_size // g.steps_per_generation, g.prompt_tokens + g.max_completion_tokens


def kv_cache_bytes(model_config: Any, *, sequences: int, tokens: int, dtype_bytes: int) -> int:
    """K and V of every layer for `sequences` x `tokens` positions."""
    from maximus.memory.shape import model_shape

    shape = model_shape(model_config)
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * sequences * tokens * dtype_bytes


def generation_peak_bytes(model_config: Any, *, resident_bytes: int, group_size: int, tokens: int,
                          dtype_bytes: int, prompts: int = 1, top_p: float = 1.0,
                          record_logps: bool = False) -> dict[str, int]:
    """Phase 1 of the module doc: {"resident", "kv_cache", "logits", "total"} in bytes, for
    `prompts` groups of `group_size` sequences of up to `tokens` (prompt + completion) tokens
    sampled in one decode loop (`top_p` < 1: with nucleus sampling's scratch; `record_logps`:
    with the kept logits the sampled tokens' log-probs are read from)."""
    from maximus.memory.shape import model_shape

    shape = model_shape(model_config)
    rows = prompts * group_size
    kv = kv_cache_bytes(shape, sequences=rows, tokens=tokens, dtype_bytes=dtype_bytes)
    copies = SAMPLER_LOGIT_COPIES + (TOP_P_LOGIT_COPIES if top_p < 1.0 else 0) + (LOGPS_LOGIT_COPIES if record_logps else 0)
    logits = int(copies * rows * shape.vocab_size * 4)
    return {"resident": resident_bytes, "kv_cache": kv, "logits": logits, "total": resident_bytes + kv + logits}


def check_generation(model_config: Any, plan, g, *, budget: int | None) -> dict[str, int]:
    """`generation_peak_bytes` for GRPO's sampling `g` (`maximus.memory.run_spec.GrpoSettings`;
    `model_config`: its model's `ModelShape`, or anything
    `model_shape` reads) and its training `plan` (the resident state is
    the plan's weights, adapters and optimizer moments; gradients are freed between steps), at
    the largest `prompts_at_once` (returned with the parts) that fits `budget`, else the plan's
    free memory; all `training.batch_size` prompts when neither is known.

    Raises BudgetError when a budget is set and one prompt's group does not fit in it;
    ConfigError for `grpo.generation: vllm` without CUDA or the vllm package (before any model
    is loaded)."""
    from maximus.config import format_bytes
    from maximus.errors import BudgetError
    from maximus.memory.coefficients import DTYPE_BYTES
    from maximus.memory.shape import model_shape

    check_sampler(g, plan.device)
    shape = model_shape(model_config)  # `plan_run` passes its step's shape: nothing is read again
    resident = sum(plan.breakdown.get(k, 0) for k in ("weights", "adapters", "optimizer"))
    # The longest prompt the data has (planned from it) or the cap, plus the longest completion.
    tokens = plan.rows_tokens_max or g.prompt_tokens + g.max_completion_tokens

    def parts_for(prompts: int) -> dict[str, int]:
        parts = generation_peak_bytes(shape, resident_bytes=resident, group_size=g.group_size, tokens=tokens,
                                      dtype_bytes=DTYPE_BYTES[plan.dtype], prompts=prompts, top_p=g.top_p,
                                      record_logps=sampler_records_logps(g, plan.dtype))
        if g.async_generation:  # sampled while the backward runs: on top of the training step
            parts["total"] = max(parts["total"], (plan.peak_bytes or resident) + parts["kv_cache"] + parts["logits"])
        return {**parts, "prompts_at_once": prompts}

    limit = budget if budget is not None else getattr(plan, "free_memory_bytes", None)
    prompts = g.prompts
    if limit is not None:
        while prompts > 1 and parts_for(prompts)["total"] > limit:
            prompts -= 1
    parts = parts_for(prompts)
    parts["merge_lora"] = False
    if can_merge_lora(g, plan.dtype):  # when the copy fits beside the chosen generation
        merged = merged_weight_bytes(shape)
        if limit is None or parts["total"] + merged <= limit:
            parts.update(merge_lora=True, merged_weights=merged, total=parts["total"] + merged)
    if budget is not None and parts["total"] > budget:
        raise BudgetError(f"GRPO generation needs about {format_bytes(parts['total'])} (KV cache "
                          f"{format_bytes(parts['kv_cache'])} for {g.group_size} x {tokens} tokens, on top of "
                          f"{format_bytes(resident)} of weights and optimizer state), over the budget of "
                          f"{format_bytes(budget)}", "lower grpo.group_size, grpo.max_completion_tokens or "
                          "training.seq_len (the longest prompt), or use method: qlora")
    return parts


def check_sampler(g, device_type: str) -> None:
    """`grpo.generation: vllm` needs CUDA and the vllm package: one line otherwise."""
    if g.sampler != "vllm":
        return
    import importlib.util

    from maximus.errors import ConfigError

    if device_type != "cuda":
        raise ConfigError(f"grpo.generation: vllm needs a CUDA GPU, but this run is on {device_type}",
                          "set grpo.generation: batched (the KV-cached sampler, on any device)")
    if g.method == "full":
        raise ConfigError("grpo.generation: vllm receives the policy as a LoRA adapter, but method is full",
                          "use method: lora or qlora, or set grpo.generation: batched")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("grpo.generation: vllm needs the vllm package, which is not installed",
                          "pip install vllm, or set grpo.generation: batched")
