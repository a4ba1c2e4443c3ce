"""Kernels install themselves as an instance-level ``forward`` (so the module's class, state_dict
keys and PEFT wrapping stay as they are), tagged with a marker attribute on the function. This is
the one way to take such overrides off again."""
from __future__ import annotations

import types
from typing import Callable

import torch

__all__ = ["install_forward_override", "is_transformers_class", "remove_forward_overrides"]


def is_transformers_class(module: torch.nn.Module, names) -> bool:
    """`module` is an instance of one of Transformers' own model classes named in `names` (not a
    user's subclass or namesake elsewhere)."""
    cls = type(module)
    return cls.__name__ in names and cls.__module__.startswith("transformers.models.")


def install_forward_override(model: torch.nn.Module, wanted: Callable[[torch.nn.Module], bool], forward,
                             mark: str) -> list[str]:
    """Bind `forward` (a function carrying a truthy attribute `mark`) as the instance ``forward`` of
    every module of `model` that `wanted` accepts; returns their paths. A module whose forward
    someone else already replaced is left alone; one that already has this override counts."""
    patched = []
    for path, module in model.named_modules():
        if not wanted(module):
            continue
        current = module.__dict__.get("forward")
        if current is None:
            module.forward = types.MethodType(forward, module)
            patched.append(path)
        elif getattr(current, mark, False):
            patched.append(path)
    return patched


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
