"""The input embedding's table in host memory: only the rows a batch uses reach the device.

A Llama-3.1-70B's embedding table is 128,256 x 8,192 weights, 1.96 GiB in bf16, of which a
micro-batch of 2,048 tokens reads at most 2,048 rows (16 MiB). With streamed frozen weights
(`optimization.offload.params`) `HostEmbedding` keeps the table in host memory and, in each
forward, moves only the rows of the batch's distinct token ids:

1. the ids are made unique on the device (`torch.unique`, with each position's index into them);
2. the unique ids come to the host, and the embedding module runs there on them (a gather of
   those rows: the model's own forward, so a scaled embedding stays scaled);
3. the rows go to the device (on CUDA through a pinned staging buffer, without blocking), and
   each position takes its row (`rows[inverse]`).

Values are exactly the resident lookup's. The module keeps its class, names and hooks (its
forward pre-hook swaps the ids, its forward hook the output), so checkpoints and PEFT see the
same model.

Where inputs go: Transformers' ``model.device`` is the first parameter's device, and the table
comes first, so a model whose layers run on CUDA would report ``cpu`` (and ``generate`` moves its
inputs to ``model.device`` before every forward). So the embedding is registered last in its
parent (after the decoder layers and the norm: a change of order only, `remove()` restores it)
and marked `maximus.structure.HOST_KEPT`, which `maximus.structure.compute_device`, the device
every input of ours goes to, looks past.

What stays on the device (`maximus.memory.streamed_weights.embedding_stays_on_host` decides, for
the estimator and here alike): a table the output head shares (tied: the head needs all of it every step) and a trained one
(`lora.modules_to_save` naming it, or full fine-tuning: its gradient and optimizer state are the
whole table's). The output head always stays on the device: it runs over every token at the
turn of the step (the loss, then at once its backward), the estimator's ``loss`` phase, so
streaming it would lower no peak.

The table is not pinned: the copy reads a pinned staging buffer of the batch's rows, so pinning
the table would only lock 2 GiB of host memory. With ``offload.params: disk`` the table is in host
memory too (the layers are in the file). On a CPU the same path runs (host and device are one
memory there, nothing is saved): `stats` counts the batches and the rows and bytes moved.
"""
from __future__ import annotations

import torch
from torch import nn

from maximus.memory.streamed_weights import embedding_stays_on_host
from maximus.structure import HOST_KEPT

__all__ = ["HostEmbedding", "install_host_embedding"]


class HostEmbedding:
    """Keep `embedding`'s table in host memory and move each batch's unique rows to `device`.

    `model` (optional): the model holding `embedding`, in which it is registered last (so that
    ``model.device`` is the layers'). `remove()` takes the hooks away, restores the order and moves
    the module back to `device`."""

    def __init__(self, embedding: nn.Module, device: torch.device, model: nn.Module | None = None):
        self.embedding = embedding
        self.device = torch.device(device)
        self.stats = {"batches": 0, "rows_moved": 0, "bytes_moved": 0}
        #: The shape of the last rows moved to the device (unique ids x hidden).
        self.last_rows_shape: tuple[int, ...] | None = None
        self._inverse: torch.Tensor | None = None
        self._input_device: torch.device | None = None
        embedding.to("cpu")
        setattr(embedding, HOST_KEPT, True)
        self._order = _register_last(model, embedding) if model is not None else None
        self._handles = [embedding.register_forward_pre_hook(self._ids_to_host, prepend=True),
                         embedding.register_forward_hook(self._rows_to_device, prepend=True)]

    def _ids_to_host(self, module: nn.Module, args: tuple) -> tuple:
        ids = args[0]
        self._input_device = ids.device
        unique, self._inverse = torch.unique(ids, return_inverse=True)
        return (unique.to("cpu"),) + tuple(args[1:])

    def _rows_to_device(self, module: nn.Module, args: tuple, rows: torch.Tensor) -> torch.Tensor:
        inverse, self._inverse = self._inverse, None
        target = self._input_device if self._input_device is not None else self.device
        if target.type == "cuda":
            staged = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            staged.copy_(rows)
            moved = staged.to(target, non_blocking=True)
        else:
            moved = rows.to(target)
        self.stats["batches"] += 1
        self.stats["rows_moved"] += rows.shape[0]
        self.stats["bytes_moved"] += rows.numel() * rows.element_size()
        self.last_rows_shape = tuple(rows.shape)
        return moved[inverse]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self._order is not None:
            parent, names = self._order
            for name in names:  # the embedding, then those that followed it: the first order again
                module = getattr(parent, name)
                delattr(parent, name)
                parent.add_module(name, module)
        self.embedding.__dict__.pop(HOST_KEPT, None)
        self.embedding.to(self.device)


def _register_last(model: nn.Module, embedding: nn.Module) -> tuple[nn.Module, list[str]] | None:
    """Register `embedding` last among its parent's children in `model`; (parent, the names from
    the embedding's on, in their first order) to restore it, or None when `model` does not hold it."""
    for parent in model.modules():
        children = list(parent.named_children())
        for i, (name, child) in enumerate(children):
            if child is embedding:
                delattr(parent, name)
                parent.add_module(name, embedding)
                return parent, [n for n, _ in children[i:]]
    return None


def _trained(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def install_host_embedding(model: nn.Module, device: torch.device) -> HostEmbedding | None:
    """`model`'s input embedding in host memory (`HostEmbedding`) when `embedding_stays_on_host`
    says so for it (frozen, not shared with the head); else None, and the embedding on `device`
    (a layer-by-layer load may have left it on the host before anything decided it is trained)."""
    embedding = model.get_input_embeddings()
    if embedding is None:
        return None
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is getattr(embedding, "weight", None)
    if not embedding_stays_on_host(streams_params=True, method="lora", tied=tied, trained=_trained(embedding)):
        embedding.to(device)
        return None
    return HostEmbedding(embedding, device, model)
