"""Smart Memory: move what is not needed right now to host memory, and bring it back in time.

* `ActivationOffloader`: the input of each checkpointed decoder layer (the only activation a
  ``full`` layer keeps) is copied to pinned host memory on a side CUDA stream while the layer
  computes, its device storage is released when the layer returns, and in backward the input
  of layer i-1 is prefetched while layer i recomputes and backpropagates ("one layer ahead").
  On a CPU device the same path runs with an ordinary host buffer and synchronous copies: the
  storage really is released and restored, so tests exercise the bookkeeping exactly.
* `OffloadedAdamW`: AdamW whose fp32 master weights and moments live in host memory and are
  updated there; the device keeps only the parameters and their gradients.
* `build_optimizer`: torch AdamW, bitsandbytes 8-bit AdamW or paged 8-bit AdamW, with or
  without offload, from the config's names.
* `FrozenWeightStreamer` (`maximus.memory.weight_streaming`, re-exported here): frozen weights
  of each decoder layer (4-bit ones too) live in host memory or a file and are fetched to the
  device one layer ahead of use (forward and backward).
"""
from __future__ import annotations

import difflib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from maximus.errors import ConfigError
from maximus.memory.weight_streaming import FrozenWeightStreamer, _tensor_outputs

__all__ = ["ActivationOffloader", "FrozenWeightStreamer", "OffloadedAdamW", "OPTIMIZERS", "build_optimizer"]


def _pin() -> bool:
    return torch.cuda.is_available()


# --------------------------------------------------------------------------------------------
# Activation offload


@dataclass
class _OffloadedInput:
    """One checkpointed layer input whose device storage was released; `host` holds its values."""

    tensor_ref: weakref.ref
    host: torch.Tensor
    nbytes: int
    ready: Any = None  # CUDA event: the device copy is complete (after a prefetch)
    on_device: bool = False


@dataclass
class OffloadStats:
    """Counters of what went through the offload path (tensors and bytes)."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    restored_tensors: int = 0
    prefetched_tensors: int = 0


class ActivationOffloader:
    """Offloads the saved inputs of checkpointed layers and prefetches them one layer ahead.

    `checkpoint(run, args, kwargs, context_fn)` replaces
    `torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, ...)` for a layer whose
    first argument (or `hidden_states=`) is its input. The input is cloned first so that the
    released storage is one only the checkpoint holds (no caller can read freed memory)."""

    def __init__(self):
        self.stats = OffloadStats()
        self._entries: list[_OffloadedInput] = []  # in forward order; popped as backward restores
        self._stream = None

    # -- device helpers ----------------------------------------------------------------------
    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _prune(self) -> None:
        """Forget inputs whose autograd graph is gone (a forward without backward)."""
        self._entries = [e for e in self._entries if e.tensor_ref() is not None and not e.on_device]

    # -- forward -----------------------------------------------------------------------------
    def checkpoint(self, run: Callable, args: tuple, kwargs: dict, context_fn) -> Any:
        if args and isinstance(args[0], torch.Tensor):
            owned = args[0].clone()
            args = (owned, *args[1:])
        elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
            owned = kwargs["hidden_states"].clone()
            kwargs = {**kwargs, "hidden_states": owned}
        else:
            return checkpoint(run, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        self._prune()
        stream = self._side_stream(owned.device)
        host = torch.empty(owned.shape, dtype=owned.dtype, device="cpu", pin_memory=_pin() and stream is not None)
        if stream is not None:
            # Copy while the layer computes: the side stream waits only for `owned` to exist.
            stream.wait_stream(torch.cuda.current_stream(owned.device))
            with torch.cuda.stream(stream):
                host.copy_(owned, non_blocking=True)
            owned.record_stream(stream)  # freeing below must not hand the block out before the copy ends
        else:
            host.copy_(owned)

        out = checkpoint(run, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        entry = _OffloadedInput(weakref.ref(owned), host, owned.untyped_storage().nbytes())
        owned.untyped_storage().resize_(0)
        self._entries.append(entry)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += entry.nbytes
        grad_fn = next((t.grad_fn for t in _tensor_outputs(out) if t.grad_fn is not None), None)
        if grad_fn is not None:
            grad_fn.register_prehook(lambda grad_outputs, entry=entry: self._before_layer_backward(entry))
        return out

    # -- backward ----------------------------------------------------------------------------
    def _before_layer_backward(self, entry: _OffloadedInput) -> None:
        """Runs when backward reaches a layer's output: its input must be on the device now;
        start bringing the previous layer's input back while this layer computes."""
        self._restore(entry, prefetch=False)
        self._wait(entry)
        index = next((k for k, e in enumerate(self._entries) if e is entry), None)
        if index is not None:
            previous = self._entries[index - 1] if index > 0 else None
            del self._entries[index]
            if previous is not None:
                self._restore(previous, prefetch=True)

    def _restore(self, entry: _OffloadedInput, prefetch: bool) -> None:
        if entry.on_device:
            return
        tensor = entry.tensor_ref()
        if tensor is None:
            return
        # Allocate on the compute stream (so the block is not in use by it), copy on the side stream.
        storage = tensor.untyped_storage()
        storage.resize_(entry.nbytes)
        # Write through a fresh alias: autograd checks the input's version counter at recompute,
        # and restoring the values it had is not a modification.
        alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
            storage, tensor.storage_offset(), tensor.shape, tensor.stride())
        stream = self._side_stream(tensor.device)
        with torch.no_grad():
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(tensor.device))
                with torch.cuda.stream(stream):
                    alias.copy_(entry.host, non_blocking=True)
                    entry.ready = torch.cuda.Event()
                    entry.ready.record(stream)
                tensor.record_stream(stream)
            else:
                alias.copy_(entry.host)
        entry.on_device = True
        self.stats.restored_tensors += 1
        if prefetch:
            self.stats.prefetched_tensors += 1

    def _wait(self, entry: _OffloadedInput) -> None:
        if entry.ready is not None:
            torch.cuda.current_stream().wait_event(entry.ready)
            entry.ready = None


# --------------------------------------------------------------------------------------------
# Optimizer state offload


def _param_groups(params) -> list[dict]:
    params = list(params)
    if not params:
        raise ConfigError("optimizer: no parameters to train", "check that the adapter has trainable parameters")
    if isinstance(params[0], dict):
        return [dict(group) for group in params]
    return [{"params": params}]


class OffloadedAdamW(torch.optim.AdamW):
    """AdamW with fp32 master weights and both moments in host memory (pinned when CUDA exists).

    Each `step()` copies the device gradients to the host, updates on the host (torch's AdamW,
    same math), and copies the new weights back into the device parameters (cast to their
    dtype). The device holds only parameters and gradients: 12 bytes per trainable parameter
    move off the device (16 with low-precision parameters, whose fp32 master also moves).

    fp32 device parameters are re-read into the master before each step, so weights loaded into
    the model after the optimizer was built are respected; for bf16/fp16 parameters call
    `reload_from_params()` after changing them (load_state_dict does it). `param_groups` hold
    the host masters (LR schedulers work as usual); `state_dict()` has torch AdamW's format."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False):
        groups = _param_groups(params)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device param, host fp32 master)
        host_groups = []
        for group in groups:
            masters = []
            for p in group["params"]:
                master = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=_pin())
                master.copy_(p.detach())
                self._pairs.append((p, master))
                masters.append(master)
            host_groups.append({**group, "params": masters})
        super().__init__(host_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=False)
        self._grad_buffers = [torch.empty(m.shape, dtype=torch.float32, device="cpu", pin_memory=_pin())
                              for _, m in self._pairs]

    def reload_from_params(self) -> None:
        """Copy the device parameters into the host masters (after loading weights into the model)."""
        for p, master in self._pairs:
            master.copy_(p.detach())

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self.reload_from_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, master in self._pairs:
            master.grad = None
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        any_cuda = False
        for (p, master), buffer in zip(self._pairs, self._grad_buffers):
            if p.grad is None:
                master.grad = None
                continue
            any_cuda |= p.is_cuda
            buffer.copy_(p.grad, non_blocking=True)
            if p.dtype == torch.float32:
                master.copy_(p, non_blocking=True)
            master.grad = buffer
        if any_cuda:
            torch.cuda.synchronize()  # the host update reads the copied gradients
        super().step()
        for p, master in self._pairs:
            if master.grad is not None:
                p.copy_(master, non_blocking=True)
        return loss


# --------------------------------------------------------------------------------------------
# Factory

OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit")


def build_optimizer(params: Iterable, name: str, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                    weight_decay: float = 0.0, offload: bool = False, eps: float = 1e-8) -> torch.optim.Optimizer:
    """The optimizer named in `training.optimizer`.

    adamw: `torch.optim.AdamW`, or `OffloadedAdamW` (state on the host) with offload.
    adamw_8bit: `bitsandbytes.optim.AdamW8bit` (8-bit moments: 2 bytes per parameter); with
      offload its paged variant, whose state pages out to host memory under pressure.
    paged_adamw_8bit: `bitsandbytes.optim.PagedAdamW8bit` (paging needs CUDA; on CPU it runs unpaged).
    Raises `ConfigError` for an unknown name."""
    groups = _param_groups(params)
    if name == "adamw":
        if offload:
            return OffloadedAdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if name in ("adamw_8bit", "paged_adamw_8bit"):
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if (offload or name == "paged_adamw_8bit") else bnb.optim.AdamW8bit
        return cls(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    close = difflib.get_close_matches(str(name), OPTIMIZERS, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"use one of {', '.join(OPTIMIZERS)}"
    raise ConfigError(f"training.optimizer: unknown optimizer {name!r}", hint)
