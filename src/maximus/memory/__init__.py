"""Memory: measure it (`MemoryMeter`), predict it (`estimate_peak`), plan a run into a budget
(`plan_for_budget`). Checkpointing and offload live in their own modules beside these."""
from __future__ import annotations

from maximus.memory.estimate import KNOWN_SHAPES, Estimate, estimate_peak, model_shape
from maximus.memory.meter import MemoryMeter, measure_step_peak


def __getattr__(name):
    # The planner imports the estimator only; load it lazily to keep `import maximus.memory` light.
    if name in ("Plan", "plan_for_budget", "resolve_budget", "max_seq_len_for_budget"):
        from maximus.memory import planner

        return getattr(planner, name)
    raise AttributeError(name)


__all__ = ["Estimate", "KNOWN_SHAPES", "MemoryMeter", "Plan", "measure_step_peak", "estimate_peak", "max_seq_len_for_budget",
           "model_shape", "plan_for_budget", "resolve_budget"]
