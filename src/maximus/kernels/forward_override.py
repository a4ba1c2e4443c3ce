"""Kernels install themselves as an instance-level ``forward`` (so the module's class, state_dict
keys and PEFT wrapping stay as they are), tagged with a marker attribute on the function. This is
the one way to take such overrides off again."""
from __future__ import annotations

import torch

__all__ = ["remove_forward_overrides"]


def remove_forward_overrides(model: torch.nn.Module, mark: str) -> int:
    """Delete every instance-level ``forward`` of `model`'s modules whose function carries a truthy
    attribute `mark`; the class's own forward is used again. Returns how many were removed."""
    count = 0
    for module in model.modules():
        current = module.__dict__.get("forward")
        if current is not None and getattr(current, mark, None):
            del module.forward
            count += 1
    return count
