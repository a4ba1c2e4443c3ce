"""Exact cross-entropy of ``hidden @ weight.T`` that never holds the tokens x vocabulary logits.

The output layer of a large-vocabulary model is where training memory goes: for 8,192 tokens and
a 128,256-row vocabulary, the logits alone are 4 GiB in float32, and autograd keeps two or three
tensors of that size alive (logits, log-softmax, their gradient). This module computes the same
loss and the same gradients one chunk of tokens at a time:

* forward, per chunk of ``C`` tokens: ``logits = h_c @ W.T`` (in the input dtype, so bf16 runs
  bf16 matmuls), then the log-sum-exp and the target logit in float32;
* when a gradient is needed and the reduction is ``mean`` or ``sum`` (the training case), the
  chunk's gradient of the logits is formed right away, in place (``softmax - onehot``), and turned
  into ``grad_hidden[c] = G @ W`` and ``grad_weight += G.T @ h_c`` before the next chunk (the
  Liger-Kernel scheme: three matmuls in all, like the naive loss, and nothing of size
  ``tokens x vocab`` is kept); backward then only multiplies by the incoming scalar;
* for ``reduction="none"`` (and :func:`token_log_probs`), the per-token upstream gradient is only
  known in backward, so backward recomputes each chunk's logits (four matmuls in all).

The peak extra memory is therefore about one chunk of logits (``C x V`` float32, plus a
``C x V`` copy in the input dtype for 16-bit inputs) plus the gradient buffers, instead of several
``N x V`` tensors. A 16-bit trainable head accumulates its gradient over chunks in a float32
``V x H`` buffer (measured: accumulating in bf16 over 64 chunks was 10x less accurate than one
bf16 matmul); a frozen head (LoRA / QLoRA) needs no weight gradient at all.

Semantics follow ``torch.nn.functional.cross_entropy`` on ``hidden @ weight.T + bias``, with one
deliberate difference: when every label is ``ignore_index`` the mean is 0 (with zero gradients),
not NaN, so that a fully masked micro-batch cannot poison a run.
"""
from __future__ import annotations

from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from maximus.errors import ConfigError
from maximus.structure import IGNORE_INDEX

Reduction = Literal["mean", "sum", "none"]

#: Tokens per chunk when none is given, by the width of the input dtype in bytes (2: bf16 / fp16;
#: 4: fp32 and wider). bf16, measured on this CPU (2 threads, 2,048 tokens, frozen head, H = 512;
#: `benchmarks/speed_parts.py buffers`): loss forward + backward at 64 / 87 / 128 / 256 / 512 / 1024-
#: token chunks took 2.10 / 1.95 / 1.79 / 1.66 / 1.70 / 1.81 s at V = 128,256 and 0.49 / 0.46 / 0.42 /
#: 0.40 / 0.41 / 0.45 s at V = 32,000: 256 rows is where the head's matmuls reach the machine's
#: matmul rate while a chunk's rows still sit in cache for the softmax; re-measured with chunks
#: interleaved round by round (`benchmarks/step_cost.py calibrate`): 256 / 512 / 1024 at 1.00 /
#: 1.08 / 1.20x. fp32 (issue 23): 256 / 512 / 1024 at 1.06 / 1.00 / 1.00x the best (same run), and
#: 5.68 / 4.74 / 4.59 s on a 2-core AVX2 CPU (128 is slower still): fp32 matmuls want larger
#: blocks; 512 takes nearly all of 1024's gain at half its logits.
DEFAULT_CHUNK_TOKENS = {2: 256, 4: 512}

#: ...but a default chunk's working logits (float32, plus the 16-bit matmul output) never exceed
#: this many bytes, by input dtype width: 197 MB for 256 x 128k in bf16, 263 MB for 512 x 128k in
#: fp32 (the old single 192 MiB cap cut fp32's 512-token chunk to 392 tokens); Gemma's 256k
#: vocabulary gets 128 / 256 tokens.
DEFAULT_CHUNK_LOGITS_BYTES = {2: 192 * 2**20, 4: 256 * 2**20}

#: Never use chunks smaller than this many tokens unless there are fewer tokens.
MIN_CHUNK_TOKENS = 64

#: With a trainable head every chunk adds ``G.T @ h_c`` into the whole ``V x H`` weight gradient:
#: a full pass over ``V x H`` per chunk whatever the chunk size. Chunks of at least this many
#: tokens keep that pass to ~10-15 % of the chunk's matmul time where matmul rate / memory
#: bandwidth is ~300 flop/byte (this CPU in bf16, and current GPUs); with 87-token chunks the
#: exact loss ran at 0.59x naive's speed at V=128k (docs/benchmarks/losses.md). A frozen head
#: (the LoRA / QLoRA case) has no such pass and keeps the small default.
MIN_CHUNK_TOKENS_TRAINABLE_HEAD = 512

#: Rows per block when a 16-bit weight gradient is added into its float32 accumulator, so the
#: 16-bit product ``G.T @ h_c`` exists one block at a time (not a second ``V x H`` buffer).
WEIGHT_GRAD_BLOCK_ROWS = 8192


def _logits_bytes_per_token(vocab_size: int, dtype_bytes: int) -> int:
    """Working bytes one token adds to a chunk: float32 logits, plus an input-dtype copy when
    the input is narrower than float32 (the matmul output, then the gradient cast back)."""
    return vocab_size * (4 + (dtype_bytes if dtype_bytes < 4 else 0))


def chunk_size_for_budget(num_tokens: int, vocab_size: int, hidden_size: int, dtype_bytes: int,
                          budget_bytes: int) -> int:
    """Tokens per chunk so that one chunk's working set fits in ``budget_bytes``.

    The working set of a chunk of ``C`` tokens is ``C * vocab_size`` float32 logits (plus a copy
    in the input dtype when it is 16-bit) and ``C * hidden_size`` for the chunk's hidden gradient.
    The result is clamped to ``[1, num_tokens]``; a budget too small for even one token still
    gives 1 (the loss cannot use less).
    """
    if num_tokens < 1:
        return 1
    per_token = _logits_bytes_per_token(vocab_size, dtype_bytes) + hidden_size * max(dtype_bytes, 4)
    return int(max(1, min(num_tokens, budget_bytes // max(per_token, 1))))


def default_chunk_size(num_tokens: int, vocab_size: int, dtype_bytes: int, trainable_head: bool = False) -> int:
    """The chunk used when none is given: :data:`DEFAULT_CHUNK_TOKENS` tokens for the dtype, fewer
    when their logits would pass its :data:`DEFAULT_CHUNK_LOGITS_BYTES`, but never fewer than
    :data:`MIN_CHUNK_TOKENS` (:data:`MIN_CHUNK_TOKENS_TRAINABLE_HEAD` when the weight needs a
    gradient), nor more than ``num_tokens``."""
    return chunk_for_bytes_per_token(num_tokens, _logits_bytes_per_token(vocab_size, dtype_bytes), trainable_head,
                                     dtype_bytes)


def chunk_for_bytes_per_token(num_tokens: int, per_token: int, trainable_head: bool = False,
                              dtype_bytes: int = 2) -> int:
    """The default-chunk rule for a loss whose chunk holds ``per_token`` working bytes per token,
    with inputs ``dtype_bytes`` wide: :data:`DEFAULT_CHUNK_TOKENS`, fewer past
    :data:`DEFAULT_CHUNK_LOGITS_BYTES`, never under the floor (:data:`MIN_CHUNK_TOKENS`, or
    :data:`MIN_CHUNK_TOKENS_TRAINABLE_HEAD`), never over ``num_tokens``."""
    width = 4 if dtype_bytes >= 4 else 2
    floor = MIN_CHUNK_TOKENS_TRAINABLE_HEAD if trainable_head else MIN_CHUNK_TOKENS
    chunk = max(floor, min(DEFAULT_CHUNK_TOKENS[width], DEFAULT_CHUNK_LOGITS_BYTES[width] // max(per_token, 1)))
    return int(max(1, min(num_tokens, chunk)))


class ChunkScratch:
    """The two ``C x V`` buffers of a chunk (matmul output in the input dtype, statistics in
    float32), allocated once per loss call and reused by every chunk. A fresh ``C x V`` output per
    chunk costs page faults on every chunk: measured on this CPU (bf16, 1 thread, C = 256,
    V = 128,256, H = 512) a matmul into a reused buffer ran at 202 GFLOP/s, into a new one at 170."""

    def __init__(self):
        self.raw: torch.Tensor | None = None
        self.stats: torch.Tensor | None = None

    def take(self, name: str, rows: int, like: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A ``rows x cols`` view of buffer ``name`` (grown or re-made when it does not fit)."""
        buf = getattr(self, name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols or buf.dtype != dtype or buf.device != like.device:
            buf = torch.empty(rows, cols, dtype=dtype, device=like.device)
            setattr(self, name, buf)
        return buf[:rows]


def _chunk_logits(h_c: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  scratch: ChunkScratch | None = None) -> torch.Tensor:
    """``h_c @ weight.T (+ bias)`` in the input dtype, returned in the statistics dtype (float32,
    or float64 for float64 inputs; no copy when they agree). With ``scratch`` both live in its
    reused buffers (the result is overwritten by the next chunk)."""
    stats_dtype = _stats_dtype(h_c.dtype)
    if scratch is None:
        raw = torch.addmm(bias, h_c, weight.t()) if bias is not None else h_c @ weight.t()
        return raw.to(stats_dtype)
    rows, vocab = h_c.shape[0], weight.shape[0]
    raw = scratch.take("raw", rows, h_c, vocab, h_c.dtype)
    if bias is not None:
        torch.addmm(bias, h_c, weight.t(), out=raw)
    else:
        torch.mm(h_c, weight.t(), out=raw)
    if stats_dtype == h_c.dtype:
        return raw
    return scratch.take("stats", rows, h_c, vocab, stats_dtype).copy_(raw)


def matmul_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the output-layer matmuls should run in: the autocast dtype when autocast is on
    for ``hidden``'s device and ``hidden`` is float32 (a QLoRA residual stream kept in float32 by
    ``prepare_model_for_kbit_training``), else ``hidden``'s own dtype.

    Why not let autocast do it: autocast casts the *weight* inside every chunk's matmul (one
    ``V x H`` copy per chunk: 16 copies of a 128k-row head per 2,048 tokens) and leaves
    ``mm(..., out=...)`` in float32 (4x slower than bf16 on a CPU with AMX/avx512_bf16). Casting
    once here and running the chunks with autocast off does each conversion once."""
    device_type = hidden.device.type
    if hidden.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def cast_for_matmul(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``hidden``, ``weight`` and ``bias`` in :func:`matmul_dtype` (differentiable casts; no copy
    for a tensor already in it)."""
    dtype = matmul_dtype(hidden)
    return (hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics are accumulated in float32 (float64 when the input is float64)."""
    return torch.promote_types(dtype, torch.float32)


def softmax_cross_entropy_(logits: torch.Tensor, labels: torch.Tensor, token_weight: torch.Tensor,
                           z_loss: float, want_grad: bool, scaled: bool = True):
    """Per-row cross-entropy of ``logits`` [C, K] (float32/64, overwritten in place) and its gradient.

    ``labels`` [C] are column indices (valid for every row; ignored rows carry ``token_weight`` 0).
    Returns ``(loss [C], lse [C], grad [C, K] or None)`` where ``loss = lse - logit[label] +
    z_loss * lse^2`` and ``grad = d(sum_i token_weight_i * loss_i) / d logits``, built in the
    ``logits`` buffer itself so that a chunk needs one ``C x K`` buffer, not three.

    With ``scaled=False`` (only without ``z_loss``) the gradient is left unweighted,
    ``softmax - onehot(label)``: the caller multiplies row ``i`` of what it computes from it by
    ``token_weight_i`` (a ``C x H`` product after the matmul instead of a ``C x K`` pass here).

    The softmax is PyTorch's fused row kernel, in place (one pass over memory instead of the
    four of max / subtract / exp / sum, each row staying in cache). Its statistics are not
    returned, so the log-sum-exp comes from the row maximum ``m`` and the largest probability:
    ``p_max = exp(m - lse)``, hence ``lse = m - log(p_max)``; ``p_max >= 1/K`` never underflows.
    """
    if z_loss and not scaled:
        raise ValueError("softmax_cross_entropy_: an unscaled gradient needs z_loss == 0")
    target = logits.gather(1, labels[:, None]).squeeze(1)
    row_max = logits.amax(dim=1)
    if logits.is_contiguous():  # each row is read before it is written: safe in place
        probs = torch.ops.aten._softmax.out(logits, 1, False, out=logits)
    else:  # the out= kernel mishandles strided outputs (pytorch/pytorch#75923)
        probs = logits.copy_(torch.softmax(logits, dim=1))
    lse = row_max - probs.amax(dim=1).log()
    loss = lse - target
    if z_loss:
        loss = loss + z_loss * lse.square()
    if not want_grad:
        return loss, lse, None
    if not scaled:
        return loss, lse, probs.scatter_add_(1, labels[:, None], torch.full_like(target[:, None], -1.0))
    # d loss / d logits = (1 + 2 z lse) * softmax - onehot(label), scaled per row by the token weight.
    row_scale = token_weight
    if z_loss:
        row_scale = row_scale * (1.0 + 2.0 * z_loss * lse)
    grad = probs.mul_(row_scale[:, None])
    grad.scatter_add_(1, labels[:, None], -token_weight[:, None])
    return loss, lse, grad


def soft_cap_(logits: torch.Tensor, softcap: float | None, keep_tanh: bool):
    """Gemma soft cap in place: ``logits = softcap * tanh(logits / softcap)``.

    Returns ``(capped, tanh or None)``; with ``keep_tanh`` the tanh is kept in its own buffer for
    the backward factor ``d capped / d raw = 1 - tanh^2`` (see :func:`soft_cap_backward_`).
    """
    if softcap is None:
        return logits, None
    tanh = logits.div_(softcap).tanh_()
    if keep_tanh:
        return tanh * softcap, tanh
    return tanh.mul_(softcap), None


def soft_cap_backward_(grad: torch.Tensor, tanh: torch.Tensor | None) -> torch.Tensor:
    """Multiply a gradient w.r.t. capped logits by ``1 - tanh^2`` (consumes ``tanh``)."""
    if tanh is not None:
        grad.mul_(tanh.square_().neg_().add_(1.0))
    return grad


def _chunk_loss_and_grad(h_c, weight, bias, labels_c, token_weight_c, softcap, z_loss, want_grad, scratch=None,
                         lse_out=None):
    """Per-token loss of one chunk over the whole vocabulary and, if ``want_grad``, the gradient of
    the logits (``C x V``, statistics dtype; in ``scratch``'s buffer when given) and the per-row
    factor still to apply: ``(loss, grad, row_scale)``. Without ``z_loss`` the gradient is the
    unweighted ``softmax - onehot`` and ``row_scale`` is ``token_weight_c`` (see
    :func:`_apply_chunk_grad`); with it the gradient is already weighted and ``row_scale`` is None.
    ``lse_out`` [C], when given, receives the chunk's log-sum-exp."""
    logits, tanh = soft_cap_(_chunk_logits(h_c, weight, bias, scratch), softcap, keep_tanh=want_grad)
    scaled = bool(z_loss)
    loss, lse, grad = softmax_cross_entropy_(logits, labels_c, token_weight_c, z_loss, want_grad, scaled=scaled)
    if lse_out is not None:
        lse_out.copy_(lse)
    if grad is not None:
        grad = soft_cap_backward_(grad, tanh)
    return loss, grad, None if scaled else token_weight_c


def _accumulator_dtype(weight: torch.Tensor) -> torch.dtype:
    """16-bit weights accumulate their gradient over chunks in float32 (one rounding at the end,
    as a single full matmul would do); float32/float64 accumulate in place."""
    return _stats_dtype(weight.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Autograd Function behind :func:`linear_cross_entropy`; inputs already flattened to 2-D."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, chunk_size, z_loss, softcap, reduction,
                row_step=None):
        num_tokens = hidden.shape[0]
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        any_grad = need_hidden or need_weight or need_bias
        # A head stepped block by block in backward (`RowStep`): no V x H gradient here.
        row_step = row_step if need_weight and reduction != "none" else None
        if row_step is not None:
            need_weight = False
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        valid_f = valid.to(_stats_dtype(hidden.dtype))
        if reduction == "mean":
            # A tensor division, not .item(): no host sync; all-ignored gives 0, not NaN.
            token_weight = valid_f / valid_f.sum().clamp(min=1.0)
        else:
            token_weight = valid_f
        grads_now = any_grad and reduction != "none"

        losses = torch.empty(num_tokens, dtype=valid_f.dtype, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if grads_now and need_hidden else None
        grad_weight = (torch.zeros(weight.shape, dtype=_accumulator_dtype(weight), device=weight.device)
                       if grads_now and need_weight else None)
        grad_bias = (torch.zeros(weight.shape[0], dtype=valid_f.dtype, device=weight.device)
                     if grads_now and need_bias else None)

        lse = torch.empty(num_tokens, dtype=valid_f.dtype, device=hidden.device) if row_step is not None else None
        scratch = ChunkScratch()
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            h_c = hidden[start:end]
            loss_c, grad, row_scale = _chunk_loss_and_grad(h_c, weight, bias, safe_labels[start:end],
                                                           token_weight[start:end], softcap, z_loss, grads_now,
                                                           scratch, None if lse is None else lse[start:end])
            losses[start:end] = loss_c
            if grad is not None:
                _apply_chunk_grad(grad, h_c, weight, start, end, grad_hidden, grad_weight, grad_bias, scratch,
                                  row_scale)
            del grad
        del scratch
        losses.mul_(valid_f)

        ctx.weight_dtype = weight.dtype
        ctx.grads_ready = grads_now
        ctx.row_step = row_step
        if row_step is not None:
            ctx.save_for_backward(hidden, weight, safe_labels, token_weight, lse)
        if grads_now:
            ctx.grads = [grad_hidden, grad_weight, grad_bias]
        elif any_grad:  # reduction == "none": recompute in backward
            ctx.save_for_backward(hidden, weight, bias, safe_labels, valid_f)
            ctx.options = (chunk_size, z_loss, softcap)
        if reduction == "none":
            return losses
        total = losses.sum()
        return total / valid_f.sum().clamp(min=1.0) if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.grads_ready:
            grad_hidden, grad_weight, grad_bias = take_scaled_grads(ctx, grad_output, "linear_cross_entropy")
            if ctx.row_step is not None:
                _step_head_rows(ctx.row_step, *ctx.saved_tensors, grad_output)
        else:
            hidden, weight, bias, safe_labels, valid_f = ctx.saved_tensors
            chunk_size, z_loss, softcap = ctx.options
            need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
            token_weight = grad_output.to(valid_f.dtype) * valid_f
            grad_hidden = torch.empty_like(hidden) if need_hidden else None
            grad_weight = (torch.zeros(weight.shape, dtype=_accumulator_dtype(weight), device=weight.device)
                           if need_weight else None)
            grad_bias = (torch.zeros(weight.shape[0], dtype=valid_f.dtype, device=weight.device)
                         if need_bias else None)
            scratch = ChunkScratch()
            for start in range(0, hidden.shape[0], chunk_size):
                end = min(start + chunk_size, hidden.shape[0])
                h_c = hidden[start:end]
                _, grad, row_scale = _chunk_loss_and_grad(h_c, weight, bias, safe_labels[start:end],
                                                          token_weight[start:end], softcap, z_loss, True, scratch)
                _apply_chunk_grad(grad, h_c, weight, start, end, grad_hidden, grad_weight, grad_bias, scratch,
                                  row_scale)
                del grad
            del scratch
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def _step_head_rows(row_step, hidden, weight, safe_labels, token_weight, lse, grad_output) -> None:
    """The head's gradient one block of vocabulary rows at a time, each block handed to
    ``row_step`` (which updates those rows) before the next is formed: the whole ``V x H``
    gradient never exists. Each block recomputes its logits for every token (``N x rows``) from
    the forward's log-sum-exp: ``grad[rows] = (softmax - onehot)[:, rows].T @ (hidden * token
    weight)``, one matmul more than the unfused loss. Every block reads the weight before its own
    update, and the hidden gradient was formed in forward from the weights before any update."""
    weighted = (hidden.to(lse.dtype) * (token_weight * grad_output.to(lse.dtype))[:, None]).to(hidden.dtype)
    tokens = torch.arange(hidden.shape[0], device=hidden.device)
    for rows in row_step.chunks:
        start, stop, _ = rows.indices(weight.shape[0])
        probs = (hidden @ weight[start:stop].t()).to(lse.dtype).sub_(lse[:, None]).exp_()
        inside = (safe_labels >= start) & (safe_labels < stop)
        probs.index_put_((tokens[inside], safe_labels[inside] - start), torch.tensor(-1.0, dtype=probs.dtype,
                                                                                   device=probs.device),
                         accumulate=True)
        grad = probs.to(hidden.dtype).t() @ weighted
        del probs
        row_step(rows, grad.to(weight.dtype))
        del grad


#: weight -> `RowStep`: trainable heads whose update the loss applies block by block of rows
#: inside its backward (`training.optimizer_in_backward`, registered by the optimizer).
_ROW_STEPS = WeakIdKeyDictionary()


class RowStep(Protocol):
    """An update of some rows of a weight from their gradient: ``step(rows, grad)`` is called once
    per slice of ``chunks``, in order, in each backward."""

    chunks: list[slice]

    def __call__(self, rows: slice, grad: torch.Tensor) -> None: ...


def step_rows_in_loss(weight: torch.Tensor, step: RowStep | None) -> None:
    """Have :func:`linear_cross_entropy` update ``weight`` (a head) inside its backward, one block
    of rows at a time, instead of returning its gradient (``None``: stop)."""
    if step is None:
        _ROW_STEPS.pop(weight, None)
    else:
        _ROW_STEPS[weight] = step


def take_scaled_grads(ctx, grad_output: torch.Tensor, what: str):
    """The (hidden, weight, bias) gradients a chunked loss formed in forward (``ctx.grads``),
    multiplied in place by the incoming scalar gradient; each buffer serves a single backward.
    The weight and bias gradients stay in their float32 accumulators (the caller casts)."""
    if ctx.grads is None:
        raise RuntimeError(f"{what}: backward ran twice on a graph whose gradients were computed in forward "
                           "(or the loss ran under no_grad); retain_graph is not supported")
    grad_hidden, grad_weight, grad_bias = ctx.grads
    ctx.grads = None
    scale = grad_output.to(_stats_dtype(grad_output.dtype))
    for grad in (grad_hidden, grad_weight, grad_bias):
        if grad is not None:
            grad.mul_(scale.to(grad.dtype))
    return grad_hidden, grad_weight, grad_bias


def _apply_chunk_grad(grad, h_c, weight, start, end, grad_hidden, grad_weight, grad_bias, scratch=None,
                      row_scale=None):
    """Turn one chunk's logit gradient (float32 ``C x V``) into hidden / weight / bias gradients.

    ``row_scale`` [C] (or None) multiplies row ``i`` of ``grad``; it is applied where it is cheap,
    to the ``C x H`` matmul result or the chunk's hidden states, never as a pass over ``C x V``."""
    if grad_bias is not None:
        grad_bias.add_(grad.sum(dim=0) if row_scale is None else row_scale.to(grad.dtype) @ grad)
    if grad.dtype == h_c.dtype:
        g = grad  # float32 / float64 inputs: no copy
    elif scratch is not None:  # the chunk's raw-logits buffer is free again: cast into it
        g = scratch.take("raw", grad.shape[0], h_c, grad.shape[1], h_c.dtype).copy_(grad)
    else:
        g = grad.to(h_c.dtype)
    if grad_hidden is not None:
        out = grad_hidden[start:end]
        torch.mm(g, weight, out=out)
        if row_scale is not None:  # computed in float32 (type promotion), one rounding per element
            out.mul_(row_scale[:, None])
    if grad_weight is not None:
        if row_scale is not None:
            h_c = (h_c * row_scale[:, None]).to(h_c.dtype)
        if grad_weight.dtype == g.dtype:
            grad_weight.addmm_(g.t(), h_c)
        else:  # 16-bit product into the float32 accumulator, one block of rows at a time
            for row in range(0, grad_weight.shape[0], WEIGHT_GRAD_BLOCK_ROWS):
                block = slice(row, row + WEIGHT_GRAD_BLOCK_ROWS)
                grad_weight[block].add_(g[:, block].t() @ h_c)


def _flatten(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias):
    """Check shapes (user errors -> ConfigError) and flatten the leading dims."""
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ConfigError(f"hidden size {hidden.shape[-1]} does not match the output weight {tuple(weight.shape)}",
                          hint="pass the head's weight of shape [vocab, hidden] and hidden states [..., hidden]")
    if labels.shape != hidden.shape[:-1]:
        raise ConfigError(f"labels of shape {tuple(labels.shape)} do not match hidden states {tuple(hidden.shape)}",
                          hint="labels must have the hidden states' leading dimensions (shift them before the call)")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ConfigError(f"bias of shape {tuple(bias.shape)} does not match vocabulary {weight.shape[0]}",
                          hint="pass the head's bias or None")
    return hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise ConfigError(f"unknown reduction {reduction!r}", hint="use 'mean', 'sum' or 'none'")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX, *, chunk_size: int | None = None, z_loss: float = 0.0,
                         softcap: float | None = None, reduction: Reduction = "mean",
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``labels``, chunk by chunk.

    Args:
        hidden: ``[..., H]`` hidden states (any leading dims; flattened). fp32, bf16 or fp16; the
            matmuls run in this dtype, the softmax statistics in float32.
        weight: ``[V, H]`` output-layer weight; may be frozen, trainable, tied to the input
            embedding, or a non-leaf (e.g. ``base + B @ A`` for a LoRA head: its gradient flows on).
        labels: ``[...]`` target ids, already aligned with ``hidden`` (the caller shifts).
        ignore_index: label value that contributes neither loss nor gradient.
        chunk_size: tokens per chunk; default :func:`default_chunk_size` (256 tokens, at most 192 MiB of logits).
        z_loss: coefficient of the auxiliary ``z_loss * logsumexp^2`` term (PaLM), per token.
        softcap: Gemma-style soft cap: logits become ``softcap * tanh(logits / softcap)``.
        reduction: ``"mean"`` over non-ignored tokens (0 if there are none, unlike
            ``F.cross_entropy`` which gives NaN), ``"sum"``, or ``"none"`` (shape of ``labels``,
            0 at ignored positions).
        bias: optional ``[V]`` output bias.

    Returns:
        A float32 scalar (``mean``/``sum``) or a float32 tensor shaped like ``labels``.
    """
    _check_reduction(reduction)
    flat_hidden, flat_labels = _flatten(hidden, weight, labels, bias)
    if softcap is not None and softcap <= 0:
        raise ConfigError(f"softcap must be positive, got {softcap}", hint="use e.g. 30.0 (Gemma 2) or None")
    flat_hidden, weight, bias = cast_for_matmul(flat_hidden, weight, bias)
    if chunk_size is None:
        trainable_head = weight.requires_grad and torch.is_grad_enabled()
        chunk_size = default_chunk_size(flat_hidden.shape[0], weight.shape[0], flat_hidden.element_size(), trainable_head)
    chunk_size = max(1, int(chunk_size))
    row_step = _ROW_STEPS.get(weight)
    if row_step is not None and (z_loss or softcap is not None or (bias is not None and bias.requires_grad)):
        row_step = None  # the block-wise head gradient covers the plain softmax only
    with torch.autocast(flat_hidden.device.type, enabled=False):
        out = _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, bias, flat_labels, ignore_index,
                                               chunk_size, float(z_loss), softcap, reduction, row_step)
    return out.reshape(labels.shape) if reduction == "none" else out


def token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    ignore_index: int = IGNORE_INDEX, chunk_size: int | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token ``log p(label)`` under ``softmax(hidden @ weight.T + bias)``, without full logits.

    Shaped like ``labels``, float32, 0 where ``labels == ignore_index``, differentiable with
    respect to ``hidden``, ``weight`` and ``bias`` (backward recomputes each chunk). Sum it over a
    sequence for DPO-style sequence log-probabilities.
    """
    return -linear_cross_entropy(hidden, weight, labels, ignore_index, chunk_size=chunk_size,
                                 reduction="none", bias=bias)


def naive_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        ignore_index: int = IGNORE_INDEX, *, chunk_size: int | None = None, z_loss: float = 0.0,
                        softcap: float | None = None, reduction: Reduction = "mean",
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: full ``tokens x vocab`` logits and ``F.cross_entropy`` (float32 softmax).

    Same signature and semantics as :func:`linear_cross_entropy` (``chunk_size`` is accepted and
    ignored), including 0 rather than NaN when every label is ignored. This is the oracle in
    tests and the ``optimization.loss: naive`` mode.
    """
    _check_reduction(reduction)
    flat_hidden, flat_labels = _flatten(hidden, weight, labels, bias)
    logits = F.linear(flat_hidden, weight.to(flat_hidden.dtype),
                      None if bias is None else bias.to(flat_hidden.dtype))
    logits = logits.to(_stats_dtype(logits.dtype))
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    per_token = F.cross_entropy(logits, flat_labels, ignore_index=ignore_index, reduction="none")
    valid = (flat_labels != ignore_index).float()
    if z_loss:
        per_token = per_token + z_loss * torch.logsumexp(logits, dim=-1).square() * valid
    if reduction == "none":
        return per_token.reshape(labels.shape)
    total = per_token.sum()
    return total / valid.sum().clamp(min=1.0) if reduction == "mean" else total
