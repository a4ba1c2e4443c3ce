"""Matryoshka auxiliary loss: the first ``d`` dimensions of the final hidden state must predict the
next token on their own (Kusupati et al., 2022, "Matryoshka Representation Learning").

For each prefix size ``d`` the logits are ``hidden[..., :d] @ head_weight[:, :d].T``: the nested
prefix of the hidden state against the same prefix of the output embedding. Training this makes
a short prefix of the hidden state (and of each vocabulary row) useful by itself, so that
``maximus.embed(..., dim=64)`` keeps most of the retrieval quality of the full vector, and the
vocabulary can be scanned with 64-dimensional dot products.

The loss is a sum over tokens (like :func:`maximus.train.objective.token_loss_sum`): the trainer
divides the main loss and this one by the same token count of the whole optimizer step. It is
purely additive, so it composes with the exact and the ghost main loss. Each prefix runs through
:func:`maximus.losses.linear_cross_entropy.linear_cross_entropy`, chunk by chunk, so no
tokens x vocabulary tensor is ever held.

What is not applied to the prefix logits: the head's bias and a Gemma-style logit soft cap (the
prefix logits have a different scale from the full ones; a cap tuned for the full logits would
be arbitrary there).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from maximus.errors import ConfigError
from maximus.losses.linear_cross_entropy import linear_cross_entropy

IGNORE_INDEX = -100


def active_dims(dims: Sequence[int], hidden_size: int) -> list[int]:
    """The prefix sizes that get a loss term: sorted, de-duplicated, and only those smaller than
    ``hidden_size`` (a prefix of the full width *is* the main loss; a wider one does not exist),
    so one config (``[64, 128, 256]``) works for every model size.

    Raises:
        ConfigError: a size is not a positive integer.
    """
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ConfigError(f"matryoshka dims must be positive integers, got {list(dims)!r}",
                              hint="e.g. optimization.matryoshka.dims: [64, 128, 256]")
    return sorted({d for d in dims if d < hidden_size})


def matryoshka_loss_sum(hidden: torch.Tensor, head_weight: torch.Tensor, target: torch.Tensor, *,
                        dims: Sequence[int] = (64, 128, 256), weight: float = 0.2,
                        chunk_size: int | None = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``weight * mean_d sum_t CE(hidden[t, :d] @ head_weight[:, :d].T, target[t])``.

    Args:
        hidden: ``[..., H]`` final hidden states (after the final norm), any float dtype.
        head_weight: ``[V, H]`` output embedding (a LoRA head's effective weight works: the
            gradient flows through the slices).
        target: ``[...]`` next-token ids aligned with ``hidden`` (already shifted);
            ``ignore_index`` positions contribute nothing.
        dims: prefix sizes; sizes ``>= H`` are skipped (see :func:`active_dims`); the mean is
            over the remaining sizes.
        weight: factor on the mean over prefixes (``0`` returns a zero without computing).
        chunk_size: tokens per chunk of the exact loss (default: its ~64 MiB-of-logits chunk).
        ignore_index: label value to skip.

    Returns:
        A float32 scalar: summed over tokens (not averaged), 0 when no prefix is active.
    """
    used = active_dims(dims, hidden.shape[-1])
    if not used or weight == 0:
        return torch.zeros((), dtype=torch.float32, device=hidden.device)
    total = None
    for d in used:
        # Slices are views: the chunked loss reads them in place, and autograd scatters each
        # prefix's gradient back into the full hidden / weight gradients.
        term = linear_cross_entropy(hidden[..., :d], head_weight[:, :d], target, ignore_index,
                                    chunk_size=chunk_size, reduction="sum")
        total = term if total is None else total + term
    return total * (float(weight) / len(used))
