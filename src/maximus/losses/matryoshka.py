"""Matryoshka losses (Kusupati et al., 2022, "Matryoshka Representation Learning"), two kinds:

- :func:`matryoshka_loss_sum`, the SFT auxiliary loss: the first ``d`` dimensions of the final
  hidden state must predict the next token on their own;
- :func:`matryoshka_info_nce`, the embedding loss of ``objective: contrastive``: in-batch InfoNCE
  (:func:`info_nce`) on the full pooled vector plus ``weight`` x the mean of the same loss on each
  nested prefix, normalised after truncation (:func:`normalized_prefix`, what
  ``maximus.embed(..., dim=d)`` returns). This is the retrieval form of the idea
  (sentence-transformers' MatryoshkaLoss around MultipleNegativesRankingLoss).

The rest of this note is about the SFT auxiliary loss.

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


# ------------------------------------------------------------------------------ contrastive
def normalized_prefix(vectors: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``vectors[..., :dim]`` L2-normalised per row, float32 (the full width when ``dim`` is None).

    Truncate first, then normalise: the nested embedding ``maximus.embed(..., dim=d)`` returns,
    and the one :func:`matryoshka_info_nce` trains."""
    prefix = vectors if dim is None else vectors[..., :dim]
    return torch.nn.functional.normalize(prefix.float(), dim=-1)


def info_nce(query: torch.Tensor, doc: torch.Tensor, temperature: float = 0.05,
             reduction: str = "sum") -> torch.Tensor:
    """InfoNCE with in-batch negatives: ``CE(cos(q_i, d_j) / temperature over j, target i)``.

    Row ``i`` of ``doc`` is the positive of row ``i`` of ``query``; every other row of ``doc`` is
    a negative (sentence-transformers' MultipleNegativesRankingLoss with ``scale = 1 /
    temperature``). Inputs are L2-normalised here, so pass them unnormalised or normalised alike.

    Args:
        query, doc: ``[N, D]`` embeddings (any float dtype; computed in float32).
        temperature: divides the cosine similarities (0.05 = scale 20).
        reduction: ``sum`` over queries (the trainer divides by the step's pair count), ``mean``
            or ``none`` (``[N]``).
    """
    logits = normalized_prefix(query) @ normalized_prefix(doc).T / temperature
    target = torch.arange(query.shape[0], device=query.device)
    return torch.nn.functional.cross_entropy(logits, target, reduction=reduction)


def matryoshka_info_nce(query: torch.Tensor, doc: torch.Tensor, dims: Sequence[int] = (), weight: float = 1.0,
                        temperature: float = 0.05, reduction: str = "sum") -> torch.Tensor:
    """``info_nce(full) + weight * mean_d info_nce(prefix d)``: the same in-batch InfoNCE on each
    nested prefix ``[:, :d]``, L2-normalised after truncation (exactly ``embed(dim=d)``).

    Args:
        query, doc: ``[N, H]`` pooled, unnormalised embeddings.
        dims: prefix sizes; sizes ``>= H`` are skipped (see :func:`active_dims`); empty = plain
            InfoNCE.
        weight: factor on the mean over prefixes (``0``: plain InfoNCE, no prefix computed).
            ``weight = len(dims)`` is sentence-transformers' MatryoshkaLoss with unit weights
            (a plain sum over the full width and every prefix).
        temperature: see :func:`info_nce`.
        reduction: ``sum`` / ``mean`` over queries, or ``none``.

    Raises:
        ConfigError: a size is not a positive integer.
    """
    total = info_nce(query, doc, temperature, reduction)
    used = active_dims(dims, query.shape[-1])
    if not used or weight == 0:
        return total
    nested = sum(info_nce(query[..., :d], doc[..., :d], temperature, reduction) for d in used)
    return total + nested * (float(weight) / len(used))
