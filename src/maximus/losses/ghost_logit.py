"""Ghost Logit loss: a sampled softmax over hard candidates plus one logit for everything else.

For each chunk of ``C`` tokens the loss looks at ``K = num_candidates + C`` vocabulary rows only
(capped at the vocabulary size) and replaces the remaining ``V - K`` rows by a single "ghost"
logit, an estimate of ``log(sum over the tail of exp(logit))``. Per token::

    loss_i = logsumexp([logits_i[candidates], ghost_i]) - logits_i[label_i]

How each part is built, and how it fixes the defects listed in docs/benchmarks/reference.md:

* **Candidates** (:func:`select_candidates`). A cheap scan of the whole vocabulary on the first
  ``prefix_dims`` hidden dimensions (Matryoshka-style prefix), one ``C x vocab_chunk`` block at a
  time, so nothing of size ``tokens x vocab`` exists. Each vocabulary row is scored by its best
  approximate log-probability over the chunk's tokens, ``max_i (h_i[:p] . (w_v - mean)[:p] -
  0.5 sigma_i^2)`` (the subtracted term is the Gaussian estimate of token ``i``'s prefix
  log-partition, so that tokens with large norms do not take every slot). The chunk's targets are
  forced in (score ``+inf``); one ``topk`` over distinct vocabulary ids then gives exactly ``K``
  distinct candidates: duplicates cannot occur, and no ``unique``/``nonzero`` (host sync) is used.
* **Ghost logit** (:func:`tail_log_mass`). Treat the tail rows as Gaussian with the tail's own
  mean ``mu`` and per-dimension variance ``var`` (from the whole vocabulary's sums minus the
  candidates' sums, so the tail size is the real ``V - K``). Then
  ``log sum_tail exp(h.w) ~= log(V - K) + h.mu + 0.5 * sum_d h_d^2 var_d`` (the log of the
  Gaussian moment generating function). Adding a constant vector ``c`` to every row shifts
  ``mu`` by ``c`` and leaves ``var`` unchanged, so the ghost shifts by ``h.c`` exactly like every
  true logit: the loss is shift invariant (tested). With a bias, its tail mean and variance are
  added; with a soft cap, the tail mean is capped and the variance scaled by the cap's slope
  (delta method).
* **Gradient.** The loss is differentiated exactly as computed: candidate logits get their exact
  gradient, and the ghost is differentiable in the hidden state (``d ghost / d h = mu + var * h``
  without a cap: the mean tail row under the Gaussian model, what the true softmax pushes ``h``
  away from) and in the tail statistics, hence in every tail row of the weight (``d mu / d w_v =
  1/n``, ``d var / d w_v = 2 (w_v - mu) / n``: see :class:`TailGradient`) and bias. Only the
  choice of candidates (a top-k) is piecewise constant. Detaching the statistics was tried first:
  the unsampled rows then never move, and with a 128k vocabulary whose rows are mostly rare the
  exact held-out loss lagged far behind; the mean-field update costs one ``V x H`` pass per call.
* Gradients are formed chunk by chunk inside forward (the Liger scheme of
  :mod:`maximus.losses.linear_cross_entropy`); no ``.item()`` anywhere; the vocabulary size is read
  from ``weight``.

When ``K`` reaches the vocabulary size the candidates are the whole vocabulary, there is no ghost,
and the loss equals the exact cross-entropy. Evaluation must use the exact loss; this one is for
training only.
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from maximus.errors import ConfigError
from maximus.structure import IGNORE_INDEX
from maximus.losses.linear_cross_entropy import (
    cast_for_matmul,
    _flatten,
    _stats_dtype,
    soft_cap_,
    soft_cap_backward_,
    softmax_cross_entropy_,
)

#: Default tokens per chunk. Candidates are shared by a chunk's tokens, so smaller chunks give each
#: token more of its own hard negatives; the candidate matmuls cost ``N * (num_candidates + C)``.
DEFAULT_GHOST_CHUNK_TOKENS = 256

#: Bytes of one ``C x vocab_chunk`` block of prefix scores in the candidate scan (and of one
#: block of weight rows in float32 when the vocabulary statistics are summed).
SCAN_BLOCK_BYTES = 16 * 2**20


class VocabularyStatistics:
    """Per-call sums over all vocabulary rows, centred on their mean (statistics dtype, no grad).

    ``mean`` [H]: mean row. ``centred_sq_sum`` [H]: sum over rows of ``(w - mean)^2``.
    ``prefix_weight`` [V, p]: centred prefix of every row in the input dtype, for the scan.
    ``prefix_var`` [p]: per-dimension variance of the prefix over the whole vocabulary.
    Bias statistics (``bias_mean``, ``bias_centred_sq_sum``) are 0 without a bias.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prefix_dims: int, block_rows: int):
        vocab, hidden = weight.shape
        stats = _stats_dtype(weight.dtype)
        w = weight.detach()
        total = torch.zeros(hidden, dtype=stats, device=w.device)
        for start in range(0, vocab, block_rows):
            total += w[start:start + block_rows].to(stats).sum(dim=0)
        self.mean = total / vocab
        # Centred second moment in a second pass: no E[w^2] - E[w]^2 cancellation in float32.
        sq = torch.zeros(hidden, dtype=stats, device=w.device)
        for start in range(0, vocab, block_rows):
            sq += (w[start:start + block_rows].to(stats) - self.mean).square_().sum(dim=0)
        self.centred_sq_sum = sq
        self.prefix_dims = prefix_dims
        self.prefix_weight = (w[:, :prefix_dims] - self.mean[:prefix_dims].to(w.dtype)).contiguous()
        self.prefix_var = sq[:prefix_dims] / vocab
        if bias is not None:
            b = bias.detach().to(stats)
            self.bias_mean = b.mean()
            self.bias_centred_sq_sum = (b - self.bias_mean).square().sum()
        else:
            self.bias_mean = self.bias_centred_sq_sum = torch.zeros((), dtype=stats, device=w.device)


def select_candidates(h_c: torch.Tensor, safe_labels_c: torch.Tensor, valid_c: torch.Tensor,
                      stats: VocabularyStatistics, num_total: int, vocab_block: int) -> torch.Tensor:
    """``num_total`` distinct vocabulary ids for one chunk: all its valid targets plus the rows
    with the highest prefix score for any of its tokens (see the module docstring). No host sync."""
    vocab = stats.prefix_weight.shape[0]
    hp = h_c[:, :stats.prefix_dims]
    hp_stats = hp.to(stats.prefix_var.dtype)
    # Gaussian estimate of each token's prefix log-partition (up to a constant shared by all tokens).
    offset = (0.5 * (hp_stats.square() @ stats.prefix_var)).to(hp.dtype)
    best = torch.empty(vocab, dtype=hp.dtype, device=hp.device)
    for start in range(0, vocab, vocab_block):
        scores = hp @ stats.prefix_weight[start:start + vocab_block].t()
        scores.sub_(offset[:, None])
        torch.amax(scores, dim=0, out=best[start:start + vocab_block])
    best = best.float()
    forced = torch.full(valid_c.shape, -math.inf, device=best.device).masked_fill_(valid_c, math.inf)
    best.scatter_reduce_(0, safe_labels_c, forced, reduce="amax")
    return best.topk(num_total, sorted=False).indices


class TailStatistics:
    """Mean and per-dimension variance of the tail rows (and of the tail bias), as leaves that
    autograd can differentiate the ghost with respect to (statistics dtype)."""

    def __init__(self, cand_rows: torch.Tensor, cand_bias: torch.Tensor | None, stats: VocabularyStatistics,
                 num_tail: int, track_weight: bool, track_bias: bool):
        dtype = stats.mean.dtype
        vocab = num_tail + cand_rows.shape[0]
        self.num_tail = num_tail
        centred = cand_rows.to(dtype) - stats.mean
        # Tail sums = whole-vocabulary sums minus candidate sums (centred rows sum to 0 overall).
        self.mean = (stats.mean - centred.sum(dim=0) / num_tail).requires_grad_(track_weight)
        tail_sq = (stats.centred_sq_sum - centred.square().sum(dim=0)).clamp_(min=0.0)
        self.var = (tail_sq / num_tail - (self.mean.detach() - stats.mean).square()).clamp_(min=0.0)
        self.var.requires_grad_(track_weight)
        self.bias_mean = self.bias_var = None
        if cand_bias is not None:
            b = cand_bias.to(dtype)
            self.bias_mean = ((stats.bias_mean * vocab - b.sum()) / num_tail).requires_grad_(track_bias)
            self.bias_var = ((stats.bias_centred_sq_sum - (b - stats.bias_mean).square().sum()) / num_tail
                             - (self.bias_mean.detach() - stats.bias_mean).square()).clamp(min=0.0)
            self.bias_var.requires_grad_(track_bias)


def tail_log_mass(h: torch.Tensor, tail: TailStatistics, softcap: float | None) -> torch.Tensor:
    """Ghost logit per token: estimate of ``log sum_{v in tail} exp(logit_v)``, differentiable in
    ``h`` [C, H] (statistics dtype) and in the tail statistics."""
    mean_logit = h @ tail.mean
    var_logit = h.square() @ tail.var
    if tail.bias_mean is not None:
        mean_logit = mean_logit + tail.bias_mean
        var_logit = var_logit + tail.bias_var
    if softcap is None:
        # log E[exp(x)] for x ~ N(m, s^2) is m + s^2 / 2 exactly.
        return math.log(tail.num_tail) + mean_logit + 0.5 * var_logit
    # Capped logits are bounded, far from log-normal: integrate E[exp(cap(x))] by Gauss-Hermite.
    nodes, log_weights = _gauss_hermite(h.dtype, h.device)
    x = mean_logit[:, None] + (2.0 * var_logit).clamp(min=1e-12).sqrt()[:, None] * nodes
    return math.log(tail.num_tail) + torch.logsumexp(softcap * torch.tanh(x / softcap) + log_weights, dim=1)


class TailGradient:
    """Mean-field weight (and bias) gradient of the ghost logits, accumulated over chunks.

    With ``mu = mean`` and ``var = mean (w - mu)^2`` over the ``n`` tail rows of a chunk,
    ``d mu / d w_v = 1/n`` and ``d var / d w_v = 2 (w_v - mu) / n`` for every tail row ``v``. So
    the chunk adds ``(d_mu + 2 d_var * (w_v - mu)) / n`` to every row outside its candidates.
    This is kept as two ``H`` vectors for all rows (``const + scale * w_v``) plus a correction
    scattered onto the chunk's candidate rows, and applied in one pass at the end: no ``V x H``
    work per chunk.
    """

    def __init__(self, hidden_size: int, dtype, device):
        self.const = torch.zeros(hidden_size, dtype=dtype, device=device)
        self.scale = torch.zeros(hidden_size, dtype=dtype, device=device)
        self.bias_const = torch.zeros((), dtype=dtype, device=device)
        self.bias_scale = torch.zeros((), dtype=dtype, device=device)

    def add_chunk(self, tail: TailStatistics, ghost_grads: dict, cand, rows, cand_bias, grad_weight, grad_bias):
        """Fold one chunk's ``d loss / d`` (tail mean, var, bias mean, bias var) into the gradients."""
        n = tail.num_tail
        if grad_weight is not None and "mean" in ghost_grads:
            scale = 2.0 * ghost_grads["var"] / n
            const = ghost_grads["mean"] / n - scale * tail.mean.detach()
            self.const += const
            self.scale += scale
            # Candidates are not in this chunk's tail: take back what const + scale * w gives them.
            grad_weight.index_put_((cand,), -(const + scale * rows.to(const.dtype)), accumulate=True)
        if grad_bias is not None and "bias_mean" in ghost_grads:
            b_scale = 2.0 * ghost_grads["bias_var"] / n
            b_const = ghost_grads["bias_mean"] / n - b_scale * tail.bias_mean.detach()
            self.bias_const += b_const
            self.bias_scale += b_scale
            grad_bias.index_put_((cand,), -(b_const + b_scale * cand_bias.to(b_const.dtype)), accumulate=True)

    def apply(self, weight, bias, grad_weight, grad_bias, block_rows: int):
        """Add ``const + scale * w_v`` to every row (one blockwise pass)."""
        for start in range(0, weight.shape[0] if grad_weight is not None else 0, block_rows):
            block = slice(start, start + block_rows)
            grad_weight[block].add_(self.const).addcmul_(weight[block].to(self.scale.dtype), self.scale)
        if grad_bias is not None and bias is not None:
            grad_bias.add_(self.bias_const).add_(self.bias_scale * bias.to(self.bias_scale.dtype))


def _gauss_hermite(dtype: torch.dtype, device, order: int = 24):
    """Nodes t_k and log(w_k / sqrt(pi)) so that E[f(x)], x ~ N(m, s^2), ~ sum_k w_k f(m + sqrt(2) s t_k) / sqrt(pi)."""
    import numpy as np

    nodes, weights = np.polynomial.hermite.hermgauss(order)
    return (torch.as_tensor(nodes, dtype=dtype, device=device),
            torch.as_tensor(np.log(weights / math.sqrt(math.pi)), dtype=dtype, device=device))


class _GhostLogitLoss(torch.autograd.Function):
    """Forward computes the loss and, when needed, all gradients; backward scales them.

    `forward` is one sectioned math kernel (vocabulary statistics, then per chunk the candidate
    scan, the candidates' exact logits and their gradients): the gradients are formed chunk by
    chunk while each chunk's logits exist, so the pass cannot be split without keeping them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, chunk_size, num_candidates,
                prefix_dims, z_loss, softcap, reduction):
        """One function of sections (vocabulary statistics, then per chunk: candidate scan, exact
        logits, gradients) rather than several: each chunk's gradients are formed while its logits
        exist, so splitting the pass would keep them alive between functions (class doc)."""
        num_tokens, _ = hidden.shape
        vocab = weight.shape[0]
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        want_grad = need_hidden or need_weight or need_bias
        stats_dtype = _stats_dtype(hidden.dtype)
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        valid_f = valid.to(stats_dtype)
        token_weight = valid_f / valid_f.sum().clamp(min=1.0) if reduction == "mean" else valid_f

        vocab_block = max(1, SCAN_BLOCK_BYTES // (max(chunk_size, 1) * hidden.element_size()))
        # Statistics pass in blocks of rows of about SCAN_BLOCK_BYTES in float32, never a V x H copy.
        stats_rows = max(1, SCAN_BLOCK_BYTES // (4 * hidden.shape[1]))
        stats = VocabularyStatistics(weight, bias, prefix_dims, block_rows=stats_rows)
        position = torch.zeros(vocab, dtype=torch.long, device=hidden.device)  # vocab id -> column

        losses = torch.empty(num_tokens, dtype=stats_dtype, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=stats_dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(vocab, dtype=stats_dtype, device=weight.device) if need_bias else None
        tail_grad = TailGradient(hidden.shape[1], stats_dtype, hidden.device)

        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            h_c, y_c, w_c = hidden[start:end], safe_labels[start:end], token_weight[start:end]
            num_total = min(vocab, num_candidates + (end - start))
            if num_total == vocab:  # candidates cover everything: exact, no ghost
                cand = torch.arange(vocab, device=hidden.device)
            else:
                cand = select_candidates(h_c, y_c, valid[start:end], stats, num_total, vocab_block)
            rows = weight[cand]
            cand_bias = bias[cand] if bias is not None else None
            raw = torch.addmm(cand_bias, h_c, rows.t()) if bias is not None else h_c @ rows.t()
            cand_logits, tanh = soft_cap_(raw.to(stats_dtype), softcap, keep_tanh=want_grad)
            h_leaf = ghost = tail = None
            if num_total < vocab:
                with torch.enable_grad():
                    h_leaf = h_c.detach().to(stats_dtype).requires_grad_(need_hidden)
                    tail = TailStatistics(rows.detach(), cand_bias, stats, vocab - num_total,
                                          track_weight=need_weight, track_bias=need_bias)
                    ghost = tail_log_mass(h_leaf, tail, softcap)
                logits = torch.cat([cand_logits, ghost.detach()[:, None]], dim=1)
            else:
                logits = cand_logits
            position[cand] = torch.arange(num_total, device=hidden.device)
            # Ignored tokens point at column 0 (their weight is 0): position[] may be stale for them.
            columns = torch.where(valid[start:end], position[y_c], 0)
            loss_c, _, grad = softmax_cross_entropy_(logits, columns, w_c, z_loss, want_grad)
            losses[start:end] = loss_c
            if grad is None:
                continue
            grad_cand = soft_cap_backward_(grad[:, :num_total], tanh)
            if grad_bias is not None:
                grad_bias.index_put_((cand,), grad_cand.sum(dim=0), accumulate=True)
            g = grad_cand.to(h_c.dtype)
            if grad_weight is not None:
                # index_put_ (candidates are distinct): CPU index_add_ is ~10x slower here.
                grad_weight.index_put_((cand,), (g.t() @ h_c).to(stats_dtype), accumulate=True)
            ghost_grads = {}
            if ghost is not None:
                leaves = {"h": h_leaf, "mean": tail.mean, "var": tail.var,
                          "bias_mean": tail.bias_mean, "bias_var": tail.bias_var}
                leaves = {k: v for k, v in leaves.items() if v is not None and v.requires_grad}
                if leaves:
                    ghost_grads = dict(zip(leaves, torch.autograd.grad(ghost, list(leaves.values()),
                                                                       grad[:, num_total])))
                tail_grad.add_chunk(tail, ghost_grads, cand, rows, cand_bias, grad_weight, grad_bias)
            if grad_hidden is not None:
                gh = (g @ rows).to(stats_dtype)
                if "h" in ghost_grads:
                    gh += ghost_grads["h"]
                grad_hidden[start:end] = gh
        losses.mul_(valid_f)
        if need_weight or need_bias:
            tail_grad.apply(weight, bias, grad_weight, grad_bias, stats_rows)

        ctx.grads = [grad_hidden, grad_weight, grad_bias] if want_grad else None
        ctx.weight_dtype = weight.dtype
        total = losses.sum()
        return total / valid_f.sum().clamp(min=1.0) if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.grads is None:
            raise RuntimeError("ghost_logit_loss: backward ran twice; retain_graph is not supported")
        grads, ctx.grads = ctx.grads, None
        scale = grad_output.to(_stats_dtype(grad_output.dtype))
        grad_hidden, grad_weight, grad_bias = (None if g is None else g.mul_(scale.to(g.dtype)) for g in grads)
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, grad_bias, *([None] * 8)


def ghost_logit_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                     ignore_index: int = IGNORE_INDEX, *, num_candidates: int = 1024, prefix_dims: int = 64,
                     chunk_size: int | None = None, z_loss: float = 0.0, softcap: float | None = None,
                     reduction: Literal["mean", "sum"] = "mean",
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Ghost Logit sampled softmax loss (training only; see the module docstring).

    Args:
        hidden: ``[..., H]`` hidden states (leading dims flattened); fp32 / bf16 / fp16 / fp64.
        weight: ``[V, H]`` output weight (frozen, trainable, tied or a non-leaf LoRA weight).
        labels: ``[...]`` aligned targets; ``ignore_index`` entries are skipped.
        num_candidates: hard negatives per chunk besides the chunk's targets (``K = this + C``,
            capped at ``V``; at ``V`` the loss is exact).
        prefix_dims: leading hidden dimensions used by the candidate scan (clamped to ``H``).
        chunk_size: tokens per chunk (default :data:`DEFAULT_GHOST_CHUNK_TOKENS`).
        z_loss, softcap, bias: as in :func:`maximus.losses.linear_cross_entropy`.
        reduction: ``"mean"`` over non-ignored tokens (0 when there are none) or ``"sum"``.

    Returns:
        Scalar loss (float32; float64 for float64 inputs).
    """
    if reduction not in ("mean", "sum"):
        raise ConfigError(f"ghost_logit_loss supports reduction 'mean' or 'sum', not {reduction!r}",
                          hint="use linear_cross_entropy for per-token losses")
    if num_candidates < 1 or prefix_dims < 1:
        raise ConfigError("ghost_logit_loss needs num_candidates >= 1 and prefix_dims >= 1",
                          hint="set optimization.ghost_logit.candidates and prefix_dims to positive integers")
    if softcap is not None and softcap <= 0:
        raise ConfigError(f"softcap must be positive, got {softcap}", hint="use e.g. 30.0 (Gemma 2) or None")
    flat_hidden, flat_labels = _flatten(hidden, weight, labels, bias)
    flat_hidden, weight, bias = cast_for_matmul(flat_hidden, weight, bias)
    chunk = max(1, int(chunk_size or DEFAULT_GHOST_CHUNK_TOKENS))
    with torch.autocast(flat_hidden.device.type, enabled=False):
        return _GhostLogitLoss.apply(flat_hidden, weight, bias, flat_labels, ignore_index, chunk,
                                     int(num_candidates), min(int(prefix_dims), weight.shape[1]),
                                     float(z_loss), softcap, reduction)
