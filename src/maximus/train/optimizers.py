"""The optimizer of a run, from `training.optimizer`: each low-memory choice comes from its own
package, and every one can save and resume its whole state (`state_dict` holds tensors and plain
values only, so the checkpoint writes it to safetensors + JSON).

| name | package | applies to |
|---|---|---|
| adamw, adamw_8bit, paged_adamw_8bit | torch, bitsandbytes | full, LoRA, QLoRA |
| adamw_4bit | torchao `AdamW4bit` | full, LoRA, QLoRA |
| adamw_8bit_torchao | torchao `AdamW8bit` (steps row block by row block inside the backward) | full, LoRA, QLoRA |
| apollo, apollo_mini | apollo-torch `APOLLOAdamW` (random projection) | full only |
| galore | galore-torch `GaLoreAdamW` (SVD projection) | full only |
| adam_mini | adam-mini `Adam_mini` | full, LoRA, QLoRA |
| muon | `torch.optim.Muon` on 2-D decoder weights + `torch.optim.AdamW` on the rest | full, LoRA, QLoRA |

APOLLO and GaLore project the gradient of each 2-D decoder weight onto `rank` directions; an
adapter is already a rank-r matrix, so projecting it saves nothing and they are full-only.

`training.master_weights: bf16` keeps the weights in bf16 and rounds each update stochastically
(torchao's `_AdamW` / `AdamW4bit` with ``bf16_stochastic_round``) instead of keeping float32
master weights.

`training.embedding_optimizer: adamw_4bit` gives the embedding and the head of apollo /
apollo_mini / galore / muon torchao's 4-bit AdamW (a part of a `CompositeOptimizer`) instead of
the float32 AdamW moments their recipes keep there.

torchao's step runs on row chunks of at most `TORCHAO_CHUNK_VALUES` values, whole 4-bit blocks
each: its float32 copies are those of one chunk (the same elementwise update, block by block).

`training.optimizer_in_backward: true` builds one optimizer per parameter and steps it from the
parameter's post-accumulate-grad hook, then frees the gradient (`InBackwardOptimizer`): the whole
set of gradients never exists at once. What that excludes is refused by `check_in_backward`.
With `training.max_grad_norm` set, each step's backward runs twice: the first only sums the
squared gradients (`measuring`), the second steps every weight on its gradient times the clip
coefficient that norm gives (`clip_to`): exactly `clip_grad_norm_` followed by the step.

Raises `ConfigError` (one line): a package that is not installed (with the pip command, checked by
`require_packages` before the model loads), a rank larger than a weight's smaller side (naming
the weight), an optimizer that does not apply to the method, in-backward combinations that would
be wrong.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch

from maximus.errors import ConfigError
from maximus.memory.optimizer_state import (EMBEDDING_ON_ADAMW, OPTIMIZERS, PROJECTED, TORCHAO_ADAMW,
                                            TORCHAO_CHUNK_VALUES, outer_rows_on_torchao, projection_settings)

__all__ = ["build_optimizer", "require_packages", "check_in_backward", "CompositeOptimizer", "InBackwardOptimizer"]


# --------------------------------------------------------------------------------------------- checks
def require_packages(cfg) -> None:
    """The package behind `training.optimizer` is importable (and torchao for bf16 weights);
    else one line with the pip command. Cheap: called before the model loads."""
    t = cfg.training
    spec = OPTIMIZERS[t.optimizer]
    needed = [(spec.package, spec.pip, f"training.optimizer: {t.optimizer}")]
    if t.master_weights == "bf16":
        needed.append(("torchao", "torchao", "training.master_weights: bf16"))
    if t.embedding_optimizer == "adamw_4bit":
        if t.optimizer not in EMBEDDING_ON_ADAMW or cfg.method != "full":
            raise ConfigError(f"training.embedding_optimizer: adamw_4bit applies to the embedding and head that "
                              f"{' / '.join(EMBEDDING_ON_ADAMW)} leave to AdamW in method: full "
                              f"(optimizer is {t.optimizer}, method {cfg.method})",
                              "remove training.embedding_optimizer, or use one of those optimizers with method: full")
        needed.append(("torchao", "torchao", "training.embedding_optimizer: adamw_4bit"))
    for package, pip, what in needed:
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{what} needs the package {pip}, which is not installed",
                              f"pip install {pip}")
    if not spec.lora and cfg.method in ("lora", "qlora"):
        raise ConfigError(f"training.optimizer: {t.optimizer} applies to method: full only (method is {cfg.method})",
                          "a LoRA adapter is already low-rank: projecting its gradient saves nothing; use adamw, "
                          "adamw_4bit, adam_mini or muon, or method: full")
    if t.master_weights == "bf16":
        if cfg.method != "full":
            raise ConfigError(f"training.master_weights: bf16 applies to method: full only (method is {cfg.method})",
                              "adapters train in float32 already; remove training.master_weights")
        rounded_in_backward = (t.optimizer in PROJECTED and t.optimizer_in_backward
                               and t.embedding_optimizer == "adamw_4bit")
        if t.optimizer not in ("adamw", *TORCHAO_ADAMW) and not rounded_in_backward:
            raise ConfigError(f"training.master_weights: bf16 needs training.optimizer adamw, adamw_4bit or adamw_8bit_torchao "
                              f"(torchao's stochastic rounding), or {' / '.join(PROJECTED)} with "
                              f"optimizer_in_backward: true and embedding_optimizer: adamw_4bit, not {t.optimizer}",
                              "set training.optimizer: adamw, adamw_4bit or adamw_8bit_torchao, or master_weights: fp32")
    check_in_backward(cfg)


def check_in_backward(cfg, *, grad_accum: int | None = None, world_size: int = 1) -> None:
    """Refuse what cannot work when each parameter steps inside the backward (one line saying why)."""
    t = cfg.training
    if not t.optimizer_in_backward:
        return
    why = "training.optimizer_in_backward: true updates each weight as soon as its gradient is ready"
    if isinstance(t.micro_batch_size, int) and t.micro_batch_size * world_size != t.batch_size:
        raise ConfigError(f"{why}: it cannot accumulate gradients over micro-batches (training.batch_size "
                          f"{t.batch_size}, micro_batch_size {t.micro_batch_size})",
                          "set training.micro_batch_size equal to batch_size (or auto), or optimizer_in_backward: false")
    if getattr(t, "micro_batch_tokens", None) is not None:
        raise ConfigError(f"{why}: it cannot accumulate gradients over the micro-batches of a token budget "
                          f"(training.micro_batch_tokens: {t.micro_batch_tokens})",
                          "set training.micro_batch_tokens: null, or optimizer_in_backward: false")
    if grad_accum is not None and grad_accum > 1:
        raise ConfigError(f"{why}: it cannot accumulate gradients, and the plan needs gradient accumulation "
                          f"{grad_accum} to fit",
                          "lower training.batch_size to what fits in one pass, or set optimizer_in_backward: false")
    if world_size > 1:
        raise ConfigError(f"{why}: under torchrun the step would run before the gradients are all-reduced",
                          "run on one process, or set optimizer_in_backward: false")
    if cfg.optimization.offload.optimizer == "on":
        raise ConfigError(f"{why}: the offloaded AdamW steps once per optimizer step on the host",
                          "set optimization.offload.optimizer: off, or optimizer_in_backward: false")
    head = _head_on_torchao(cfg)
    if head and cfg.optimization.matryoshka is not None and cfg.objective == "sft":
        raise ConfigError(f"{why}: with {head} the head is updated block by block inside the loss's backward, "
                          f"and optimization.matryoshka's prefix losses would give it a second gradient in the same step",
                          "remove optimization.matryoshka, or set optimizer_in_backward: false")


def _head_on_torchao(cfg) -> str | None:
    """The setting that puts a full fine-tune's head on torchao's step (which updates it block by
    block inside the backward when `optimizer_in_backward`), or None."""
    t = cfg.training
    if cfg.method != "full":
        return None
    return outer_rows_on_torchao(t.optimizer, t.master_weights, t.embedding_optimizer)


# --------------------------------------------------------------------------------------------- which weights
def decoder_matrices(model) -> set[int]:
    """ids of the trainable 2-D weights inside the decoder layers: what Muon orthogonalises and
    APOLLO / GaLore project (not the embedding, the head, the norms)."""
    from maximus.structure import find_decoder_layers

    _, layers = find_decoder_layers(model)
    return {id(p) for layer in layers for p in layer.parameters() if p.requires_grad and p.ndim == 2}


def _check_rank(model, matrices: set[int], rank: int, optimizer: str) -> None:
    for name, p in model.named_parameters():
        if id(p) in matrices and rank > min(p.shape):
            raise ConfigError(f"training.optimizer_rank {rank} ({optimizer}) is larger than the smaller side of "
                              f"{name} ({tuple(p.shape)})",
                              f"use training.optimizer_rank <= {min(p.shape)}")


# --------------------------------------------------------------------------------------------- composite
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


def _with_flat_state(cls):
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


# --------------------------------------------------------------------------------------------- projectors
class _ProjectorState:
    """APOLLO's and GaLore's per-weight projector objects as ``projector/<attribute>`` entries."""

    def flat_state(self, p, st: dict) -> dict:
        out = {k: v for k, v in st.items() if k != "projector"}
        projector = st.get("projector")
        if projector is not None:
            for attr, value in vars(projector).items():
                if value is not None:
                    out[f"projector/{attr}"] = value
        return out

    def unflat_state(self, p, live: dict, extra: dict) -> None:
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        projector = self.new_projector(group, live)
        for key, value in extra.items():
            attr = key.split("/", 1)[1]
            if isinstance(value, torch.Tensor):
                value = value.to(p.device)
            setattr(projector, attr, value)
        live["projector"] = projector


def _apollo_class():
    from apollo_torch import APOLLOAdamW

    class APOLLO(_ProjectorState, APOLLOAdamW):
        def new_projector(self, group, state):
            return self._initialize_projector(group, state)

    return _with_flat_state(APOLLO)


def _galore_class():
    from galore_torch import GaLoreAdamW
    from galore_torch.galore_projector import GaLoreProjector

    class GaLore(_ProjectorState, GaLoreAdamW):
        def new_projector(self, group, state):
            return GaLoreProjector(group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                                   proj_type=group["proj_type"])

    return _with_flat_state(GaLore)


# --------------------------------------------------------------------------------------------- torchao
class _QuantizedState:
    """torchao's quantized moments (tensor subclasses) as their inner tensors plus attributes:
    ``<key>/<tensor>`` entries and ``<key>/meta`` = [signed, shape, bits] (4 or 8; a checkpoint
    written before 8-bit moments existed has [signed, shape]: 4-bit)."""

    def flat_state(self, p, st: dict) -> dict:
        out = {}
        for key, value in st.items():
            if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
                names, attrs = value.__tensor_flatten__()
                for name in names:
                    out[f"{key}/{name}"] = getattr(value, name)
                out[f"{key}/meta"] = [bool(attrs[0]), list(value.shape), _state_bits(value)]
            else:
                out[key] = value
        return out

    def unflat_state(self, p, live: dict, extra: dict) -> None:
        from torchao.optim.subclass_4bit import OptimState4bit
        from torchao.optim.subclass_8bit import OptimState8bit

        keys = {k.split("/", 1)[0] for k in extra}
        for key in keys:
            signed, shape, bits = (*extra[f"{key}/meta"], 4)[:3]
            inner = {n: extra[f"{key}/{n}"].to(p.device) for n in OptimState4bit.tensor_attrs}
            if bits == 8:
                live[key] = OptimState8bit(inner["codes"], inner["scale"], inner["qmap"], signed, dtype=p.dtype)
            else:
                live[key] = OptimState4bit(inner["codes"], inner["scale"], inner["qmap"], signed, tuple(shape))


def _state_bits(state: torch.Tensor) -> int:
    """8 for torchao's 8-bit moment (one uint8 code per value), else 4."""
    return 8 if state.codes.numel() == state.numel() else 4


def _row_chunks(p: torch.Tensor) -> list[slice]:
    """Slices of `p`'s first dimension of at most `TORCHAO_CHUNK_VALUES` values each, every one
    whole blocks of torchao's 4-bit (128 values) and 8-bit (256 values) moments; one slice for a
    small or 1-D tensor."""
    if p.ndim < 2 or p.numel() <= TORCHAO_CHUNK_VALUES:
        return [slice(None)]
    row = p[0].numel()
    unit = 256 // math.gcd(row, 256)  # rows per whole number of blocks (of 128 and of 256)
    rows = max(unit, TORCHAO_CHUNK_VALUES // row // unit * unit)
    return [slice(a, min(a + rows, p.shape[0])) for a in range(0, p.shape[0], rows)]


def _state_rows(state: torch.Tensor, rows: slice, p: torch.Tensor) -> torch.Tensor:
    """The rows `rows` of a moment of `p`: a view, plain or torchao's 4-bit or 8-bit tensor (its
    codes and scales sliced block for block), so the update writes into the whole moment."""
    if rows == slice(None):
        return state
    if type(state) is torch.Tensor:
        return state[rows]
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    row = p[0].numel()
    start, stop, _ = rows.indices(p.shape[0])
    a, b = start * row, stop * row
    if _state_bits(state) == 8:  # codes shaped as the weight
        return OptimState8bit(state.codes[rows], state.scale[a // state.block_size:b // state.block_size],
                              state.qmap, state.signed, dtype=state.dtype)
    return OptimState4bit(state.codes[a // 2:b // 2], state.scale[a // state.block_size:b // state.block_size],
                          state.qmap, state.signed, (stop - start, *p.shape[1:]), dtype=state.dtype)


#: On a CPU, torchao's step is compiled (inductor's C++ kernels, one graph per chunk shape, a few
#: seconds each) for a tensor of at least this many values, where the eager step's hundred passes
#: over each chunk cost most (the embedding and head: ~4x less CPU time, measured); a smaller tensor,
#: and every step under a dispatch mode (the CPU memory meter, which a compiled graph cannot be
#: traced under), runs eagerly. Both compute the same update (to float32 rounding).
CPU_COMPILE_MIN_VALUES = 1 << 17


@functools.cache
def _torchao_update(compiled: bool):
    """torchao's per-tensor Adam update: compiled as torchao does on CUDA (one graph per chunk
    shape), else eager."""
    from torchao.optim.adam import single_param_adam

    return torch.compile(single_param_adam, fullgraph=True, dynamic=False) if compiled else single_param_adam


#: False once compiling failed on this machine (no C++ compiler for inductor, say): eager from then on.
_cpu_compile = {"works": True}


def _compiles(p: torch.Tensor) -> bool:
    """Whether `p`'s torchao step runs compiled: on CUDA always; on a CPU for a large tensor,
    outside any dispatch mode, where compiling works."""
    if p.is_cuda:
        return True
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return (p.numel() >= CPU_COMPILE_MIN_VALUES and _cpu_compile["works"]
            and _get_current_dispatch_mode() is None)


def _run_update(p: torch.Tensor, *args) -> None:
    """torchao's update of (a chunk of) `p`, compiled where `_compiles`; a failed CPU compile (it
    fails before any value is written) falls back to the eager step for the rest of the run."""
    if _compiles(p):
        try:
            with torch._dynamo.utils.disable_cache_limit():
                return _torchao_update(compiled=True)(*args)
        except Exception as exc:  # noqa: BLE001 - inductor's errors have no common class
            if p.is_cuda:
                raise
            _cpu_compile["works"] = False
            warnings.warn(f"torchao's optimizer step could not be compiled on the CPU ({type(exc).__name__}); "
                          f"it runs eagerly (slower, same update)", stacklevel=2)
    return _torchao_update(compiled=False)(*args)


def _torchao_class(bits: int | None):
    """torchao's AdamW with `bits`-bit moments (4 or 8), or float32 ones (None)."""
    from torchao.optim import AdamW4bit, AdamW8bit, _AdamW

    class TorchaoAdamW(_QuantizedState, {4: AdamW4bit, 8: AdamW8bit, None: _AdamW}[bits]):
        @torch.no_grad()
        def step(self, closure=None):
            """torchao's step function, on the row chunks of each tensor (`_row_chunks`),
            compiled as torchao does (one graph per chunk shape: at most two per tensor shape)
            on CUDA, and on a CPU for large tensors outside the memory meter (`_compiles`). A
            sharded parameter (FSDP2's DTensor) takes torchao's own step."""
            params = [p for g in self.param_groups for p in g["params"]]
            if any(type(p.data) is not torch.Tensor for p in params):
                return super().step(closure)
            loss = closure() if closure is not None else None
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    self._begin(p)
                    for rows in _row_chunks(p):
                        self._update_rows(p, group, rows, p.grad[rows])
            return loss

        def _begin(self, p: torch.Tensor) -> None:
            """A new step of `p`: its state made on the first, its step count raised."""
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = self._new_buffer(p, True)
                state["exp_avg_sq"] = self._new_buffer(p, False)
            state["step"] += 1

        def _update_rows(self, p: torch.Tensor, group: dict, rows: slice, grad: torch.Tensor) -> None:
            state = self.state[p]
            sr = self.bf16_stochastic_round and p.dtype is torch.bfloat16
            _run_update(p, p.detach()[rows], grad, state["step"], _state_rows(state["exp_avg"], rows, p),
                        _state_rows(state["exp_avg_sq"], rows, p), None, group["lr"], group["betas"][0],
                        group["betas"][1], group["weight_decay"], group["eps"], self.is_adamw, sr)

        @torch.no_grad()
        def step_rows(self, p: torch.Tensor, rows: slice, grad: torch.Tensor, first: bool) -> None:
            """The update of the rows `rows` (one of `_row_chunks(p)`) of `p` from their gradient;
            `first`: the step's first chunk of `p` (its step count is raised then). The same
            update as `step` on the whole gradient, chunk by chunk."""
            if first:
                self._begin(p)
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            self._update_rows(p, group, rows, grad)

        def add_param_group(self, param_group: dict) -> None:
            super().add_param_group(param_group)
            # torchao holds lr as a tensor; the scheduler's base (saved as JSON) stays a float.
            self.param_groups[-1].setdefault("initial_lr", float(self.param_groups[-1]["lr"]))

    return _with_flat_state(TorchaoAdamW)


# --------------------------------------------------------------------------------------------- building
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
        cls = _torchao_class(TORCHAO_ADAMW.get(name))
        return [(lambda g: cls(g, lr=lr, betas=betas, eps=eps, weight_decay=wd, bf16_stochastic_round=bf16_weights),
                 _param_groups(model, wd))]
    if name in PROJECTED:
        settings = projection_settings(name, t.optimizer_rank, t.optimizer_scale)
        matrices = decoder_matrices(model)
        _check_rank(model, matrices, settings["rank"], name)
        projected = {"rank": settings["rank"], "update_proj_gap": t.optimizer_update_gap, "scale": settings["scale"],
                     "proj_type": "std"}
        if name != "galore":
            projected.update(proj="random", scale_type=settings["scale_type"])
        outer, outer_parts = _outer_part(model, t, matrices, bf16_weights)
        groups = [dict(g, **projected) for g in _param_groups(model, wd, ids=matrices)]
        groups += _param_groups(model, wd, exclude=matrices | outer)
        cls = _galore_class() if name == "galore" else _apollo_class()
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
    cls = _torchao_class(4)
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


# --------------------------------------------------------------------------------------------- in backward
def _step_rounded(p: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """One step of `optimizer` (over `p` alone) on a float32 copy of the bf16 weight, rounded back
    stochastically (torchao's rounding): small updates are kept on average instead of being lost
    to bf16's round-to-nearest. Only one weight's float32 copy exists at a time."""
    from torchao.optim.quant_utils import _fp32_to_bf16_sr

    weight = p.data
    p.data = weight.float()
    try:
        optimizer.step()
        weight.copy_(_fp32_to_bf16_sr(p.data))
    finally:
        p.data = weight


class InBackwardOptimizer(CompositeOptimizer):
    """One optimizer per parameter, stepped from the parameter's post-accumulate-grad hook; the
    gradient is freed right after, so at most the gradients autograd is producing at the moment
    exist (never the whole set). `step()` and `zero_grad()` are then no-ops for the loop.

    A non-finite gradient skips that parameter's update (counted in `nonfinite`); the squares of
    the gradients are summed as they pass, so `grad_norm()` is the step's (unclipped) global norm."""

    steps_in_backward = True
    #: True during a step's first backward when clipping (`measuring`): the hooks only sum squares.
    _measuring = False
    #: The clip coefficient of the step's gradients (`clip_to`), 1.0 when not clipping.
    _coef = 1.0

    def __init__(self, model, parts: list[tuple[Callable, list[dict]]], *, row_steps: bool = True):
        optimizers = []
        for make, groups in parts:
            for g in groups:
                for p in g["params"]:
                    opt = make([dict(g, params=[p])])
                    if "seed" in opt.state.get(p, {}):
                        # APOLLO seeds each weight's random projection by its position: as in one optimizer.
                        opt.state[p]["seed"] = len(optimizers) + 1
                    optimizers.append((p, opt))
        super().__init__([opt for _, opt in optimizers])
        self._by_param = {id(p): opt for p, opt in optimizers}
        self._square_sum = 0.0
        self.nonfinite = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p, _ in optimizers]
        self._row_stepped: set[int] = set()
        self._undo: list[Callable[[], None]] = []
        if row_steps:
            self._step_outer_rows(model)

    def _step_outer_rows(self, model) -> None:
        """The embedding and an untied head on torchao's optimizer are updated row block by row
        block where their gradients are formed (the embedding's backward, the loss's backward):
        neither's whole gradient exists (`_RowStep`)."""
        from maximus.losses.linear_cross_entropy import step_rows_in_loss

        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        weights = [getattr(m, "weight", None) for m in (embed, head)]
        if weights[0] is not None and weights[0] is weights[1]:
            return  # tied: one weight, two gradients to sum
        for module, weight in zip((embed, head), weights):
            opt = self._by_param.get(id(weight)) if weight is not None else None
            if opt is None or not hasattr(opt, "step_rows"):
                continue
            step = _RowStep(self, weight, opt)
            if module is head:
                step_rows_in_loss(weight, step)
                self._undo.append(lambda w=weight: step_rows_in_loss(w, None))
            elif type(module) is torch.nn.Embedding and module.max_norm is None and not module.sparse:
                module.forward = functools.partial(_row_stepped_embedding, module, step)
                self._undo.append(lambda m=module: m.__dict__.pop("forward", None))

    def _hook(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:  # stepped row by row where its gradient was formed (`_RowStep`): autograd got None
            return
        if id(p) in self._row_stepped:
            raise RuntimeError("a weight updated row by row inside the backward also received a whole gradient "
                               "in the same step (a second loss on the head?): set optimizer_in_backward: false")
        square = float(torch.linalg.vector_norm(grad.detach(), dtype=torch.float32)) ** 2
        self._square_sum += square
        if not self._measuring:
            self._step(p, grad, square)
        p.grad = None

    def _step(self, p: torch.Tensor, grad: torch.Tensor, square: float) -> None:
        """`p`'s update from its gradient (times the clip coefficient); a non-finite one is skipped."""
        if not math.isfinite(square):
            self.nonfinite += 1
            return
        if self._coef != 1.0:
            grad.mul_(self._coef)
        opt = self._by_param[id(p)]
        if p.dtype is torch.bfloat16 and not getattr(opt, "bf16_stochastic_round", False):
            _step_rounded(p, opt)
        else:
            opt.step()

    def begin_step(self) -> None:
        """Start a new optimizer step's accounting (norm, non-finite count); no clipping."""
        self._square_sum = 0.0
        self.nonfinite = 0
        self._row_stepped.clear()
        self._coef = 1.0

    @contextlib.contextmanager
    def measuring(self):
        """A backward whose hooks only sum the gradients' squares (and free them): no weight
        changes. `grad_norm()` is then the step's global norm, for `clip_to`."""
        self.begin_step()
        self._measuring = True
        try:
            yield
        finally:
            self._measuring = False

    def clip_to(self, max_norm: float) -> float:
        """After a `measuring` backward: the next backward steps every weight on its gradient times
        `clip_grad_norm_`'s coefficient, min(1, max_norm / (norm + 1e-6)). Returns the norm."""
        norm = self.grad_norm()
        self.begin_step()
        self._coef = min(1.0, max_norm / (norm + 1e-6))
        return norm

    def grad_norm(self) -> float:
        return math.sqrt(self._square_sum) if math.isfinite(self._square_sum) else float("nan")

    @torch.no_grad()
    def step(self, closure=None):
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for undo in self._undo:
            undo()
        self._undo = []


class _RowStep:
    """The update of one weight from its gradient's row blocks (`_row_chunks`, torchao's step
    chunks), called by whoever forms them (`linear_cross_entropy.RowStep`): the first block starts
    the weight's step; each block's squares join the step's norm. A non-finite block skips the
    update of its own rows only (the blocks before it are applied already)."""

    def __init__(self, owner: InBackwardOptimizer, weight: torch.Tensor, optimizer):
        self.owner, self.weight, self.optimizer = owner, weight, optimizer
        self.chunks = _row_chunks(weight)

    def __call__(self, rows: slice, grad: torch.Tensor) -> None:
        first = rows == self.chunks[0]
        if first:
            self.owner._row_stepped.add(id(self.weight))
        square = float(torch.linalg.vector_norm(grad, dtype=torch.float32)) ** 2
        self.owner._square_sum += square
        if self.owner._measuring:
            return
        if math.isfinite(square):
            coef = self.owner._coef
            self.optimizer.step_rows(self.weight, rows, grad * coef if coef != 1.0 else grad, first)
        else:
            self.owner.nonfinite += 1


class _RowSteppedEmbedding(torch.autograd.Function):
    """`F.embedding` whose backward updates the weight block of rows by block of rows (each
    block's gradient gathered from the tokens that fall in it) and returns no weight gradient."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, step):
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.step = padding_idx, step
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        ids = ids.reshape(-1)
        grad_out = grad_out.reshape(ids.shape[0], -1)
        if ctx.padding_idx is not None:  # as embedding_dense_backward: the padding row gets no gradient
            keep = ids != ctx.padding_idx
            ids, grad_out = ids[keep], grad_out[keep]
        for rows in ctx.step.chunks:
            start, stop, _ = rows.indices(ctx.weight_shape[0])
            inside = (ids >= start) & (ids < stop)
            grad = torch.zeros((stop - start, ctx.weight_shape[1]), dtype=grad_out.dtype, device=grad_out.device)
            grad.index_add_(0, ids[inside] - start, grad_out[inside])
            ctx.step(rows, grad.to(ctx.weight_dtype))
            del grad
        return None, None, None, None


def _row_stepped_embedding(module: torch.nn.Embedding, step: _RowStep, ids: torch.Tensor) -> torch.Tensor:
    if not (torch.is_grad_enabled() and module.weight.requires_grad):
        return torch.nn.functional.embedding(ids, module.weight, module.padding_idx)
    return _RowSteppedEmbedding.apply(ids, module.weight, module.padding_idx, step)
