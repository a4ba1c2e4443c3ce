"""`CompositeOptimizer`: several optimizers over disjoint parameter groups behaving as one
(state_dict of tensors and plain values, so a checkpoint writes it to safetensors + JSON)."""
from __future__ import annotations

from typing import Callable

import torch



class CompositeOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, seen as one (one scheduler, one checkpoint):
    the parameter groups are the inner optimizers' own dicts, and they share one `state`."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts
        groups = [g for part in parts for g in part.param_groups]
        super().__init__(groups, {})
        for part in parts:
            self.state.update(part.state)
        self._link()

    def _link(self) -> None:
        i = 0
        for part in self.parts:
            n = len(part.param_groups)
            part.param_groups = self.param_groups[i:i + n]
            part.state = self.state
            i += n

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for part in self.parts:
            part.step()
        return loss

    def state_dict(self):
        sd = _plain_groups(super().state_dict())
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        owner = {id(p): part for part in self.parts for g in part.param_groups for p in g["params"]}
        params = {index[id(p)]: p for g in self.param_groups for p in g["params"]}
        sd["state"] = {i: _flat(owner[id(params[i])], params[i], st) for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict):
        flat_state = state_dict["state"]
        params = [p for g in self.param_groups for p in g["params"]]
        owner = {id(p): part for part in self.parts for g in part.param_groups for p in g["params"]}
        plain = {}
        restored: dict[int, dict] = {}
        for i, st in flat_state.items():
            plain[i], restored[int(i)] = _split_flat(st)
        _load_keeping_tensors(self, super().load_state_dict, {"state": plain, "param_groups": state_dict["param_groups"]})
        self._link()
        for i, extra in restored.items():
            p = params[i]
            _unflat(owner[id(p)], p, self.state[p], extra)


def _plain_groups(sd: dict) -> dict:
    """Group settings held as 0-d tensors (torchao keeps `lr` so) as floats, for the JSON file."""
    sd["param_groups"] = [{k: float(v) if isinstance(v, torch.Tensor) else v for k, v in g.items()}
                          for g in sd["param_groups"]]
    return sd


def _load_keeping_tensors(optimizer, load: Callable, sd: dict) -> None:
    """`load(sd)`, then each group setting that was a tensor before (torchao's `lr`) a tensor again,
    filled with the loaded value: torchao refuses a float learning rate."""
    kinds = [{k for k, v in g.items() if isinstance(v, torch.Tensor)} for g in optimizer.param_groups]
    load(sd)
    for group, keys in zip(optimizer.param_groups, kinds):
        for k in keys:
            if not isinstance(group[k], torch.Tensor):
                group[k] = torch.tensor(float(group[k]), dtype=torch.float32)


def _flat(part, p, st: dict) -> dict:
    """One parameter's state with tensor subclasses and projector objects as plain entries."""
    return getattr(part, "flat_state", lambda p, st: st)(p, st)


def _split_flat(st: dict) -> tuple[dict, dict]:
    """(entries torch can load as they are, entries `_unflat` rebuilds: names with a '/')."""
    plain = {k: v for k, v in st.items() if "/" not in k}
    extra = {k: v for k, v in st.items() if "/" in k}
    return plain, extra


def _unflat(part, p, live: dict, extra: dict) -> None:
    if extra:
        part.unflat_state(p, live, extra)


def with_flat_state(cls):
    """`state_dict` / `load_state_dict` of a single optimizer whose state holds objects that are
    not plain tensors: they go through its `flat_state` / `unflat_state`."""

    class Flat(cls):
        def state_dict(self):
            sd = _plain_groups(super().state_dict())
            params = [p for g in self.param_groups for p in g["params"]]
            sd["state"] = {i: self.flat_state(params[i], st) for i, st in sd["state"].items()}
            return sd

        def load_state_dict(self, state_dict):
            params = [p for g in self.param_groups for p in g["params"]]
            plain, restored = {}, {}
            for i, st in state_dict["state"].items():
                plain[i], restored[int(i)] = _split_flat(st)
            _load_keeping_tensors(self, super().load_state_dict,
                                  {"state": plain, "param_groups": state_dict["param_groups"]})
            for i, extra in restored.items():
                if extra:
                    self.unflat_state(params[i], self.state[params[i]], extra)

    Flat.__name__ = Flat.__qualname__ = cls.__name__
    return Flat
