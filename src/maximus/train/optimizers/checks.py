"""Checks made before the model loads: the packages an optimizer needs, what the in-backward
step excludes, a projection rank a weight can take."""
from __future__ import annotations

import importlib.util

from maximus.errors import ConfigError
from maximus.memory.optimizer_state import (EMBEDDING_ON_ADAMW, OPTIMIZERS, PROJECTED, TORCHAO_ADAMW,
                                            outer_rows_on_torchao)


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


def check_rank(model, matrices: set[int], rank: int, optimizer: str) -> None:
    for name, p in model.named_parameters():
        if id(p) in matrices and rank > min(p.shape):
            raise ConfigError(f"training.optimizer_rank {rank} ({optimizer}) is larger than the smaller side of "
                              f"{name} ({tuple(p.shape)})",
                              f"use training.optimizer_rank <= {min(p.shape)}")
