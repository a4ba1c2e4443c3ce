"""`InBackwardOptimizer`: one optimizer per parameter, stepped from the parameter's
post-accumulate-grad hook, its gradient then freed (`training.optimizer_in_backward`); the
embedding and head row block by row block."""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable

import torch

from maximus.train.optimizers.composite import CompositeOptimizer
from maximus.train.optimizers.torchao_rows import row_chunks


def _step_rounded(p: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """One step of `optimizer` (over `p` alone) on a float32 copy of the bf16 weight, rounded back
    stochastically (torchao's rounding): small updates are kept on average instead of being lost
    to bf16's round-to-nearest. Only one weight's float32 copy exists at a time."""
    from torchao.optim.quant_utils import _fp32_to_bf16_sr

    weight = p.data
    p.data = weight.float()
    try:
        optimizer.step()
        weight.copy_(_fp32_to_bf16_sr(p.data))
    finally:
        p.data = weight


class InBackwardOptimizer(CompositeOptimizer):
    """One optimizer per parameter, stepped from the parameter's post-accumulate-grad hook; the
    gradient is freed right after, so at most the gradients autograd is producing at the moment
    exist (never the whole set). `step()` and `zero_grad()` are then no-ops for the loop.

    A non-finite gradient skips that parameter's update (counted in `nonfinite`); the squares of
    the gradients are summed as they pass, so `grad_norm()` is the step's (unclipped) global norm."""

    steps_in_backward = True
    #: True during a step's first backward when clipping (`measuring`): the hooks only sum squares.
    _measuring = False
    #: The clip coefficient of the step's gradients (`clip_to`), 1.0 when not clipping.
    _coef = 1.0

    def __init__(self, model, parts: list[tuple[Callable, list[dict]]], *, row_steps: bool = True):
        optimizers = []
        for make, groups in parts:
            for g in groups:
                for p in g["params"]:
                    opt = make([dict(g, params=[p])])
                    if "seed" in opt.state.get(p, {}):
                        # APOLLO seeds each weight's random projection by its position: as in one optimizer.
                        opt.state[p]["seed"] = len(optimizers) + 1
                    optimizers.append((p, opt))
        super().__init__([opt for _, opt in optimizers])
        self._by_param = {id(p): opt for p, opt in optimizers}
        self._square_sum = 0.0
        self.nonfinite = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p, _ in optimizers]
        self._row_stepped: set[int] = set()
        self._undo: list[Callable[[], None]] = []
        if row_steps:
            self._step_outer_rows(model)

    def _step_outer_rows(self, model) -> None:
        """The embedding and an untied head on torchao's optimizer are updated row block by row
        block where their gradients are formed (the embedding's backward, the loss's backward):
        neither's whole gradient exists (`_RowStep`)."""
        from maximus.losses.linear_cross_entropy import step_rows_in_loss

        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        weights = [getattr(m, "weight", None) for m in (embed, head)]
        if weights[0] is not None and weights[0] is weights[1]:
            return  # tied: one weight, two gradients to sum
        for module, weight in zip((embed, head), weights):
            opt = self._by_param.get(id(weight)) if weight is not None else None
            if opt is None or not hasattr(opt, "step_rows"):
                continue
            step = _RowStep(self, weight, opt)
            if module is head:
                step_rows_in_loss(weight, step)
                self._undo.append(lambda w=weight: step_rows_in_loss(w, None))
            elif type(module) is torch.nn.Embedding and module.max_norm is None and not module.sparse:
                module.forward = functools.partial(_row_stepped_embedding, module, step)
                self._undo.append(lambda m=module: m.__dict__.pop("forward", None))

    def _hook(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:  # stepped row by row where its gradient was formed (`_RowStep`): autograd got None
            return
        if id(p) in self._row_stepped:
            raise RuntimeError("a weight updated row by row inside the backward also received a whole gradient "
                               "in the same step (a second loss on the head?): set optimizer_in_backward: false")
        square = float(torch.linalg.vector_norm(grad.detach(), dtype=torch.float32)) ** 2
        self._square_sum += square
        if not self._measuring:
            self._step(p, grad, square)
        p.grad = None

    def _step(self, p: torch.Tensor, grad: torch.Tensor, square: float) -> None:
        """`p`'s update from its gradient (times the clip coefficient); a non-finite one is skipped."""
        if not math.isfinite(square):
            self.nonfinite += 1
            return
        if self._coef != 1.0:
            grad.mul_(self._coef)
        opt = self._by_param[id(p)]
        if p.dtype is torch.bfloat16 and not getattr(opt, "bf16_stochastic_round", False):
            _step_rounded(p, opt)
        else:
            opt.step()

    def begin_step(self) -> None:
        """Start a new optimizer step's accounting (norm, non-finite count); no clipping."""
        self._square_sum = 0.0
        self.nonfinite = 0
        self._row_stepped.clear()
        self._coef = 1.0

    @contextlib.contextmanager
    def measuring(self):
        """A backward whose hooks only sum the gradients' squares (and free them): no weight
        changes. `grad_norm()` is then the step's global norm, for `clip_to`."""
        self.begin_step()
        self._measuring = True
        try:
            yield
        finally:
            self._measuring = False

    def clip_to(self, max_norm: float) -> float:
        """After a `measuring` backward: the next backward steps every weight on its gradient times
        `clip_grad_norm_`'s coefficient, min(1, max_norm / (norm + 1e-6)). Returns the norm."""
        norm = self.grad_norm()
        self.begin_step()
        self._coef = min(1.0, max_norm / (norm + 1e-6))
        return norm

    def grad_norm(self) -> float:
        return math.sqrt(self._square_sum) if math.isfinite(self._square_sum) else float("nan")

    @torch.no_grad()
    def step(self, closure=None):
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for undo in self._undo:
            undo()
        self._undo = []


class _RowStep:
    """The update of one weight from its gradient's row blocks (`row_chunks`, torchao's step
    chunks), called by whoever forms them (`linear_cross_entropy.RowStep`): the first block starts
    the weight's step; each block's squares join the step's norm. A non-finite block skips the
    update of its own rows only (the blocks before it are applied already)."""

    def __init__(self, owner: InBackwardOptimizer, weight: torch.Tensor, optimizer):
        self.owner, self.weight, self.optimizer = owner, weight, optimizer
        self.chunks = row_chunks(weight)

    def __call__(self, rows: slice, grad: torch.Tensor) -> None:
        first = rows == self.chunks[0]
        if first:
            self.owner._row_stepped.add(id(self.weight))
        square = float(torch.linalg.vector_norm(grad, dtype=torch.float32)) ** 2
        self.owner._square_sum += square
        if self.owner._measuring:
            return
        if math.isfinite(square):
            coef = self.owner._coef
            self.optimizer.step_rows(self.weight, rows, grad * coef if coef != 1.0 else grad, first)
        else:
            self.owner.nonfinite += 1


class _RowSteppedEmbedding(torch.autograd.Function):
    """`F.embedding` whose backward updates the weight block of rows by block of rows (each
    block's gradient gathered from the tokens that fall in it) and returns no weight gradient."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, step):
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.step = padding_idx, step
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        ids = ids.reshape(-1)
        grad_out = grad_out.reshape(ids.shape[0], -1)
        if ctx.padding_idx is not None:  # as embedding_dense_backward: the padding row gets no gradient
            keep = ids != ctx.padding_idx
            ids, grad_out = ids[keep], grad_out[keep]
        for rows in ctx.step.chunks:
            start, stop, _ = rows.indices(ctx.weight_shape[0])
            inside = (ids >= start) & (ids < stop)
            grad = torch.zeros((stop - start, ctx.weight_shape[1]), dtype=grad_out.dtype, device=grad_out.device)
            grad.index_add_(0, ids[inside] - start, grad_out[inside])
            ctx.step(rows, grad.to(ctx.weight_dtype))
            del grad
        return None, None, None, None


def _row_stepped_embedding(module: torch.nn.Embedding, step: _RowStep, ids: torch.Tensor) -> torch.Tensor:
    if not (torch.is_grad_enabled() and module.weight.requires_grad):
        return torch.nn.functional.embedding(ids, module.weight, module.padding_idx)
    return _RowSteppedEmbedding.apply(ids, module.weight, module.padding_idx, step)
