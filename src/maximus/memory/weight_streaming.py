"""Frozen-weight streaming: each decoder layer's frozen weights reach the device one layer ahead.

`FrozenWeightStreamer` (``optimization.offload.params``) keeps the frozen tensors of every
decoder layer in a store (`maximus.memory.weight_store`: host memory, pinned where CUDA exists,
or a memory-mapped file) and only the layers in flight on the device:

* forward: a pre-hook on layer i waits for its weights and starts fetching layer i+1's on a side
  CUDA stream; a post-hook releases layer i's device storage (all but the last layer, where
  backward starts; every layer when no backward will come);
* backward: when backward reaches layer i's output its weights are fetched again (for the
  recompute and the input-gradient matmuls), layer i-1's are prefetched and layer i+1's released.

So at most three layers' weights are on the device: the running one, the prefetched one and, in
backward, the one just finished. The input embedding's table stays in host memory too and only a
batch's rows reach the device (`maximus.memory.host_embedding`, unless the head shares the table
or it is trained). What streams is every frozen tensor's *storage*: plain weights
and norms, and for a bitsandbytes 4-bit weight its packed data and every tensor of its
quantization state (absmax, the code, the offset, the double quantization's absmax and code).
Trainable tensors (adapters) stay resident, and so does a storage that more than one layer shares
(bitsandbytes' 1 KiB dynamic code table). A released storage is resized to 0 bytes and refilled
in place, so every reference to the tensors (autograd's saved tensors, views) stays valid.

On a CPU device the same path runs with separate host copies and synchronous copies: the
storages really are released and restored, so tests exercise the bookkeeping exactly. `stats`
counts fetches, prefetches, releases, streamed bytes and the most layers ever resident;
`remove()` restores every weight and removes the hooks.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from maximus.compat import keep_4bit_training_layout
from maximus.structure import find_decoder_layers

__all__ = ["FrozenWeightStreamer", "is_4bit", "storage_bytes", "streamed_storages"]


def is_4bit(p: torch.Tensor) -> bool:
    """A bitsandbytes 4-bit weight (`Params4bit`): packed bytes plus a quantization state."""
    return type(p).__name__ == "Params4bit" and getattr(p, "quant_state", None) is not None


def _quant_state_tensors(qs) -> list[torch.Tensor]:
    out = [t for t in (qs.absmax, qs.code, qs.offset) if isinstance(t, torch.Tensor)]
    if getattr(qs, "state2", None) is not None:
        out += _quant_state_tensors(qs.state2)
    return out


def _layer_frozen_tensors(layer: nn.Module) -> list[tuple[torch.Tensor, bool]]:
    """Every frozen tensor of `layer` in module order, each with whether it is large: 4-bit data
    and its quantization state, and plain frozen matrices, are large; norms and biases are not."""
    out: list[tuple[torch.Tensor, bool]] = []
    for module in layer.modules():
        for p in module._parameters.values():
            if p is None or p.requires_grad:
                continue
            if is_4bit(p):
                out.append((p, True))
                out.extend((t, True) for t in _quant_state_tensors(p.quant_state))
            elif type(p) in (torch.Tensor, nn.Parameter):
                out.append((p, p.dim() >= 2))
    return out


def streamed_storages(layers) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """(large, small): per layer, one tensor per distinct storage that streams (frozen tensors'
    storages no other layer shares), in module order. Large ones (4-bit weights with their
    quantization state, plain matrices) live in the run's weight store, the order it keeps them
    in; small ones (norms, biases: kilobytes) always in host memory."""
    per_layer = [_layer_frozen_tensors(layer) for layer in layers]
    owners: dict[int, set[int]] = {}
    for i, tensors in enumerate(per_layer):
        for t, _ in tensors:
            owners.setdefault(t.untyped_storage()._cdata, set()).add(i)
    large, small = [], []
    for tensors in per_layer:
        seen, big, little = set(), [], []
        for t, is_large in tensors:
            key = t.untyped_storage()._cdata
            if key in seen or len(owners[key]) > 1:
                continue
            seen.add(key)
            (big if is_large else little).append(t)
        large.append(big)
        small.append(little)
    return large, small


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 alias of `t`'s whole storage (on its device)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


class FrozenWeightStreamer:
    """Stream the frozen weights of each decoder layer from `store` to the device, one layer ahead.

    `store`: a `HostWeightStore` or `DiskWeightStore`; layers it already holds (written by the
    layer-by-layer loader, or a cache from an earlier run) are checked against the model's
    storages and used as they are; layers it lacks are copied into it from the model. Default:
    host memory, pinned where the weights are on a CUDA device."""

    def __init__(self, model: nn.Module, store=None):
        from maximus.memory.weight_store import HostWeightStore

        _, self.layers = find_decoder_layers(model)
        large, small = streamed_storages(self.layers)
        device = next((t.device for ts in large + small for t in ts), torch.device("cpu"))
        self.store = store if store is not None else HostWeightStore(pin=device.type == "cuda")
        self.small_store = HostWeightStore(pin=device.type == "cuda")
        self._parts = [(large, self.store), (small, self.small_store)]
        self.layer_bytes = [0] * len(self.layers)
        self._resident = [True] * len(self.layers)
        self._ready: list[Any] = [None] * len(self.layers)
        self._stream = None
        self.stats = {"fetches": 0, "prefetches": 0, "releases": 0, "streamed_bytes": 0, "most_resident_layers": 0}
        for tensors, part_store in self._parts:
            written = False
            for i, layer_tensors in enumerate(tensors):
                self._own_storages(layer_tensors)
                now = [t.untyped_storage().nbytes() for t in layer_tensors]
                if part_store.has(i):
                    # Written by the layer-by-layer loader (which released the storages) or an earlier run.
                    have = [shape[0] if shape else 0 for shape, _ in part_store.signature(i)]
                    if len(have) != len(now) or any(n and n != h for n, h in zip(now, have)):
                        raise ValueError(f"layer {i}: the weight store holds storages of {have} bytes, "
                                         f"the model {now}")
                    self.layer_bytes[i] += sum(have)
                else:
                    part_store.put(i, [storage_bytes(t) for t in layer_tensors])
                    self.layer_bytes[i] += sum(now)
                    written = True
            if written:
                part_store.commit()
        # bitsandbytes repacks a 4-bit weight for its CPU kernel on the first eval forward,
        # replacing the storage this streamer refills; keep the one layout.
        keep_4bit_training_layout(model)
        self._handles = []
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: self._before_forward(i)))
            self._handles.append(layer.register_forward_hook(lambda m, a, out, i=i: self._after_forward(i, out)))
        for i in range(len(self.layers)):
            self._release(i)
        # The embedding table too: only the rows of each batch's token ids reach the device.
        from maximus.memory.host_embedding import install_host_embedding

        self.host_embedding = install_host_embedding(model, device)

    @staticmethod
    def _own_storages(tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.untyped_storage().nbytes() and not t.untyped_storage().resizable():
                # Weights loaded from safetensors on CPU are memory-mapped views of the file, whose
                # storage cannot be resized: give the tensor storage of its own to release.
                t.data = t.detach().clone()

    @property
    def resident_layers(self) -> int:
        return sum(self._resident)

    # -- moves -------------------------------------------------------------------------------
    def _fetch(self, i: int, prefetch: bool = False, direction: int = 1) -> None:
        if i < 0 or i >= len(self.layers) or self._resident[i]:
            return
        stream = None
        for tensors, part_store in self._parts:
            for t, host in zip(tensors[i], part_store.host_tensors(i)):
                storage = t.untyped_storage()
                storage.resize_(host.numel())
                alias = storage_bytes(t)
                if t.is_cuda:
                    if self._stream is None:
                        self._stream = torch.cuda.Stream(device=t.device)
                    stream = self._stream
                    stream.wait_stream(torch.cuda.current_stream(t.device))
                    with torch.cuda.stream(stream), torch.no_grad():
                        alias.copy_(host, non_blocking=True)
                    t.record_stream(stream)
                else:
                    with torch.no_grad():
                        alias.copy_(host)
                self.stats["streamed_bytes"] += host.numel()
        if stream is not None:
            self._ready[i] = torch.cuda.Event()
            self._ready[i].record(stream)
        self.store.done(i, self._ready[i])
        self.store.read_ahead(i + direction)
        self._resident[i] = True
        self.stats["prefetches" if prefetch else "fetches"] += 1
        self.stats["most_resident_layers"] = max(self.stats["most_resident_layers"], self.resident_layers)

    def _wait(self, i: int, direction: int = 1) -> None:
        self._fetch(i, direction=direction)
        if self._ready[i] is not None:
            torch.cuda.current_stream().wait_event(self._ready[i])
            self._ready[i] = None

    def _release(self, i: int) -> None:
        if i < 0 or i >= len(self.layers) or not self._resident[i] or not self.layer_bytes[i]:
            return
        for tensors, _ in self._parts:
            for t in tensors[i]:
                t.untyped_storage().resize_(0)
        self._resident[i] = False
        self.stats["releases"] += 1

    # -- hooks -------------------------------------------------------------------------------
    def _before_forward(self, i: int) -> None:
        self._wait(i)
        self._fetch(i + 1, prefetch=True)

    def _after_forward(self, i: int, out) -> None:
        grad_fn = next((t.grad_fn for t in _tensor_outputs(out) if t.grad_fn is not None), None)
        if grad_fn is None:
            self._release(i)  # nothing will come back for these weights
            return
        if i < len(self.layers) - 1:
            self._release(i)  # backward starts at the last layer, which stays
        else:
            self.store.read_ahead(i - 1)  # the first layer backward prefetches
        grad_fn.register_prehook(lambda grad_outputs, i=i: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        self._wait(i, direction=-1)
        self._fetch(i - 1, prefetch=True, direction=-1)
        self._release(i + 1)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for i in range(len(self.layers)):
            self._wait(i)
        if self.host_embedding is not None:
            self.host_embedding.remove()
        self.store.close()
        self.small_store.close()


def _tensor_outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []
