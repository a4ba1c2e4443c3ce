"""`build_optimizer`: `training.optimizer` over the trainable parameters, each optimizer built
from its own package."""
from __future__ import annotations

from typing import Callable

import torch

from maximus.errors import ConfigError
from maximus.memory.optimizer_state import OPTIMIZERS, PROJECTED, TORCHAO_ADAMW, projection_settings
from maximus.train.optimizers.checks import check_rank, decoder_matrices
from maximus.train.optimizers.composite import CompositeOptimizer
from maximus.train.optimizers.in_backward import InBackwardOptimizer
from maximus.train.optimizers.projected import apollo_class, galore_class
from maximus.train.optimizers.torchao_rows import torchao_class


def _param_groups(model, weight_decay: float, ids: set[int] | None = None, exclude: set[int] | None = None) -> list[dict]:
    """AdamW-style groups (decay on matrices, none on norms and biases) of the trainable parameters,
    limited to `ids` / without `exclude`."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or (ids is not None and id(p) not in ids) or (exclude and id(p) in exclude):
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _factories(model, name: str, t, *, offload: bool, bf16_weights: bool) -> list[tuple[Callable, list[dict]]]:
    """[(make(groups) -> optimizer, groups)]: the optimizer(s) `name` means, over the model's
    trainable parameters. More than one part = a `CompositeOptimizer` (Muon + AdamW)."""
    lr, betas, wd, eps = t.learning_rate, tuple(t.betas), t.weight_decay, 1e-8
    if name in ("adamw", "adamw_8bit", "paged_adamw_8bit") and not (bf16_weights and name == "adamw"):
        from maximus.memory.offload import build_optimizer as build_adamw

        return [(lambda g: build_adamw(g, name, lr=lr, betas=betas, weight_decay=wd, offload=offload),
                 _param_groups(model, wd))]
    if name in ("adamw", *TORCHAO_ADAMW):
        cls = torchao_class(TORCHAO_ADAMW.get(name))
        return [(lambda g: cls(g, lr=lr, betas=betas, eps=eps, weight_decay=wd, bf16_stochastic_round=bf16_weights),
                 _param_groups(model, wd))]
    if name in PROJECTED:
        settings = projection_settings(name, t.optimizer_rank, t.optimizer_scale)
        matrices = decoder_matrices(model)
        check_rank(model, matrices, settings["rank"], name)
        projected = {"rank": settings["rank"], "update_proj_gap": t.optimizer_update_gap, "scale": settings["scale"],
                     "proj_type": "std"}
        if name != "galore":
            projected.update(proj="random", scale_type=settings["scale_type"])
        outer, outer_parts = _outer_part(model, t, matrices, bf16_weights)
        groups = [dict(g, **projected) for g in _param_groups(model, wd, ids=matrices)]
        groups += _param_groups(model, wd, exclude=matrices | outer)
        cls = galore_class() if name == "galore" else apollo_class()
        return [(lambda g: cls(g, lr=lr, betas=betas, eps=eps, weight_decay=wd, no_deprecation_warning=True),
                 groups)] + outer_parts
    if name == "adam_mini":
        from adam_mini import Adam_mini

        cfg = getattr(model, "config", None)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        heads = getattr(cfg, "num_attention_heads", 1) or 1
        kw = dict(dim=getattr(cfg, "hidden_size", 1), n_heads=heads,
                  n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads)

        def make_mini(groups):
            ids = {id(p) for g in groups for p in g["params"]}
            return Adam_mini([(n, p) for n, p in named if id(p) in ids], lr=lr, betas=betas, eps=eps,
                             weight_decay=wd, verbose=False, **kw)

        return [(make_mini, [{"params": [p for _, p in named]}])]
    if name == "muon":
        matrices = decoder_matrices(model)
        # "match_rms_adamw" scales Muon's orthogonalised update to AdamW's RMS, so one learning
        # rate serves both parts (Moonlight's recipe).
        muon = [(lambda g: torch.optim.Muon(g, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw"),
                 _param_groups(model, wd, ids=matrices))]
        outer, outer_parts = _outer_part(model, t, matrices, bf16_weights)
        rest = [(lambda g: torch.optim.AdamW(g, lr=lr, betas=betas, eps=eps, weight_decay=wd),
                 _param_groups(model, wd, exclude=matrices | outer))]
        return [(make, groups) for make, groups in muon + rest + outer_parts if groups]
    close = [n for n in OPTIMIZERS if n.startswith(str(name)[:4])]
    raise ConfigError(f"training.optimizer: unknown optimizer {name!r}",
                      f"did you mean '{close[0]}'?" if close else f"use one of {', '.join(OPTIMIZERS)}")


def _outer_part(model, t, matrices: set[int], bf16_weights: bool = False
                ) -> tuple[set[int], list[tuple[Callable, list[dict]]]]:
    """(ids, parts): the embedding and the head (the trainable 2-D weights outside `matrices`) on
    torchao's 4-bit AdamW (stochastic rounding for bf16 weights) when
    `training.embedding_optimizer: adamw_4bit`; else nothing (they stay on the optimizer's own AdamW)."""
    if t.embedding_optimizer != "adamw_4bit":
        return set(), []
    ids = {id(p) for p in model.parameters() if p.requires_grad and p.ndim == 2 and id(p) not in matrices}
    cls = torchao_class(4)
    make = lambda g: cls(g, lr=t.learning_rate, betas=tuple(t.betas), eps=1e-8, weight_decay=t.weight_decay,  # noqa: E731
                         bf16_stochastic_round=bf16_weights)
    return ids, [(make, _param_groups(model, t.weight_decay, ids=ids))]


def build_optimizer(model, training, *, optimizer: str | None = None, offload: bool = False,
                    bf16_weights: bool = False, row_steps: bool = True) -> torch.optim.Optimizer:
    """The optimizer of `training.optimizer` (or `optimizer`, the plan's) over the model's
    trainable parameters; stepped inside the backward when `training.optimizer_in_backward`
    (`row_steps`: the embedding and head on torchao's step updated row block by row block where
    their gradients are formed; False gives them whole gradients, the oracle of the tests)."""
    name = optimizer or training.optimizer
    parts = _factories(model, name, training, offload=offload, bf16_weights=bf16_weights)
    if training.optimizer_in_backward:
        return InBackwardOptimizer(model, parts, row_steps=row_steps)
    built = [make(groups) for make, groups in parts]
    return built[0] if len(built) == 1 else CompositeOptimizer(built)
