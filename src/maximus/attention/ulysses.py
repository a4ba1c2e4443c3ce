"""Ulysses sequence parallelism: an all-to-all turns "every head, my share of the tokens" into
"my share of the heads, every token", attention runs on whole rows, a second all-to-all turns it
back (DeepSpeed-Ulysses, Jacobs et al. 2023).

The exchange is `torch.distributed.nn.functional.all_to_all_single`, whose backward is the
reverse all-to-all (gloo on CPU has it, NCCL on CUDA). Queries' heads must divide by the degree;
key/value heads that do not (GQA with fewer KV heads than ranks) are repeated up to the query
heads first, which costs the repeated heads' bytes in the exchange.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

from maximus.attention.context_split import ContextSplit, zigzag_indices


def ulysses_fits(num_heads: int, degree: int) -> bool:
    """Whether Ulysses can split `num_heads` query heads over `degree` ranks."""
    return num_heads % degree == 0


def _heads_to_tokens(x: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """[B, H, t, D] (all heads, local tokens) -> [B, H/N, N*t, D] (a head share, the whole row in order)."""
    b, h, t, d = x.shape
    n = split.degree
    send = x.reshape(b, n, h // n, t, d).transpose(0, 1).contiguous()  # slot j: head share j
    received = all_to_all_single(torch.empty_like(send), send, group=split.group)  # slot j: rank j's tokens
    row = received.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)
    return row.index_select(2, split.global_order(t, x.device))


def _tokens_to_heads(x: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """The inverse of `_heads_to_tokens`: [B, H/N, T, D] -> [B, H, T/N, D]."""
    b, hs, length, d = x.shape
    n = split.degree
    t = length // n
    order = torch.cat([zigzag_indices(length, n, r) for r in range(n)]).to(x.device)
    shares = x.index_select(2, order).reshape(b, hs, n, t, d).permute(2, 0, 1, 3, 4).contiguous()  # slot j: rank j's tokens
    received = all_to_all_single(torch.empty_like(shares), shares, group=split.group)  # slot j: head share j
    return received.transpose(0, 1).reshape(b, n * hs, t, d)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, split: ContextSplit, *,
                      scale: float | None = None, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a row split over `split`'s ranks. `query` [B, H, t, D], `key`/`value`
    [B, Hkv, t, D] hold this rank's share of the tokens (`ContextSplit.take`); `document_ids`
    [B, T] (whole row, equal ids = one packed document) restricts attention to each document.
    Returns this rank's share of the output, [B, H, t, D]."""
    heads = query.shape[1]
    if key.shape[1] % split.degree:
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    q, k, v = (_heads_to_tokens(x, split) for x in (query, key, value))
    gqa = k.shape[1] != q.shape[1]
    if document_ids is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:  # one causal call per packed document: no T x T mask, no FLOPs across documents
        rows = []
        length = document_ids.shape[1]
        for b, ids in enumerate(document_ids):
            cuts = [0, *(torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist(), length]
            rows.append(torch.cat([F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e],
                                                                  v[b:b + 1, :, s:e], is_causal=True, scale=scale,
                                                                  enable_gqa=gqa)
                                   for s, e in zip(cuts[:-1], cuts[1:])], dim=2))
        out = torch.cat(rows, dim=0)
    return _tokens_to_heads(out, split)
