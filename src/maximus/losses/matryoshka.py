"""Matryoshka losses (Kusupati et al., 2022, "Matryoshka Representation Learning"), two kinds:

- the SFT auxiliary loss: the first ``d`` dimensions of the final hidden state must predict the
  next token on their own. :func:`cross_entropy_with_matryoshka` computes the main loss and the
  prefix losses (what the trainer's ``exact`` loss uses: one shared chunked pass with every
  token, or the main pass plus a sampled prefix pass with ``token_fraction < 1``);
  :func:`matryoshka_loss_sum` computes the prefix losses alone (added on top of the ``ghost`` or
  ``naive`` main loss); :func:`separate_matryoshka_loss_sum` is the plain reference (one chunked
  cross-entropy per prefix) kept as the oracle in tests;
- :func:`matryoshka_info_nce`, the embedding loss of ``objective: contrastive``: in-batch InfoNCE
  (:func:`info_nce`) on the full pooled vector plus ``weight`` x the mean of the same loss on each
  nested prefix, normalised after truncation (:func:`normalized_prefix`, what
  ``maximus.embed(..., dim=d)`` returns). This is the retrieval form of the idea
  (sentence-transformers' MatryoshkaLoss around MultipleNegativesRankingLoss).

The rest of this note is about the SFT auxiliary loss,
``weight * mean_d sum_t CE(hidden[t, :d] @ W[:, :d].T, target[t])``.

**Why one shared pass.** Prefix logits are nested partial sums over column blocks of the hidden
state: with blocks ``[0, d1), [d1, d2), ..., [dk, H)``, ``logits_d1 = h[:, :d1] @ W[:, :d1].T``,
``logits_d2 = logits_d1 + h[:, d1:d2] @ W[:, d1:d2].T``, ..., full = last + rest. So every level's
logits together cost one full head matmul (a separate pass per prefix costs ``sum(dims) / H`` of
the head again: 0.875 for ``[64, 128, 256]`` at H = 512). The gradient is formed in forward, chunk
by chunk, as in :mod:`maximus.losses.linear_cross_entropy`: column block ``j`` of the hidden (and
weight) gradient is ``(sum of the logit gradients G_d of every level that includes block j) @
W[:, block j]``, so the backward matmuls also cost one full head. Walking the blocks from the last
to the first, that sum grows by one level per block. What remains extra per level is elementwise
work over ``C x V`` (copying the level's logits, the softmax, adding its gradient in) and its
memory (one stored ``C x V`` gradient per prefix until the chunk's backward), which the chunk size
accounts for (:func:`default_nested_chunk_size`). Measured on the reference shape (V = 128k,
H = 512, 1 CPU thread) that elementwise work still costs ~+50 % of a LoRA step with every token
(the separate passes: +95 %); see docs/benchmarks/matryoshka.md.

**Token sampling** (``token_fraction`` f < 1). The softmax work per level is what is left, so the
prefix levels may see only a sample of the target tokens. The main loss then runs as the plain
chunked loss, and the prefix levels as one nested pass over the sampled tokens gathered together
(``f x max(dims) / H`` of a head's matmuls): a handful of sampled tokens per chunk inside the main
pass would re-read the head's columns for each chunk, which measured slower. The flattened tokens are split into
groups of :data:`SAMPLE_GROUP_TOKENS`; in each group the ``ceil(f x group size)`` non-ignored
tokens with the smallest keys are taken (a key is a 32-bit integer hash of the token's position,
its target id, a fingerprint of the whole batch's targets and ``seed``: deterministic, no random
state, different for every batch, no host sync), and each sampled token's prefix loss is scaled
by ``n / m`` (``n`` non-ignored tokens in the group, ``m`` of them sampled). That is a uniform
sample without replacement within each group, so the estimate of the prefix-loss sum is unbiased
(``E[sum_sampled n/m x_i] = sum_i x_i``). The main loss always sees every token. The exact and the
ghost main loss get the same sample (:func:`matryoshka_loss_sum`), whatever the chunk size.

The loss is a sum over tokens (like :func:`maximus.forward.token_loss_sum`): the trainer
divides the main loss and this one by the same token count of the whole optimizer step. No
tokens x vocabulary tensor is ever held. What is not applied to the prefix logits: the head's
bias and a Gemma-style logit soft cap (the prefix logits have a different scale from the full
ones; a cap tuned for the full logits would be arbitrary there); the main level gets both.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from maximus.errors import ConfigError
from maximus.losses.linear_cross_entropy import (
    WEIGHT_GRAD_BLOCK_ROWS,
    _flatten,
    _stats_dtype,
    cast_for_matmul,
    chunk_for_bytes_per_token,
    linear_cross_entropy,
    soft_cap_,
    soft_cap_backward_,
    softmax_cross_entropy_,
    take_scaled_grads,
)
from maximus.structure import IGNORE_INDEX

#: Tokens per sampling group of ``token_fraction``: each group of this many consecutive
#: (flattened) tokens contributes ``ceil(fraction x group)`` sampled tokens, so every stretch of
#: a sequence is represented and the sample does not depend on the chunk size.
SAMPLE_GROUP_TOKENS = 64


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


def _check_fraction(token_fraction: float) -> float:
    fraction = float(token_fraction)
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"matryoshka token_fraction must be in (0, 1], got {token_fraction!r}",
                          hint="e.g. optimization.matryoshka.token_fraction: 0.25 (1 = every target token)")
    return fraction


# ------------------------------------------------------------------------------ token sampling
_LOW32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Mueller's ``0x45d9f3b`` mixer) of int64 values, elementwise; every
    product stays below 2^63, so int64 arithmetic never overflows."""
    x = x & _LOW32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _LOW32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _LOW32
    return x ^ (x >> 16)


def _sample_per_group(group_size: int, fraction: float) -> int:
    """Tokens sampled from a group of ``group_size`` tokens: ``ceil(fraction x group_size)``
    (rounded first, so 0.25 x 64 is exactly 16)."""
    return max(1, math.ceil(round(fraction * group_size, 6)))


def sampled_tokens(target: torch.Tensor, token_fraction: float, ignore_index: int = IGNORE_INDEX,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The target tokens the prefix losses see, and the factor on each one's loss.

    Args:
        target: ``[...]`` next-token ids (flattened here); ``ignore_index`` entries are never
            counted and get factor 0 when a group has fewer valid tokens than samples.
        token_fraction: share of each group of :data:`SAMPLE_GROUP_TOKENS` tokens that is
            sampled, in ``(0, 1]``.
        seed: mixed into every key (change it to draw another sample of the same batch).

    Returns:
        ``(rows, factor)``: ``rows`` [P] int64 flat token indices, ascending (group by group,
        ``ceil(fraction x group size)`` per group), and ``factor`` [P] in the statistics dtype
        (float32): ``n / m`` for a sampled valid token (``n`` valid tokens in its group, ``m`` of
        them sampled), 0 for a sampled ignored one.
    """
    labels = target.reshape(-1)
    n_tokens = labels.shape[0]
    valid = labels != ignore_index
    position = torch.arange(n_tokens, device=labels.device, dtype=torch.int64)
    token_key = _mix32(torch.where(valid, labels.long(), -1) ^ _mix32(position))
    fingerprint = (token_key.sum() + int(seed) * 0x3C6EF372) & _LOW32  # differs from batch to batch
    keys = _mix32(token_key ^ fingerprint)
    keys = torch.where(valid, keys, keys + (1 << 33))  # ignored tokens sort after every valid one
    rows, factors = [], []
    full = (n_tokens // SAMPLE_GROUP_TOKENS) * SAMPLE_GROUP_TOKENS
    for start, end, groups in ((0, full, n_tokens // SAMPLE_GROUP_TOKENS), (full, n_tokens, 1)):
        if end <= start:
            continue
        size = (end - start) // groups
        m = _sample_per_group(size, token_fraction)
        order = keys[start:end].view(groups, size).argsort(dim=1, stable=True)[:, :m]
        local = order.sort(dim=1).values
        picked = local + (start + size * torch.arange(groups, device=labels.device))[:, None]
        group_valid = valid[start:end].view(groups, size)
        n = group_valid.sum(dim=1, keepdim=True).to(torch.float32)
        m_valid = n.clamp(max=m).clamp(min=1.0)
        rows.append(picked.reshape(-1))
        factors.append((valid[picked].to(torch.float32) * (n / m_valid)).reshape(-1))
    if not rows:
        return position, torch.zeros(0, dtype=torch.float32, device=labels.device)
    return torch.cat(rows), torch.cat(factors)


# ------------------------------------------------------------------------------ shared nested pass
@dataclass(frozen=True)
class _NestedPlan:
    """What the nested pass computes (host values only): ``ends`` are the column ends of the
    levels (``[d1, ..., dk]``, plus ``H`` when the main loss is included: ``with_main``);
    ``chunks`` are ``(start, end)`` token ranges."""

    ends: tuple[int, ...]
    with_main: bool
    chunks: tuple[tuple[int, int], ...]
    softcap: float | None
    want_grad: bool


def default_nested_chunk_size(num_tokens: int, vocab_size: int, dtype_bytes: int, levels: int,
                              trainable_head: bool = False) -> int:
    """Tokens per chunk of the nested pass over ``levels`` levels (prefixes, plus the main loss
    when included): a chunk holds one ``C x V`` accumulator in the matmul dtype, one float32
    softmax buffer and ``levels - 1`` stored gradients in the matmul dtype; the exact loss's
    :data:`~maximus.losses.linear_cross_entropy.DEFAULT_CHUNK_TOKENS` for the dtype, fewer when that
    passes its :data:`~maximus.losses.linear_cross_entropy.DEFAULT_CHUNK_LOGITS_BYTES`, with the exact loss's
    floors (64 tokens; 512 with a trainable head, whose weight gradient is one ``V x H`` pass per
    chunk)."""
    per_token = vocab_size * (dtype_bytes + max(dtype_bytes, 4) + (levels - 1) * dtype_bytes)
    return chunk_for_bytes_per_token(num_tokens, per_token, trainable_head, dtype_bytes)


def _add_weight_grad(grad_weight: torch.Tensor | None, g: torch.Tensor, h: torch.Tensor, cols: slice) -> None:
    """``grad_weight[:, cols] += g.T @ h`` (a 16-bit product goes into the float32 accumulator one
    block of rows at a time, so no second ``V x H`` buffer exists)."""
    if grad_weight is None:
        return
    if grad_weight.dtype == g.dtype:
        grad_weight[:, cols].addmm_(g.t(), h)
        return
    for row in range(0, grad_weight.shape[0], WEIGHT_GRAD_BLOCK_ROWS):
        block = slice(row, row + WEIGHT_GRAD_BLOCK_ROWS)
        grad_weight[block, cols].add_(g[:, block].t() @ h)


class _NestedCrossEntropy(torch.autograd.Function):
    """Sum of the main loss (optional) and the weighted prefix-level losses, one pass over chunks.

    ``labels`` are safe (ignored tokens replaced by 0); ``main_weight`` [N] is 1 for a counted
    token, 0 for an ignored one (None without the main level); ``aux_weight`` [N] is the factor
    on each prefix-level token loss (``weight / levels`` x the sampling factor; 0 if ignored).

    Per chunk, the logits are built block by block into one accumulator (``addmm_`` in the matmul
    dtype: no tokens x vocabulary temporary per block). Each level's softmax runs in one float32
    buffer reused by every level and chunk (a fresh ``C x V`` allocation costs page faults that
    were ~40 % of an elementwise pass on the CPU), and the lower levels' gradients are stored in
    the matmul dtype until the chunk's backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, plan: _NestedPlan, labels, main_weight, aux_weight):
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grads_now = plan.want_grad and (need_hidden or need_weight or need_bias)
        dtype, stats = hidden.dtype, _stats_dtype(hidden.dtype)
        vocab = weight.shape[0]
        grad_hidden = torch.zeros_like(hidden) if grads_now and need_hidden else None
        grad_weight = (torch.zeros(weight.shape, dtype=stats, device=weight.device)
                       if grads_now and need_weight else None)
        grad_bias = (torch.zeros(vocab, dtype=stats, device=weight.device)
                     if grads_now and need_bias and bias is not None else None)
        total = torch.zeros((), dtype=stats, device=hidden.device)
        starts = (0,) + plan.ends[:-1]
        top = len(plan.ends) - 1
        max_rows = max(end - start for start, end in plan.chunks)
        logits_buf = torch.empty(max_rows, vocab, dtype=dtype, device=hidden.device)   # accumulator, then running grad
        softmax_buf = torch.empty(max_rows, vocab, dtype=stats, device=hidden.device)  # one level's softmax at a time
        stored = torch.empty(top, max_rows, vocab, dtype=dtype, device=hidden.device) if grads_now and top else None

        for start, end in plan.chunks:
            rows = end - start
            h_c, labels_c, aux_w = hidden[start:end], labels[start:end], aux_weight[start:end]
            logits, work_buf = logits_buf[:rows], softmax_buf[:rows]
            for level, (lo, hi) in enumerate(zip(starts, plan.ends)):
                if level == 0:
                    torch.mm(h_c[:, lo:hi], weight[:, lo:hi].t(), out=logits)
                else:
                    logits.addmm_(h_c[:, lo:hi], weight[:, lo:hi].t())
                work = work_buf.copy_(logits)
                if plan.with_main and level == top:
                    main_w = main_weight[start:end]
                    if bias is not None:
                        work.add_(bias)
                    work, tanh = soft_cap_(work, plan.softcap, keep_tanh=grads_now)
                    loss, _, grad = softmax_cross_entropy_(work, labels_c, main_w, 0.0, grads_now)
                    total += (loss * main_w).sum()
                    if grad is not None:
                        grad = soft_cap_backward_(grad, tanh)
                        if grad_bias is not None:
                            grad_bias.add_(grad.sum(dim=0))
                else:
                    loss, _, grad = softmax_cross_entropy_(work, labels_c, aux_w, 0.0, grads_now)
                    total += (loss * aux_w).sum()
                if grad is not None:  # the top level's gradient replaces the accumulator: the running sum
                    (stored[level, :rows] if level < top else logits).copy_(grad)
                del work, grad
            if not grads_now:
                continue
            # Backward of the chunk, last block first: block j's logit gradient is the sum of the
            # gradients of levels j..top, one level added per step.
            for level in range(top, -1, -1):
                if level < top:
                    logits.add_(stored[level, :rows])
                cols = slice(starts[level], plan.ends[level])
                if grad_hidden is not None:
                    grad_hidden[start:end, cols] = logits @ weight[:, cols]
                _add_weight_grad(grad_weight, logits, h_c[:, cols], cols)

        ctx.weight_dtype = weight.dtype
        ctx.grads = [grad_hidden, grad_weight, grad_bias] if grads_now else None
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, grad_bias = take_scaled_grads(ctx, grad_output, "matryoshka loss")
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _nested_loss(hidden, weight, target, used, scale, *, with_main, token_fraction, chunk_size,
                 ignore_index, bias, softcap, seed) -> torch.Tensor:
    """Flatten, cast, sample and run :class:`_NestedCrossEntropy` (``used`` non-empty; with
    ``with_main`` every token is used)."""
    flat_hidden, flat_labels = _flatten(hidden, weight, target, bias if with_main else None)
    flat_hidden, weight, bias = cast_for_matmul(flat_hidden, weight, bias if with_main else None)
    stats = _stats_dtype(flat_hidden.dtype)
    valid = flat_labels != ignore_index
    safe_labels = torch.where(valid, flat_labels, torch.zeros_like(flat_labels))
    if token_fraction < 1.0:
        # Prefix levels only, on the sampled tokens alone (autograd scatters their gradient back).
        rows, factor = sampled_tokens(flat_labels, token_fraction, ignore_index, seed)
        flat_hidden, safe_labels = flat_hidden.index_select(0, rows), safe_labels.index_select(0, rows)
        aux_weight = factor.to(stats) * scale
    else:
        aux_weight = valid.to(stats) * scale
    want_grad = torch.is_grad_enabled() and (flat_hidden.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad))
    ends = tuple(used) + ((flat_hidden.shape[-1],) if with_main else ())
    num_tokens = flat_hidden.shape[0]
    if chunk_size is None:
        chunk_size = default_nested_chunk_size(num_tokens, weight.shape[0], flat_hidden.dtype.itemsize, len(ends),
                                               trainable_head=weight.requires_grad and want_grad)
    chunk_size = max(1, int(chunk_size))
    plan = _NestedPlan(ends=ends, with_main=with_main, softcap=softcap if with_main else None, want_grad=want_grad,
                       chunks=tuple((s, min(s + chunk_size, num_tokens)) for s in range(0, num_tokens, chunk_size)))
    main_weight = valid.to(stats) if with_main else None
    with torch.autocast(flat_hidden.device.type, enabled=False):
        total = _NestedCrossEntropy.apply(flat_hidden, weight, bias, plan, safe_labels, main_weight, aux_weight)
    return total if total.dtype == torch.float64 else total.float()


# ------------------------------------------------------------------------------ public SFT losses
def cross_entropy_with_matryoshka(hidden: torch.Tensor, head_weight: torch.Tensor, target: torch.Tensor, *,
                                  dims: Sequence[int] = (64, 128, 256), weight: float = 0.2,
                                  token_fraction: float = 1.0, chunk_size: int | None = None,
                                  ignore_index: int = IGNORE_INDEX, bias: torch.Tensor | None = None,
                                  softcap: float | None = None, seed: int = 0) -> torch.Tensor:
    """Main next-token loss plus the Matryoshka auxiliary loss:
    ``sum_t CE(hidden[t] @ W.T + bias, target[t]) + weight * mean_d sum_t CE(hidden[t, :d] @
    W[:, :d].T, target[t])`` (see the module docstring).

    With ``token_fraction = 1`` one shared nested pass computes the main loss and every prefix
    loss (one head's matmuls in all). With ``token_fraction < 1`` the main loss is the plain
    chunked loss and the prefix levels run as a nested pass over the sampled tokens gathered
    together (:func:`matryoshka_loss_sum`): measured faster than keeping the few sampled tokens
    of each chunk inside the main pass, where every chunk re-reads the head's columns for them.

    Args:
        hidden: ``[..., H]`` final hidden states (after the final norm), any float dtype (the
            matmuls run in :func:`~maximus.losses.linear_cross_entropy.matmul_dtype`).
        head_weight: ``[V, H]`` output embedding; frozen, trainable or a non-leaf LoRA weight.
        target: ``[...]`` next-token ids aligned with ``hidden`` (already shifted);
            ``ignore_index`` positions contribute nothing.
        dims: prefix sizes; sizes ``>= H`` are skipped (:func:`active_dims`).
        weight: factor on the mean over prefixes (``0``: the main loss alone).
        token_fraction: share of target tokens the prefix losses see (:func:`sampled_tokens`;
            unbiased); 1 = every token, the same value as the separate losses.
        chunk_size: tokens per chunk (default :func:`default_nested_chunk_size`).
        ignore_index: label value to skip.
        bias, softcap: the head's bias and Gemma-style soft cap, applied to the main level only.
        seed: mixed into the sampling keys.

    Returns:
        A float32 scalar (float64 for float64 inputs), summed over tokens.

    Raises:
        ConfigError: a bad size, fraction, soft cap or shape.
    """
    used = active_dims(dims, hidden.shape[-1])
    fraction = _check_fraction(token_fraction)
    if softcap is not None and softcap <= 0:
        raise ConfigError(f"softcap must be positive, got {softcap}", hint="use e.g. 30.0 (Gemma 2) or None")
    if not used or weight == 0 or fraction < 1.0:
        main = linear_cross_entropy(hidden, head_weight, target, ignore_index, chunk_size=chunk_size,
                                    softcap=softcap, reduction="sum", bias=bias)
        return main + matryoshka_loss_sum(hidden, head_weight, target, dims=dims, weight=weight, chunk_size=chunk_size,
                                          ignore_index=ignore_index, token_fraction=fraction, seed=seed)
    return _nested_loss(hidden, head_weight, target, used, float(weight) / len(used), with_main=True,
                        token_fraction=1.0, chunk_size=chunk_size, ignore_index=ignore_index,
                        bias=bias, softcap=softcap, seed=seed)


def matryoshka_loss_sum(hidden: torch.Tensor, head_weight: torch.Tensor, target: torch.Tensor, *,
                        dims: Sequence[int] = (64, 128, 256), weight: float = 0.2,
                        chunk_size: int | None = None, ignore_index: int = IGNORE_INDEX,
                        token_fraction: float = 1.0, seed: int = 0) -> torch.Tensor:
    """The auxiliary loss alone, ``weight * mean_d sum_t CE(hidden[t, :d] @ head_weight[:, :d].T,
    target[t])``, for a main loss computed elsewhere (``ghost``, ``naive``). The prefix levels
    share one nested pass (``max(dims) / H`` of a head's matmuls, not ``sum(dims) / H``), over
    the sampled tokens only when ``token_fraction < 1``.

    Args:
        hidden: ``[..., H]`` final hidden states (after the final norm), any float dtype.
        head_weight: ``[V, H]`` output embedding (a LoRA head's effective weight works: the
            gradient flows on).
        target: ``[...]`` next-token ids aligned with ``hidden`` (already shifted);
            ``ignore_index`` positions contribute nothing.
        dims: prefix sizes; sizes ``>= H`` are skipped (see :func:`active_dims`); the mean is
            over the remaining sizes.
        weight: factor on the mean over prefixes (``0`` returns a zero without computing).
        chunk_size: tokens per chunk (default: :func:`default_nested_chunk_size`).
        ignore_index: label value to skip.
        token_fraction, seed: token sampling (:func:`sampled_tokens`); 1 = every token.

    Returns:
        A float32 scalar (float64 for float64 inputs): summed over tokens (not averaged), 0 when
        no prefix is active.

    Raises:
        ConfigError: a bad size, fraction or shape.
    """
    used = active_dims(dims, hidden.shape[-1])
    fraction = _check_fraction(token_fraction)
    if not used or weight == 0:
        return torch.zeros((), dtype=torch.float32, device=hidden.device)
    return _nested_loss(hidden, head_weight, target, used, float(weight) / len(used), with_main=False,
                        token_fraction=fraction, chunk_size=chunk_size, ignore_index=ignore_index,
                        bias=None, softcap=None, seed=seed)


def separate_matryoshka_loss_sum(hidden: torch.Tensor, head_weight: torch.Tensor, target: torch.Tensor, *,
                                 dims: Sequence[int] = (64, 128, 256), weight: float = 0.2,
                                 chunk_size: int | None = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The reference: one chunked exact cross-entropy per prefix (``sum(dims) / H`` of the head's
    matmuls again), every token. Same value and gradients as :func:`matryoshka_loss_sum` with
    ``token_fraction=1``; kept as the oracle in tests and benchmarks."""
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
