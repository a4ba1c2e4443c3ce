"""Ring attention over the zigzag split: keys and values travel round the ranks, each rank
attends its queries to every block it receives, merging the blocks by their log-sum-exp.

Rank ``r`` holds chunks ``r`` and ``2N-1-r`` of the row (`context_split`). A (query chunk, key
chunk) pair is skipped when the key chunk lies after the query chunk (causal), attended with the
causal mask on the diagonal, and attended whole before it; with packed documents a pair is also
masked to equal document ids, and skipped when nothing is left. Under the zigzag split every ring
step costs each rank the same (half of the pairs of a block, or the diagonal), so no rank waits.

The backward is written out (flash-attention's): the softmax is recomputed block by block from
the saved log-sum-exp, and the key/value gradients travel round the ring with their blocks,
arriving home after ``N`` steps. Memory per rank: the local queries, keys, values and output, one
block in flight and one ``chunk x chunk`` score tile, never the whole row. Scores are computed in
fp32 whatever the input dtype. Point-to-point exchange (`batch_isend_irecv`) works on gloo and NCCL.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from maximus.attention.context_split import ContextSplit, zigzag_chunks


def _shift(tensors: list[torch.Tensor], split: ContextSplit) -> list[torch.Tensor]:
    """Send `tensors` to the next rank of the ring and receive the previous rank's."""
    flat = torch.cat([t.reshape(-1) for t in tensors]).contiguous()
    received = torch.empty_like(flat)
    ops = [dist.P2POp(dist.isend, flat, split.peer(1), group=split.group),
           dist.P2POp(dist.irecv, received, split.peer(-1), group=split.group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    out, at = [], 0
    for t in tensors:
        out.append(received[at:at + t.numel()].view_as(t))
        at += t.numel()
    return out


def _pairs(split: ContextSplit, source: int, chunk: int, document_ids, device):
    """(query slice, key slice, mask or None) of every pair of chunks rank `split.rank` attends
    when holding rank `source`'s keys; mask [B, 1, a, b] bool (True = attend)."""
    mine, theirs = zigzag_chunks(split.degree, split.rank), zigzag_chunks(split.degree, source)
    pairs = []
    for qi, q_chunk in enumerate(mine):
        for ki, k_chunk in enumerate(theirs):
            if k_chunk > q_chunk:
                continue
            mask = None
            if k_chunk == q_chunk:
                mask = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()[None, None]
            if document_ids is not None:
                same = (document_ids[:, q_chunk * chunk:(q_chunk + 1) * chunk, None]
                        == document_ids[:, None, k_chunk * chunk:(k_chunk + 1) * chunk])[:, None]
                mask = same if mask is None else mask & same
                if not mask.any():
                    continue
            pairs.append((slice(qi * chunk, (qi + 1) * chunk), slice(ki * chunk, (ki + 1) * chunk), mask))
    return pairs


def _scores(q, k, scale, mask):
    """fp32 scores [B, H, a, b] of queries [B, H, a, D] against keys [B, H, b, D], -inf where masked."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated up to the query heads (GQA)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The inverse of `_expand` for gradients: sum over each key/value head's query group."""
    b, h, t, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, t, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, split, scale, document_ids):
        heads, chunk = query.shape[1], query.shape[2] // 2
        out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        lse = torch.full(query.shape[:3], float("-inf"), dtype=torch.float32, device=query.device)
        k, v = key, value
        for step in range(split.degree):
            if step:
                k, v = _shift([k, v], split)
            source = (split.rank - step) % split.degree
            ke, ve = _expand(k, heads), _expand(v, heads)
            for qs, ks, mask in _pairs(split, source, chunk, document_ids, query.device):
                s = _scores(query[:, :, qs], ke[:, :, ks], scale, mask)
                block_lse = torch.logsumexp(s, dim=-1)
                finite = torch.where(torch.isinf(block_lse), torch.zeros_like(block_lse), block_lse)
                block_out = torch.matmul(torch.exp(s - finite[..., None]), ve[:, :, ks].float())
                merged = torch.logaddexp(lse[:, :, qs], block_lse)
                safe = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
                out[:, :, qs] = (out[:, :, qs] * torch.exp(lse[:, :, qs] - safe)[..., None]
                                 + block_out * torch.exp(block_lse - safe)[..., None])
                lse[:, :, qs] = merged
        ctx.save_for_backward(query, key, value, out, lse, document_ids)
        ctx.split, ctx.scale = split, scale
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, document_ids = ctx.saved_tensors
        split, scale = ctx.split, ctx.scale
        heads, kv_heads, chunk = query.shape[1], key.shape[1], query.shape[2] // 2
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(-1)  # [B, H, t]: rowsum(dO * O) of the softmax backward
        grad_q = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        k, v = key, value
        grad_k = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
        grad_v = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
        for step in range(split.degree):
            source = (split.rank - step) % split.degree
            ke, ve = _expand(k, heads), _expand(v, heads)
            gke, gve = torch.zeros_like(ke, dtype=torch.float32), torch.zeros_like(ve, dtype=torch.float32)
            for qs, ks, mask in _pairs(split, source, chunk, document_ids, query.device):
                s = _scores(query[:, :, qs], ke[:, :, ks], scale, mask)
                p = torch.exp(s - lse[:, :, qs, None])
                go = grad_out[:, :, qs]
                gve[:, :, ks] += torch.matmul(p.transpose(-1, -2), go)
                ds = p * (torch.matmul(go, ve[:, :, ks].float().transpose(-1, -2)) - delta[:, :, qs, None])
                grad_q[:, :, qs] += torch.matmul(ds, ke[:, :, ks].float()) * scale
                gke[:, :, ks] += torch.matmul(ds.transpose(-1, -2), query[:, :, qs].float()) * scale
            grad_k += _fold(gke, kv_heads)
            grad_v += _fold(gve, kv_heads)
            # The block and its gradient move on together; after `degree` moves the gradient is home.
            if step < split.degree - 1:
                k, v, grad_k, grad_v = _shift([k.float(), v.float(), grad_k, grad_v], split)
            elif split.degree > 1:
                grad_k, grad_v = _shift([grad_k, grad_v], split)
        return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype), None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, split: ContextSplit, *,
                   scale: float | None = None, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a row split over `split`'s ranks (zigzag). `query` [B, H, t, D],
    `key`/`value` [B, Hkv, t, D]: this rank's share (`ContextSplit.take`); `document_ids` [B, T]
    (whole row; equal ids = one packed document). Returns this rank's share of the output [B, H, t, D]."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(query, key, value, split, scale, document_ids)
