"""torchao's 4-bit / 8-bit AdamW stepped on row chunks of at most `TORCHAO_CHUNK_VALUES` values
(whole quantisation blocks each), so its float32 copies are those of one chunk."""
from __future__ import annotations

import functools
import math
import warnings

import torch

from maximus.memory.optimizer_state import TORCHAO_CHUNK_VALUES
from maximus.train.optimizers.composite import with_flat_state


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


def row_chunks(p: torch.Tensor) -> list[slice]:
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


def torchao_class(bits: int | None):
    """torchao's AdamW with `bits`-bit moments (4 or 8), or float32 ones (None)."""
    from torchao.optim import AdamW4bit, AdamW8bit, _AdamW

    class TorchaoAdamW(_QuantizedState, {4: AdamW4bit, 8: AdamW8bit, None: _AdamW}[bits]):
        @torch.no_grad()
        def step(self, closure=None):
            """torchao's step function, on the row chunks of each tensor (`row_chunks`),
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
                    for rows in row_chunks(p):
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
            """The update of the rows `rows` (one of `row_chunks(p)`) of `p` from their gradient;
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

    return with_flat_state(TorchaoAdamW)
