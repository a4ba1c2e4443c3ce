"""The forward path both worlds share: the trainer's objectives, evaluation and `maximus.patch`.

Run the decoder to hidden states (never the logits), read the effective output head, align the
labels with the hidden state that predicts them, and sum the next-token cross-entropy chunk by
chunk (`maximus.losses.linear_cross_entropy`). No tokens x vocabulary logits tensor exists with
the default (`exact`) loss. `autocast_for` is the mixed-precision context every caller uses.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from maximus.families import is_mixture_of_experts
from maximus.structure import IGNORE_INDEX, causal_lm_of


@dataclass
class OutputHead:
    """The effective output projection: weight [V, H] (a LoRA-wrapped head folds its delta in,
    differentiably), optional bias [V] and Gemma-style final logit soft-capping."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    softcap: float | None
    #: Granite divides its logits by `config.logits_scaling`: the head sees `hidden * hidden_scale`
    #: (applied by `through_head`, so no scaled copy of the V x H weight is made).
    hidden_scale: float = 1.0


def output_head(model) -> OutputHead:
    lm = causal_lm_of(model)
    head = lm.get_output_embeddings()
    weight = _effective_weight(head)
    bias = getattr(head, "bias", None)
    if bias is None and hasattr(head, "base_layer"):
        bias = getattr(head.base_layer, "bias", None)
    softcap = getattr(lm.config, "final_logit_softcapping", None)
    scale = 1.0 / logits_divisor(lm.config)
    if bias is not None and scale != 1.0:
        bias = bias * scale
    return OutputHead(weight, bias, softcap, scale)


def logits_divisor(config) -> float:
    """What the model divides its logits by: Granite's ``logits_scaling``; HyperCLOVA X multiplies
    them by it instead (1 / it); 1 for every other model."""
    scaling = float(getattr(config, "logits_scaling", None) or 1.0)
    return 1.0 / scaling if getattr(config, "model_type", None) == "hyperclovax" else scaling


def _effective_weight(head) -> torch.Tensor:
    if hasattr(head, "base_layer") and hasattr(head, "get_delta_weight"):
        # A PEFT LoRA layer on the head: W + sum of active deltas, so gradients reach the adapter.
        weight = head.base_layer.weight
        if not getattr(head, "merged", False) and not getattr(head, "disable_adapters", False):
            for name in head.active_adapters:
                if name in getattr(head, "lora_A", {}):
                    weight = weight + head.get_delta_weight(name).to(weight.dtype)
        return weight
    if hasattr(head, "modules_to_save") and hasattr(head, "active_adapter"):
        # PEFT ModulesToSaveWrapper: the trainable copy is the live head.
        active = head.active_adapter if isinstance(head.active_adapter, str) else head.active_adapter[0]
        if not getattr(head, "disable_adapters", False) and active in head.modules_to_save:
            return head.modules_to_save[active].weight
        return head.original_module.weight
    return head.weight


#: Name of the method a distributed wrapper may give the output head module: ``method(hidden,
#: compute)`` returns ``compute(hidden)``, run as one of the head's forwards. FSDP2 registers it
#: (`torch.distributed.fsdp.register_fsdp_forward_method`) on a sharded head, so the head's weight
#: is gathered for the loss and its gradient reduce-scattered, although no logits forward runs.
HEAD_FORWARD_METHOD = "maximus_head_forward"


def through_head(model, hidden: torch.Tensor, compute):
    """`compute(hidden)`, for a loss that reads the output head's weight (`output_head`): run
    through the head's `HEAD_FORWARD_METHOD` when it has one (a sharded head), else directly."""
    lm = causal_lm_of(model)
    scaling = logits_divisor(lm.config)
    if scaling != 1.0:  # logits / s == head(hidden / s): see OutputHead.hidden_scale
        hidden = hidden * (1.0 / scaling)
    method = getattr(lm.get_output_embeddings(), HEAD_FORWARD_METHOD, None)
    return compute(hidden) if method is None else method(hidden, compute)


def hidden_states(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                  attention_mask: torch.Tensor | None = None, router: list | None = None,
                  media: dict | None = None) -> torch.Tensor:
    """Final hidden states [B, T, H] of the decoder (after the final norm), never the logits.

    `router`: for a mixture-of-experts model, its load-balancing loss (`router_aux_loss`) is
    appended to this list. `media`: a vision-language batch's image tensors
    (`maximus.vision.MEDIA_KEYS`); the VLM's inner model runs the tower and the projector and puts
    the image features in place of the image tokens before its language model."""
    lm = causal_lm_of(model)
    decoder = lm.model if media is not None else lm.get_decoder()
    extra = {"output_router_logits": True} if router is not None and is_mixture_of_experts(lm) else {}
    out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False,
                  **extra, **(media or {}))
    if extra and getattr(out, "router_logits", None):
        router.append(router_aux_loss(lm, out.router_logits, attention_mask))
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def router_aux_loss(lm, router_logits, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The model's own load-balancing loss (its module's `load_balancing_loss_func`, as its
    `forward` calls it), before `router_aux_loss_coef`."""
    import sys

    func = sys.modules[type(lm).__module__].load_balancing_loss_func
    return func(router_logits, lm.num_experts, lm.num_experts_per_tok, attention_mask)


def media_inputs(batch: dict) -> dict | None:
    """The image tensors of a vision-language batch, or None for a batch without images. (A VLM
    batch has an attention_mask and no position ids: Qwen2-VL derives its 3-D positions from the
    images.)"""
    from maximus.vision import MEDIA_KEYS

    media = {k: batch[k] for k in MEDIA_KEYS if k in batch}
    return media or None


def shift_labels(labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Align labels with the hidden state that predicts them: target[t] = labels[t + 1].

    In packed rows a new document starts where position_ids drop to 0; the last token of the previous
    document must not be trained to predict it, so that target is ignored."""
    target = torch.full_like(labels, IGNORE_INDEX)
    target[:, :-1] = labels[:, 1:]
    if position_ids is not None:
        starts = position_ids[:, 1:] == 0
        target[:, :-1] = target[:, :-1].masked_fill(starts, IGNORE_INDEX)
    return target


def batch_target(batch: dict) -> torch.Tensor:
    """A micro-batch's next-token targets: ``shift_labels`` when the batch carries them already
    shifted (Transformers' name; a context-parallel share, whose tokens are not contiguous, is
    shifted on the whole row first), else its ``labels`` shifted here."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return shift_labels(batch["labels"], batch.get("position_ids"))


def token_loss_sum(hidden: torch.Tensor, head: OutputHead, target: torch.Tensor, *, mode: str = "exact",
                   chunk_size: int | None = None, ghost: dict | None = None) -> torch.Tensor:
    """Sum over non-ignored tokens of the next-token cross-entropy (divide by the token count of
    the whole optimizer step outside, so gradient accumulation equals one big batch)."""
    from maximus.losses.linear_cross_entropy import linear_cross_entropy, naive_cross_entropy

    kwargs = dict(ignore_index=IGNORE_INDEX, reduction="sum", bias=head.bias, softcap=head.softcap)
    weight = head.weight  # each loss casts hidden and weight to the matmul dtype once (matmul_dtype)
    if mode == "naive":
        return naive_cross_entropy(hidden, weight, target, **kwargs)
    if mode == "ghost":
        from maximus.losses.ghost_logit import ghost_logit_loss

        # The ghost's chunk is how many tokens share one candidate set, not the exact loss's
        # memory chunk: only a chunk size the user set explicitly is passed on (inside `ghost`).
        return ghost_logit_loss(hidden, weight, target, **(ghost or {}), **kwargs)
    return linear_cross_entropy(hidden, weight, target, chunk_size=chunk_size, **kwargs)


def sft_loss_sum(model, batch: dict, *, mode: str = "exact", chunk_size: int | None = None,
                 ghost: dict | None = None, matryoshka=None,
                 metrics: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses, number of target tokens) for one micro-batch.

    A mixture of experts adds its router load-balancing loss as Transformers' own `forward` does
    (`router_aux_loss_coef` x the loss, when `config.output_router_logits`), per target token so
    that the step's loss is the model's; `metrics` (if given) gets `router_aux_loss` x tokens
    either way, which the trainer logs as the per-token mean."""
    position_ids = batch.get("position_ids")
    router: list = []
    hidden = hidden_states(model, batch["input_ids"], position_ids, batch.get("attention_mask"), router=router,
                           media=media_inputs(batch))
    target = batch_target(batch)
    count = (target != IGNORE_INDEX).sum()
    loss = through_head(model, hidden, lambda h: _head_loss(model, h, target, mode, chunk_size, ghost, matryoshka))
    if router:
        lm = causal_lm_of(model)
        if metrics is not None:
            metrics["router_aux_loss"] = float(router[0].detach()) * int(count)
        if getattr(lm.config, "output_router_logits", False):
            loss = loss + lm.router_aux_loss_coef * router[0].to(loss.dtype) * count
    return loss, count


def _head_loss(model, hidden, target, mode, chunk_size, ghost, matryoshka) -> torch.Tensor:
    head = output_head(model)  # read inside: a sharded head is gathered only here
    if matryoshka is None:
        return token_loss_sum(hidden, head, target, mode=mode, chunk_size=chunk_size, ghost=ghost)
    from maximus.losses.matryoshka import cross_entropy_with_matryoshka, matryoshka_loss_sum

    aux = dict(dims=matryoshka.dims, weight=matryoshka.weight_for("sft"), chunk_size=chunk_size,
               ignore_index=IGNORE_INDEX, token_fraction=matryoshka.token_fraction)
    if mode == "exact":  # main and prefix losses share one chunked pass
        return cross_entropy_with_matryoshka(hidden, head.weight, target, bias=head.bias, softcap=head.softcap, **aux)
    main = token_loss_sum(hidden, head, target, mode=mode, chunk_size=chunk_size, ghost=ghost)
    return main + matryoshka_loss_sum(hidden, head.weight, target, **aux)


def autocast_for(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the frozen-base / fp32-adapter combination; a no-op in fp32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
