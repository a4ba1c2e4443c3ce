"""Memory: measure it (`MemoryMeter`), predict it (`estimate_peak`), plan a run into a budget
(`plan_run`: config -> `Plan`; `plan_for_budget`: the search; `replan`: a changed plan, re-estimated).
Checkpointing and offload live in their own modules beside these."""
from __future__ import annotations

from maximus.memory.estimate import Estimate, estimate_peak
from maximus.memory.meter import MemoryMeter, measure_step_peak
from maximus.memory.plan import Attention, Plan
from maximus.memory.run_spec import Candidate, RunSpec
from maximus.memory.shape import KNOWN_SHAPES, ModelShape, model_shape


def __getattr__(name):
    # The planner imports the estimator only; load it lazily to keep `import maximus.memory` light.
    if name in ("plan_for_budget", "resolve_budget", "max_seq_len_for_budget"):
        from maximus.memory import planner

        return getattr(planner, name)
    if name in ("replan", "plan_below_measured"):
        from maximus.memory import run_plan

        return getattr(run_plan, name)
    if name == "plan_run":
        from maximus.memory import spec_from_config

        return spec_from_config.plan_run
    raise AttributeError(name)


__all__ = ["Attention", "Candidate", "Estimate", "ModelShape", "RunSpec", "KNOWN_SHAPES", "MemoryMeter", "Plan", "measure_step_peak", "estimate_peak",
           "max_seq_len_for_budget", "model_shape", "plan_below_measured", "plan_for_budget", "plan_run",
           "replan", "resolve_budget"]
