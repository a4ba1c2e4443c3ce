"""Re-plans in the middle of a run, from the plan alone.

The plan carries its `RunSpec` (`maximus.memory.spec_from_config.plan_run` made it from the
config), so `replan(plan, lengths, **changes)` (the same plan with some settings changed and its
prediction re-estimated) and `plan_below_measured(plan, lengths, measured)` need neither the
config nor the model again: the trainer's re-plans (out of memory, a measured peak over the
budget, recompute chosen from measured costs) go through them and never edit a plan in place.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from maximus.errors import BudgetError
from maximus.memory.lengths import RowLengths
from maximus.memory.plan import Plan
from maximus.memory.planner import DEFAULT_ALLOW, plan_for_budget
from maximus.memory.run_spec import Candidate

__all__ = ["replan", "plan_below_measured"]


def plan_below_measured(plan: Plan, lengths: RowLengths | None, measured_bytes: int,
                        budget_bytes: int | None = None) -> Plan | None:
    """A smaller plan after a step of `plan` measured `measured_bytes`, over its budget
    (`budget_bytes`, default the plan's: the meter's, which the trainer holds the run to).

    The planner's search runs again over the plan's spec with every estimate scaled by measured /
    predicted (what the estimator missed, e.g. a module it does not know, is taken to grow with
    the rest), i.e. for the budget ``budget x predicted / measured``. What cannot change in the
    middle of a run stays: method, optimizer and its offload, distributed strategy; fixed
    settings of the config too. None when nothing fits that way."""
    budget_bytes = budget_bytes or plan.budget_bytes
    if not budget_bytes or not plan.peak_bytes or plan.spec is None:
        return None
    scaled = int(budget_bytes * plan.peak_bytes / measured_bytes)
    spec = replace(plan.spec, lengths=lengths).with_optimizer(plan.optimizer).searching(
        method=plan.method, allow=DEFAULT_ALLOW, offload_optimizer="on" if plan.offload_optimizer else "off",
        sharded=plan.strategy == "fsdp")
    try:
        found = plan_for_budget(spec, scaled)
    except BudgetError:
        return None
    calibration = (f"re-planned after a measured peak of {measured_bytes:,} bytes against {plan.peak_bytes:,} "
                   f"predicted: planned for {scaled:,} bytes of estimate")
    return replace(found, budget_bytes=budget_bytes, margin_bytes=plan.margin_bytes, strategy=plan.strategy,
                   objective=plan.objective, attention=plan.attention, ghost_candidates=plan.ghost_candidates, notes=found.notes + (calibration,))

def replan(plan: Plan, lengths: RowLengths | None = None, **changes: Any) -> Plan:
    """`plan` with `changes` (any `Plan` field: micro_batch_size, recompute, loss_chunk_size, ...)
    and its prediction (peak, breakdown, phase, tokens/s guess) re-estimated for them with the
    plan's spec. The gradient accumulation follows a new micro-batch, so the effective batch
    stays; with the run's `lengths`, so does the largest micro-batch the loader forms with it."""
    new = replace(plan, **changes)
    if "micro_batch_size" in changes and "grad_accum" not in changes:
        per_rank = plan.micro_batch_size * plan.grad_accum
        new = replace(new, grad_accum=max(1, per_rank // new.micro_batch_size))
    if lengths is not None and new.micro_batch_tokens and "micro_batch_tokens" in changes:
        split = lengths.token_split(new.micro_batch_tokens)
        new = replace(new, micro_batch_size=split.rows, grad_accum=split.micro_batches,
                      seq_len=split.largest.row_tokens, micro_batch_tokens_max=split.largest.tokens)
    elif lengths is not None and "micro_batch_size" in changes:
        largest = lengths.largest_micro_batch(new.micro_batch_size)
        new = replace(new, seq_len=largest.row_tokens, micro_batch_tokens_max=largest.tokens)
    if new.peak_bytes is None or new.spec is None:  # an unplanned run stays unpredicted
        return new
    from maximus.memory.estimate import estimate_step

    e = estimate_step(new.spec, _candidate(new, lengths))
    return replace(new, peak_bytes=e.peak_bytes, breakdown=dict(e.breakdown), peak_phase=e.phase,
                   tokens_per_s_guess=e.tokens_per_s_guess)

def _candidate(plan: Plan, lengths: RowLengths | None) -> Candidate:
    """The estimator's candidate for `plan` (its settings as chosen)."""
    return Candidate(method=plan.method, micro_batch=plan.micro_batch_size, seq_len=plan.seq_len,
                     checkpointing=list(plan.recompute), offload_activations=plan.offload_activations,
                     offload_optimizer=plan.offload_optimizer, loss_chunk_tokens=plan.loss_chunk_size,
                     grad_accum=plan.grad_accum, sharded=plan.strategy == "fsdp", tile_tokens=plan.tile_tokens,
                     masked_attention=_masked(plan, lengths))

def _masked(plan: Plan, lengths: RowLengths | None) -> bool:
    """Whether some micro-batch of `plan` is attended with a document mask (`MicroBatch.masked`)."""
    if lengths is None:
        return False
    if plan.micro_batch_tokens:
        return lengths.token_split(plan.micro_batch_tokens).largest.masked
    return lengths.largest_micro_batch(plan.micro_batch_size).masked

