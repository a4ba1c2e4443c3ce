"""Maximus: fine-tune large language models inside the memory you have.

Public surface: `Config`, `load_model`, `Trainer`, `embed`; for an existing Hugging Face / TRL
script, `patch` / `unpatch` / `patch_report` and `MemoryCallback` (docs/hf_stack.md).
"""
from __future__ import annotations

from maximus.config import Config
from maximus.embed import embed
from maximus.errors import MaximusError

__version__ = "0.1.0"


def load_model(cfg, **kwargs):
    """Load the configured model and tokenizer with adapters, quantization and every configured
    technique applied. See `maximus.models.load_model`."""
    from maximus.models import load_model as _load

    return _load(cfg, **kwargs)


_HF_STACK = {"patch": "maximus.hf_patch", "unpatch": "maximus.hf_patch", "patch_report": "maximus.hf_patch",
             "MemoryCallback": "maximus.memory_callback"}


def __getattr__(name):
    if name in _HF_STACK:
        import importlib

        return getattr(importlib.import_module(_HF_STACK[name]), name)
    if name == "Trainer":
        from maximus.train.trainer import Trainer

        return Trainer
    raise AttributeError(name)


__all__ = ["Config", "MaximusError", "MemoryCallback", "Trainer", "embed", "load_model", "patch", "patch_report", "unpatch",
           "__version__"]
