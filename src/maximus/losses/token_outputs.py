"""Per-token statistics of ``softmax(hidden @ weight.T)`` chunk by chunk, never the full logits.

This is what a fused LM head returns (TRL's ``fused_lm_head=True`` protocol): for every token the
log-probability of its label, and on request the entropy of the next-token distribution,
``log(sum_v p_v^2)``, the mean logit and whether the label is the argmax. Logits follow
``z = softcap(hidden @ weight.T + bias) / temperature`` (TRL's order; the softcap is Gemma's
``c * tanh(y / c)``).

Memory: one ``C x V`` buffer (float32; plus the matmul's ``C x V`` output for 16-bit inputs),
allocated once per call and reused by every chunk, as the exact loss does
(:class:`~maximus.losses.linear_cross_entropy.ChunkScratch`). Everything else works in place or
on a block of rows at a time (1/8 of the chunk, :data:`ROW_BLOCKS_PER_CHUNK`):

* the buffer holds ``u``: the raw logits, or ``tanh(y / c)`` with a softcap, so that
  ``z = a * u`` (``a = 1 / temperature``, times ``c`` with a softcap) and the softcap's backward
  factor ``1 - tanh^2`` are both read from it;
* per row block: ``z`` (a view when ``a == 1``), the log-sum-exp, then ``p = exp(z - lse)``;
  entropy ``= lse - sum p*z`` and ``log sum p^2`` are row dot products (no product tensor), the
  top-1 is ``argmax z`` (the first maximum, as TRL counts ties), the mean logit ``mean z``;
* a gradient of the logits overwrites the block's ``u`` in place, once the block's statistics
  are read: the buffer turns into ``d / d y`` chunk by chunk, then into ``C x H`` by one matmul.

Measured before this layout (issue 18, TRL ``SFTTrainer`` on the 128k-vocabulary reference model):
seven out-of-place ``512 x 128,256`` float32 temporaries (250 MiB each) were alive at once, 1.8 GiB
of the run's 2.1 GiB peak.

Gradients flow to ``log_probs`` and ``entropy``:

* a frozen head (LoRA / QLoRA, the common case) and a gradient only through ``log_probs``:
  forward also forms ``A_i = d log p_i / d hidden_i`` (one ``C x V @ V x H`` matmul per chunk,
  ``N x H`` kept), and backward is a row scale ``grad_i * A_i``: two head matmuls in all, where
  recomputing would take three;
* anything else (a trainable head, a gradient through ``entropy``): backward recomputes each
  chunk's logits into the same kind of reused buffer and forms the gradient in place.

`naive_token_outputs` is the full-logits reference beside it.
"""
from __future__ import annotations

import torch

from maximus.structure import IGNORE_INDEX
from maximus.losses.linear_cross_entropy import (ChunkScratch, _accumulator_dtype, _apply_chunk_grad, _chunk_logits,
                                                 _stats_dtype, cast_for_matmul, default_chunk_size)

#: Fields a caller may ask for besides ``log_probs`` (always computed).
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

#: A chunk's per-row statistics are computed in this many blocks of rows, so each temporary of a
#: block (``p``; ``z`` when the logits are scaled) is 1/8 of the chunk buffer. Not cache-sized
#: blocks: every op is an OpenMP parallel region, and with many small ones a thread that loses
#: its core stalls them all. Measured (2 threads, V = 128,256, 1,024 tokens, forward, another
#: process busy on one core): blocks of 4 rows (2 MiB) 8.0-13.1 s, 32 rows 4.7-5.4 s, 64 rows
#: (1/8 of a 512-token chunk) 4.1-4.3 s, 128 rows 4.1 s; the former out-of-place code 5.5 s.
ROW_BLOCKS_PER_CHUNK = 8


def _row_blocks(rows: int):
    step = max(1, -(-rows // ROW_BLOCKS_PER_CHUNK))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def _chunk_u(h_c, weight, bias, softcap, scratch):
    """The chunk's ``u`` in the reused statistics buffer: raw logits, or ``tanh(y / softcap)``."""
    u = _chunk_logits(h_c, weight, bias, scratch)
    if softcap is not None:
        u.div_(softcap).tanh_()
    return u


def _logit_grad_(u, z, p, labels, grad_lp, grad_ent, entropy, lse, softcap, inv_t):
    """Overwrite ``u`` (one row block) with ``d(sum_i grad_lp_i log p_i + grad_ent_i H_i) / d y``,
    y the raw logits, given ``z`` (may alias ``u``) and ``p``, whose buffer it also consumes.

    ``d log p_l / d z = onehot(l) - p``; ``d H / d z = -p (z - lse + H)``;
    ``d z / d y = inv_t`` (times ``1 - tanh^2`` with a softcap)."""
    if grad_ent is not None:
        coef = torch.add(z, (entropy - lse)[:, None]).mul_(grad_ent[:, None])  # z - lse + H, weighted
        if grad_lp is not None:
            coef.add_(grad_lp[:, None])
        grad_z = coef.mul_(p).neg_()
    else:
        grad_z = p.mul_(grad_lp[:, None]).neg_()
    if grad_lp is not None:
        grad_z.scatter_add_(1, labels[:, None], grad_lp[:, None])
    if softcap is None:
        torch.mul(grad_z, inv_t, out=u)  # z (if it aliased u) is no longer needed
    else:
        u.square_().neg_().add_(1.0).mul_(grad_z)
        if inv_t != 1.0:
            u.mul_(inv_t)
    return u


def _rowdot(a, b):
    """Row-wise dot products of two [R, V] tensors, without their product tensor."""
    return torch.bmm(a[:, None, :], b[:, :, None]).view(-1)


class _TokenOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, softcap, inv_t, chunk_size, want):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        stats = _stats_dtype(hidden.dtype)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        eager = need_hidden and not need_weight and not need_bias
        scale = inv_t * (softcap if softcap is not None else 1.0)  # z = scale * u
        log_z = torch.empty(n, dtype=stats, device=hidden.device)
        log_probs = torch.empty_like(log_z)
        entropy = torch.empty_like(log_z) if "entropy" in want else None
        sq = torch.empty_like(log_z) if "log_sum_sq_probs" in want else None
        mean = torch.empty_like(log_z) if "mean_logits" in want else None
        top1 = torch.empty(n, dtype=torch.bool, device=hidden.device) if "is_top1" in want else None
        basis = torch.empty_like(hidden) if eager else None
        ones = torch.ones(n, dtype=stats, device=hidden.device) if eager else None
        scratch = ChunkScratch()
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            u = _chunk_u(hidden[start:end], weight, bias, softcap, scratch)
            for r0, r1 in _row_blocks(end - start):
                rows = slice(start + r0, start + r1)
                u_b, lab = u[r0:r1], labels[rows]
                z = u_b if scale == 1.0 else u_b * scale
                row_max = z.amax(dim=1)
                p = torch.sub(z, row_max[:, None]).exp_()
                total = p.sum(dim=1)
                lse = row_max + total.log()
                p.div_(total[:, None])
                log_z[rows] = lse
                log_probs[rows] = z.gather(1, lab[:, None]).squeeze(1) - lse
                if top1 is not None:
                    top1[rows] = z.argmax(dim=1) == lab  # the first maximum, as TRL counts ties
                if mean is not None:
                    mean[rows] = z.mean(dim=1)
                if entropy is not None:
                    entropy[rows] = lse - _rowdot(p, z)
                if sq is not None:
                    sq[rows] = _rowdot(p, p).log()
                if eager:
                    _logit_grad_(u_b, z, p, lab, ones[rows], None, None, lse, softcap, inv_t)
                del z, p
            if eager:
                _apply_chunk_grad(u, hidden[start:end], weight, start, end, basis, None, None, scratch)
        del scratch
        ctx.save_for_backward(hidden, weight, bias, labels, log_z, entropy, basis)
        ctx.options = (softcap, inv_t, chunk_size)
        ctx.mark_non_differentiable(*(x for x in (sq, mean, top1) if x is not None))
        return log_probs, entropy, sq, mean, top1

    @staticmethod
    def backward(ctx, grad_lp, grad_ent, *_):
        hidden, weight, bias, labels, log_z, entropy, basis = ctx.saved_tensors
        softcap, inv_t, chunk_size = ctx.options
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if grad_lp is None and grad_ent is None:
            return (None,) * 8
        if basis is not None and grad_ent is None:
            grad = (basis * grad_lp.to(log_z.dtype)[:, None]).to(hidden.dtype)  # computed in float32 or wider
            return grad, None, None, None, None, None, None, None
        stats, vocab = log_z.dtype, weight.shape[0]
        scale = inv_t * (softcap if softcap is not None else 1.0)
        grad_lp = None if grad_lp is None else grad_lp.to(stats)
        grad_ent = None if grad_ent is None else grad_ent.to(stats)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=_accumulator_dtype(weight), device=weight.device) if need_weight else None
        grad_bias = torch.zeros(vocab, dtype=stats, device=weight.device) if need_bias else None
        scratch = ChunkScratch()
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h_c = hidden[start:end]
            u = _chunk_u(h_c, weight, bias, softcap, scratch)
            for r0, r1 in _row_blocks(end - start):
                rows = slice(start + r0, start + r1)
                u_b, lse = u[r0:r1], log_z[rows]
                z = u_b if scale == 1.0 else u_b * scale
                p = torch.sub(z, lse[:, None]).exp_()
                _logit_grad_(u_b, z, p, labels[rows], None if grad_lp is None else grad_lp[rows],
                             None if grad_ent is None else grad_ent[rows],
                             None if entropy is None else entropy[rows], lse, softcap, inv_t)
                del z, p
            _apply_chunk_grad(u, h_c, weight, start, end, grad_hidden, grad_weight, grad_bias, scratch)
        del scratch
        return (grad_hidden,
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(weight.dtype), None, None, None, None, None)


def token_outputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                  outputs: tuple[str, ...] = ("log_probs",), bias: torch.Tensor | None = None,
                  softcap: float | None = None, temperature: float = 1.0,
                  chunk_size: int | None = None) -> dict[str, torch.Tensor | None]:
    """Per-token fields of ``softmax(softcap(hidden @ weight.T + bias) / temperature)``.

    ``hidden`` [N, H] and ``labels`` [N] (valid ids: select the labelled rows first) ->
    ``{"log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"}``, each [N] (float32;
    ``is_top1`` bool), None for a field not in ``outputs``. ``log_probs`` and ``entropy`` are
    differentiable with respect to ``hidden``, ``weight`` and ``bias``. ``chunk_size`` tokens per
    chunk (default :func:`~maximus.losses.linear_cross_entropy.default_chunk_size`, the exact
    loss's rule: the working memory is one ``chunk_size x V`` buffer, as there)."""
    unknown = [name for name in outputs if name != "log_probs" and name not in OPTIONAL_OUTPUTS]
    if unknown:
        raise ValueError(f"token_outputs: unknown output {unknown[0]!r} (use log_probs or one of {OPTIONAL_OUTPUTS})")
    hidden, weight, bias = cast_for_matmul(hidden, weight, bias)
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], weight.shape[0], hidden.element_size(),
                                        trainable_head=weight.requires_grad and torch.is_grad_enabled())
    with torch.autocast(hidden.device.type, enabled=False):
        values = _TokenOutputs.apply(hidden, weight, bias, labels, softcap, 1.0 / float(temperature),
                                     max(1, int(chunk_size)), tuple(outputs))
    return dict(zip(("log_probs",) + OPTIONAL_OUTPUTS, values))


def naive_token_outputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                        outputs: tuple[str, ...] = ("log_probs",), bias: torch.Tensor | None = None,
                        softcap: float | None = None, temperature: float = 1.0) -> dict[str, torch.Tensor | None]:
    """The reference: the same fields from the full ``N x V`` logits."""
    y = torch.nn.functional.linear(hidden, weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype))
    y = y.to(_stats_dtype(y.dtype))
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    z = y / temperature
    log_p = torch.log_softmax(z, dim=-1)
    p = log_p.exp()
    fields = {"log_probs": log_p.gather(1, labels[:, None]).squeeze(1),
              "entropy": -(p * log_p).sum(dim=1), "log_sum_sq_probs": p.square().sum(dim=1).log(),
              "mean_logits": z.mean(dim=1).detach(), "is_top1": z.argmax(dim=1) == labels}
    fields["log_sum_sq_probs"] = fields["log_sum_sq_probs"].detach()
    return {k: (v if k == "log_probs" or k in outputs else None) for k, v in fields.items()}


def label_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                    bias: torch.Tensor | None = None, softcap: float | None = None, temperature: float = 1.0,
                    ignore_index: int = IGNORE_INDEX, chunk_size: int | None = None, mode: str = "exact") -> torch.Tensor:
    """Per-token ``log p(label)`` under ``softmax(softcap(hidden @ weight.T + bias) / temperature)``,
    shaped like ``labels`` (float32, 0 where ``labels == ignore_index``), differentiable: the one
    per-token log-prob of the preference and GRPO objectives.

    ``mode`` ``exact`` never holds the full logits: `token_outputs` over the labelled rows only
    (a frozen head's backward is a row scale of the basis formed in forward: two head matmuls, where
    the exact loss with ``reduction="none"`` recomputes, over every row: measured 3x faster on 800
    rows, half labelled, vocabulary 32,000, one thread); ``naive`` holds them (the reference path)."""
    from maximus.losses.linear_cross_entropy import naive_cross_entropy

    if mode not in ("exact", "naive"):
        raise ValueError(f"label_log_probs: unknown mode {mode!r} (use exact or naive)")
    if mode == "naive" and (softcap is None or temperature == 1.0):
        scale = 1.0 / float(temperature)
        if scale != 1.0:  # without a softcap the temperature is a scale of hidden and bias
            hidden = hidden * scale
            bias = None if bias is None else bias * scale
        return -naive_cross_entropy(hidden, weight, labels, ignore_index, softcap=softcap, reduction="none", bias=bias)
    flat_labels = labels.reshape(-1)
    valid = flat_labels != ignore_index
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if not bool(valid.any()):  # nothing labelled: zeros, still connected to hidden for backward
        return (flat_hidden[:, 0].float() * 0.0).reshape(labels.shape)
    rows = flat_hidden[valid]
    if mode == "naive":
        picked = naive_token_outputs(rows, weight, flat_labels[valid], bias=bias, softcap=softcap,
                                     temperature=temperature)["log_probs"]
    else:
        picked = token_outputs(rows, weight, flat_labels[valid], bias=bias, softcap=softcap, temperature=temperature,
                               chunk_size=chunk_size)["log_probs"]
    out = torch.zeros(flat_labels.shape, dtype=picked.dtype, device=picked.device)
    out = out.index_put((valid.nonzero().squeeze(1),), picked)
    return out.reshape(labels.shape)
