"""Per-token statistics of ``softmax(hidden @ weight.T)`` chunk by chunk, never the full logits.

This is what a fused LM head returns (TRL's ``fused_lm_head=True`` protocol): for every token the
log-probability of its label, and on request the entropy of the next-token distribution,
``log(sum_v p_v^2)``, the mean logit and whether the label is the argmax. Logits follow
``z = softcap(hidden @ weight.T + bias) / temperature`` (TRL's order; the softcap is Gemma's
``c * tanh(y / c)``).

Memory: one chunk of ``C x V`` float32 logits at a time (C = 256 tokens by default, the exact
loss's chunk rule), not TRL's ``4096 x 32768`` tiles and their float copies.

Gradients flow to ``log_probs`` and ``entropy``:

* a frozen head (LoRA / QLoRA, the common case) and a gradient only through ``log_probs``:
  forward also forms ``A_i = d log p_i / d hidden_i`` (one ``C x V @ V x H`` matmul per chunk,
  ``N x H`` float32 kept), and backward is a row scale ``grad_i * A_i``: two head matmuls in all,
  where recomputing would take three;
* anything else (a trainable head, a gradient through ``entropy``): backward recomputes each
  chunk's logits, as :func:`maximus.losses.linear_cross_entropy.token_log_probs` does.

`naive_token_outputs` is the full-logits reference beside it.
"""
from __future__ import annotations

import torch

from maximus.losses.linear_cross_entropy import _stats_dtype, cast_for_matmul, default_chunk_size

#: Fields a caller may ask for besides ``log_probs`` (always computed).
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _chunk_logits(h_c, weight, bias, softcap, inv_t):
    """(z [C, V] in the statistics dtype, tanh or None): the transformed logits of one chunk."""
    raw = torch.addmm(bias, h_c, weight.t()) if bias is not None else h_c @ weight.t()
    y = raw.to(_stats_dtype(raw.dtype))
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(y / softcap)
        y = tanh * softcap
    return (y * inv_t if inv_t != 1.0 else y), tanh


def _logit_grad(z, log_z, labels, grad_lp, grad_ent, entropy, tanh, inv_t):
    """d(sum_i grad_lp_i log p_i + grad_ent_i H_i) / d y for one chunk, y the raw logits."""
    log_p = z - log_z[:, None]
    p = log_p.exp()
    grad = torch.zeros_like(z)
    if grad_lp is not None:
        grad = -p * grad_lp[:, None]
        grad.scatter_add_(1, labels[:, None], grad_lp[:, None])
    if grad_ent is not None:
        grad -= grad_ent[:, None] * p * (log_p + entropy[:, None])
    if inv_t != 1.0:
        grad *= inv_t
    if tanh is not None:
        grad *= 1 - tanh * tanh
    return grad


class _TokenOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, softcap, inv_t, chunk_size, want):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        stats = _stats_dtype(hidden.dtype)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        eager = need_hidden and not need_weight and not need_bias
        log_z = torch.empty(n, dtype=stats, device=hidden.device)
        log_probs = torch.empty_like(log_z)
        entropy = torch.empty_like(log_z) if "entropy" in want else None
        sq = torch.empty_like(log_z) if "log_sum_sq_probs" in want else None
        mean = torch.empty_like(log_z) if "mean_logits" in want else None
        top1 = torch.empty(n, dtype=torch.bool, device=hidden.device) if "is_top1" in want else None
        basis = torch.empty(hidden.shape, dtype=stats, device=hidden.device) if eager else None
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z, tanh = _chunk_logits(hidden[start:end], weight, bias, softcap, inv_t)
            lab = labels[start:end]
            lz = torch.logsumexp(z, dim=1)
            log_z[start:end] = lz
            log_probs[start:end] = z.gather(1, lab[:, None]).squeeze(1) - lz
            if top1 is not None:
                top1[start:end] = z.argmax(dim=1) == lab  # the first maximum, as TRL counts ties
            if mean is not None:
                mean[start:end] = z.mean(dim=1)
            if entropy is not None or sq is not None:
                p = (z - lz[:, None]).exp()
                if entropy is not None:
                    entropy[start:end] = lz - (p * z).sum(dim=1)
                if sq is not None:
                    sq[start:end] = p.square().sum(dim=1).log()
                del p
            if basis is not None:
                ones = torch.ones(end - start, dtype=stats, device=hidden.device)
                grad = _logit_grad(z, lz, lab, ones, None, None, tanh, inv_t)
                basis[start:end] = grad.to(hidden.dtype) @ weight
            del z, tanh
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
            return (basis * grad_lp.to(basis.dtype)[:, None]).to(hidden.dtype), None, None, None, None, None, None, None
        stats = log_z.dtype
        grad_hidden = torch.empty(hidden.shape, dtype=stats, device=hidden.device) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=stats, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=stats, device=weight.device) if need_bias else None
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h_c = hidden[start:end]
            z, tanh = _chunk_logits(h_c, weight, bias, softcap, inv_t)
            grad = _logit_grad(z, log_z[start:end], labels[start:end],
                               None if grad_lp is None else grad_lp[start:end].to(stats),
                               None if grad_ent is None else grad_ent[start:end].to(stats),
                               None if entropy is None else entropy[start:end], tanh, inv_t)
            del z, tanh
            g = grad.to(h_c.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = g @ weight
            if grad_weight is not None:
                grad_weight += (g.t() @ h_c).to(stats)
            if grad_bias is not None:
                grad_bias += grad.sum(dim=0)
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype),
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
    differentiable with respect to ``hidden``, ``weight`` and ``bias``."""
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
