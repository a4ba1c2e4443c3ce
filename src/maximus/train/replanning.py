"""Re-planning inside a run: a smaller plan, adopted between steps, when a step ran out of memory
(the step is redone with the same rows, so neither the effective batch nor the data order
changes) or when its measured peak passed the budget (the next steps use the smaller plan).

Every change is recorded in `LivePlan.replans` (run.json) and in the live plan.json. The helpers
read and write the run through a `maximus.train.views.ReplanView`, never the trainer.
"""
from __future__ import annotations

import torch

from maximus.errors import TrainingError
from maximus.memory.run_plan import plan_below_measured, replan
from maximus.train.views import ReplanView


def guarded_step(run: ReplanView, step: int, say, work=None):
    """`run.train_step(step)` (or `work()`, a part of the step: GRPO's sampling), redone
    after an out-of-memory error with a smaller plan."""
    while True:
        try:
            return work() if work is not None else run.train_step(step)
        except torch.OutOfMemoryError:
            run.optimizer.zero_grad(set_to_none=True)
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
            smaller = smaller_plan(run.live.current, run.lengths)
            if smaller is None:
                raise TrainingError(f"out of memory at step {step} with micro-batch 1 and full recomputation",
                                    "lower training.seq_len, use method: qlora, or set a smaller target_vram "
                                    "so the planner offloads more") from None
            change = adopt(run, smaller, step=step, reason="out of memory")
            say(f"warning: out of memory at step {step}; re-planned ({change}) and redoing the step")


def check_budget(run: ReplanView, step: int, say) -> None:
    """After a step: when its measured peak (CUDA: max_memory_allocated; CPU: the meter's
    storage tracker) passed the budget, re-plan downward for the next steps. The planner's
    search runs again with its estimate scaled by measured / predicted (whatever the estimator
    missed is taken to grow with it); failing that, the micro-batch halves, then every layer
    recomputes."""
    meter = run.meter
    if not meter.over_budget_bytes():
        return
    budget, measured = int(meter.budget_bytes), meter.peak_bytes()
    plan = run.live.current
    smaller = plan_below_measured(plan, run.lengths, measured, budget) or smaller_plan(plan, run.lengths)
    reason = f"measured peak {measured:,} bytes over the budget of {budget:,}"
    change = "nothing left to shrink"
    if smaller is not None:
        change = adopt(run, smaller, step=step, reason=reason, measured_peak_bytes=measured)
    say(f"warning: step {step} peaked at {measured:,} bytes, over the budget of {budget:,}; "
        f"re-planned for the next steps: {change}")


def smaller_plan(plan, lengths):
    """The next cheaper plan, or None: halve the micro-batch (the accumulation doubles; a token
    budget halves down to the longest row), then recompute every layer."""
    if plan.micro_batch_tokens and plan.micro_batch_tokens > lengths.longest:
        return replan(plan, lengths, micro_batch_tokens=max(lengths.longest, plan.micro_batch_tokens // 2))
    if plan.micro_batch_size > 1 and not plan.micro_batch_tokens:
        return replan(plan, lengths, micro_batch_size=plan.micro_batch_size // 2)
    if set(plan.recompute) != {"full"}:
        return replan(plan, lengths, recompute=("full",) * len(plan.recompute))
    return None


def adopt(run: ReplanView, new, *, step: int, reason: str, **measured) -> str:
    """Switch the run to plan `new` between steps (recompute modes on the model; the plan in
    force, which the trainer and its objective read), record it in `replans`, rewrite plan.json
    and return what changed."""
    live = run.live
    old = live.current
    if new.recompute != old.recompute or new.offload_activations != old.offload_activations:
        from maximus.memory.checkpointing import apply_checkpointing

        live.checkpointing = apply_checkpointing(run.model, list(new.recompute), micro_batch=new.micro_batch_size,
                                                 seq_len=run.max_row_tokens, offload_activations=new.offload_activations,
                                                 tile_tokens=new.tile_tokens)
    live.current = new
    change = plan_change(old, new)
    live.replans.append({"step": step, "reason": reason, "change": change,
                         "predicted_peak_bytes": new.peak_bytes, **measured})
    run.publish()
    return change


def plan_change(old, new) -> str:
    """What differs between two plans, e.g. ``micro-batch 4 -> 2, checkpointing none -> full``."""
    parts = []
    for label, a, b in (("micro-batch", old.micro_batch_size, new.micro_batch_size),
                        ("micro-batch tokens", old.micro_batch_tokens, new.micro_batch_tokens),
                        ("checkpointing", old.checkpointing_label, new.checkpointing_label),
                        ("activation offload", old.offload_activations, new.offload_activations),
                        ("loss chunk", old.loss_chunk_size, new.loss_chunk_size)):
        if a != b:
            parts.append(f"{label} {a} -> {b}")
    return ", ".join(parts) or "no change"
