"""Maximus: fine-tune large language models inside the memory you have.

Public surface: `Config`, `load_model`, `Trainer`, `embed`.
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


def __getattr__(name):
    if name == "Trainer":
        from maximus.train.trainer import Trainer

        return Trainer
    raise AttributeError(name)


__all__ = ["Config", "MaximusError", "Trainer", "embed", "load_model", "__version__"]
