"""The objectives the trainer runs (`objective: sft | dpo | contrastive | grpo`).

The base protocol and the default SFT objective live in `base`; each other objective in its own
module imports only `base`, and this registry imports them all (so nothing imports back up).
"""
from __future__ import annotations

from maximus.memory.plan import Plan
from maximus.train.views import LivePlan
from maximus.train.objectives.base import Objective, ObjectiveModule, SFTObjective
from maximus.train.objectives.contrastive import ContrastiveObjective
from maximus.train.objectives.grpo import GRPOObjective
from maximus.train.objectives.preference import PreferenceObjective

OBJECTIVES = {"sft": SFTObjective, "dpo": PreferenceObjective, "contrastive": ContrastiveObjective,
              "grpo": GRPOObjective}

__all__ = ["OBJECTIVES", "Objective", "ObjectiveModule", "build_objective"]


def build_objective(cfg, plan: Plan | LivePlan, pad_token_id: int) -> Objective:
    """The objective the config asks for (`objective: sft | dpo | contrastive | grpo`), reading
    `plan` (the trainer passes its `LivePlan`: the plan in force, one owner)."""
    return OBJECTIVES[cfg.objective](cfg, plan, pad_token_id)
