"""Fused rotary position embedding for q and k together, forward and hand-derived backward.

Transformers' convention (``rotate_half``): with the head dim split in halves ``x = [x1, x2]`` and
``cos = [c1, c2]``, ``sin = [s1, s2]`` (Llama's tables repeat one half, so c1 = c2 and s1 = s2):
``y1 = x1 * c1 - x2 * s1`` and ``y2 = x2 * c2 + x1 * s2``. The backward is the transposed map,
``dx1 = dy1 * c1 + dy2 * s2`` and ``dx2 = dy2 * c2 - dy1 * s1``: a rotation by -theta, i.e. the
same kernel with the sines negated and swapped between halves.

``cos`` / ``sin`` are the per-token tables the model's rotary module computes from ``position_ids``
(shape (batch or 1, seq, head_dim)), so packed rows whose positions restart are handled as they are
in Transformers. One program per token rotates every q head and every k head of that token: cos and
sin are read once, and q and k are read and written once each (eager reads them three times and
writes four temporaries). Strided inputs (the usual transposed q/k views) are read in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from maximus.kernels.triton.runtime import require_launchable


@triton.jit
def _rope_rotate(X, Y, b, t, sxb, sxh, sxt, sxd, syb, syh, syt, syd, c1, c2, s1, s2, n_heads, half,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (dims < half)
    x_row = X + b * sxb + t * sxt + heads * sxh
    y_row = Y + b * syb + t * syt + heads * syh
    x1 = tl.load(x_row + dims * sxd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (dims + half) * sxd, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_row + dims * syd, (x1 * c1 - x2 * s1).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_row + (dims + half) * syd, (x2 * c2 + x1 * s2).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, seq_len, half, n_q_heads, n_k_heads,
                 sqb, sqh, sqt, sqd, sqob, sqoh, sqot, sqod,
                 skb, skh, skt, skd, skob, skoh, skot, skod,
                 scb, sct, scd, ssb, sst, ssd,
                 BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    b = token // seq_len
    t = token % seq_len
    dims = tl.arange(0, BLOCK_D)[None, :]
    dmask = dims < half
    c1 = tl.load(COS + b * scb + t * sct + dims * scd, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + b * scb + t * sct + (dims + half) * scd, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + b * ssb + t * sst + dims * ssd, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + b * ssb + t * sst + (dims + half) * ssd, mask=dmask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of [[c1, -s1], [s2, c2]] is [[c1, s2], [-s1, c2]]
        s1, s2 = -s2, -s1
    _rope_rotate(Q, QO, b, t, sqb, sqh, sqt, sqd, sqob, sqoh, sqot, sqod, c1, c2, s1, s2, n_q_heads, half,
                 BLOCK_QH, BLOCK_D)
    _rope_rotate(K, KO, b, t, skb, skh, skt, skd, skob, skoh, skot, skod, c1, c2, s1, s2, n_k_heads, half,
                 BLOCK_KH, BLOCK_D)


def _table_strides(table: torch.Tensor, batch: int) -> tuple[int, int, int]:
    """(batch, seq, dim) strides of a (1 or batch, seq, dim) cos/sin table; stride 0 broadcasts batch."""
    if table.dim() != 3 or table.shape[0] not in (1, batch):
        raise ValueError(f"rope: cos/sin must be (batch or 1, seq, head_dim), got {tuple(table.shape)}")
    return (table.stride(0) if table.shape[0] == batch else 0), table.stride(1), table.stride(2)


def _launch(q, k, cos, sin, backward: bool):
    """Rotate (B, H, T, D) q and k by the tables (or by their inverse) into new tensors of q's/k's layout."""
    batch, n_q_heads, seq_len, head_dim = q.shape
    n_k_heads = k.shape[1]
    q_out = torch.empty_like(q)
    k_out = torch.empty_like(k)
    _rope_kernel[(batch * seq_len,)](
        q, k, q_out, k_out, cos, sin, seq_len, head_dim // 2, n_q_heads, n_k_heads,
        *q.stride(), *q_out.stride(), *k.stride(), *k_out.stride(),
        *_table_strides(cos, batch), *_table_strides(sin, batch),
        BLOCK_QH=triton.next_power_of_2(n_q_heads), BLOCK_KH=triton.next_power_of_2(n_k_heads),
        BLOCK_D=triton.next_power_of_2(head_dim // 2), BACKWARD=backward)
    return q_out, k_out


class RopeFunction(torch.autograd.Function):
    """Autograd wrapper over (B, H, T, D) q and k; saves only the cos/sin tables (no activations)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        require_launchable(_rope_kernel, q, "rope")
        ctx.save_for_backward(cos, sin)
        return _launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq: torch.Tensor | None, dk: torch.Tensor | None):
        cos, sin = ctx.saved_tensors
        dq, dk = _launch(dq, dk, cos, sin, backward=True)
        return dq, dk, None, None


def rope_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> bool:
    """True when the fused kernel covers these shapes (full-width rotary, 4-D q/k, matching tables)."""
    if q.dim() != 4 or k.dim() != 4 or unsqueeze_dim not in (1, 2) or cos.shape != sin.shape or cos.dim() != 3:
        return False
    head_dim = q.shape[-1]
    seq_dim = 2 if unsqueeze_dim == 1 else 1
    return (head_dim % 2 == 0 and k.shape[-1] == head_dim and cos.shape[-1] == head_dim
            and cos.shape[1] == q.shape[seq_dim] == k.shape[seq_dim] and cos.shape[0] in (1, q.shape[0])
            and q.shape[0] == k.shape[0])


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for Transformers' `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)` with the fused kernel.

    q: (B, Hq, T, D) and k: (B, Hk, T, D) for unsqueeze_dim=1, or (B, T, H, D) for unsqueeze_dim=2;
    cos / sin: (B or 1, T, D). Returns new tensors (inputs are never written).
    """
    if unsqueeze_dim == 2:  # (B, T, H, D): view as (B, H, T, D); the kernel follows strides
        q_out, k_out = RopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    return RopeFunction.apply(q, k, cos, sin)


def rotate_half_reference(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The same math in eager PyTorch (Transformers' `apply_rotary_pos_emb`, written out)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half_reference(q) * sin, k * cos + rotate_half_reference(k) * sin
