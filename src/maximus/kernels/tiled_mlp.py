"""Sequence-tiled MLP: the decoder MLP's intermediate tensors exist for one tile of tokens at a time.

A gated MLP (``down(act(gate(x)) * up(x))``, with LoRA / QLoRA / DoRA projections) works token by
token, so it can run over tiles of tokens with an exact result. `tiled_mlp(run, x, tile_tokens,
params)` does so as one autograd node:

* forward runs ``run`` over the tiles without recording a graph and keeps only ``x`` (one
  ``tokens x hidden`` tensor, what the projections would keep anyway);
* backward recomputes ``run`` one tile at a time and takes that tile's gradient for ``x`` and for
  the trainable ``params`` (the adapters), summed over the tiles, so the ``tokens x intermediate``
  activations (gate, up, their product, the adapters' inputs) are never alive for the whole
  sequence. The tiles see the same dropout masks as forward (the RNG state is replayed) and the
  same autocast state.

The gradients are those of the untiled MLP up to float summation order (the parameter
gradients are sums of per-tile products): equal to 1e-5 in float32
(tests/memory/test_tiled_recompute.py). Unsloth's tiled MLP is the same idea.

Inside a fully checkpointed decoder layer (`maximus.memory.checkpointing`, where it is installed)
the layer is recomputed once more in backward. When `skip_in_recompute` says that nothing in the
layer after the MLP saves the MLP's output (Llama, Mistral, Qwen2: only a residual add follows),
that recompute does not run the MLP at all: only its saved input is needed, so tiling costs no
extra MLP forward over untiled full checkpointing.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from maximus.compat import current_graph_task_id

__all__ = ["tiled_mlp", "tiled_module_forward", "tile_ranges"]


def tile_ranges(tokens: int, tile_tokens: int) -> list[tuple[int, int]]:
    """[start, end) of each tile when `tokens` rows are cut into tiles of `tile_tokens` (the last one shorter)."""
    return [(s, min(s + tile_tokens, tokens)) for s in range(0, tokens, tile_tokens)]


def _rng_devices(x: torch.Tensor) -> list:
    return [x.device] if x.device.type == "cuda" else []


def _rng_state(x: torch.Tensor):
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
    return cpu, cuda


def _in_backward() -> bool:
    """True while autograd's engine runs a backward pass (a checkpoint recompute runs inside one)."""
    return current_graph_task_id() != -1


class _TiledMLPFunction(torch.autograd.Function):
    """Inputs (run, tile_tokens, skip_in_recompute, x, *params); x: (rows, hidden)."""

    @staticmethod
    def forward(ctx, run, tile_tokens, skip_in_recompute, x, *params):
        ctx.run, ctx.tile_tokens = run, tile_tokens
        ctx.params = params  # leaves (the adapters): their gradients are this node's outputs
        device_type = x.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.rng = _rng_state(x)
        ctx.save_for_backward(x)
        if skip_in_recompute and _in_backward():
            # A checkpoint recompute only needs the saved input; the output feeds a residual add
            # whose result nothing keeps (see the module docstring).
            return x.new_empty(x.shape)
        with torch.no_grad():
            pieces = [run(x[s:e]) for s, e in tile_ranges(x.shape[0], tile_tokens)]
        return torch.cat(pieces, dim=0)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        params = ctx.params
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[4:]) if need]
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        grads: list[torch.Tensor | None] = [None] * len(wanted)
        device_type, autocast_on, autocast_dtype = ctx.autocast
        cpu_state, cuda_state = ctx.rng
        with torch.random.fork_rng(devices=_rng_devices(x)):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, x.device)
            for s, e in tile_ranges(x.shape[0], ctx.tile_tokens):
                tile = x[s:e].detach().requires_grad_(grad_x is not None)
                with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                    out = ctx.run(tile)
                inputs = ([tile] if grad_x is not None else []) + wanted
                if not inputs:
                    continue
                got = torch.autograd.grad(out, inputs, grad_out[s:e], allow_unused=True)
                if grad_x is not None:
                    grad_x[s:e] = got[0]
                    got = got[1:]
                for k, g in enumerate(got):
                    if g is None:
                        continue
                    grads[k] = g if grads[k] is None else grads[k].add_(g)
                del out, got
        it = iter(grads)
        param_grads = [next(it) if need else None for need in ctx.needs_input_grad[4:]]
        return (None, None, None, grad_x, *param_grads)


def tiled_mlp(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_tokens: int,
              params: Sequence[torch.Tensor] = (), *, skip_in_recompute: bool = False) -> torch.Tensor:
    """``run(x)`` computed over tiles of `tile_tokens` tokens, with an exact gradient (module docstring).

    run: a token-wise function (the MLP's own forward) from (1, rows, hidden) to (1, rows, out);
    x: (..., hidden), every leading dimension counts as tokens; params: the tensors ``run`` uses
    that need gradients (the MLP's trainable parameters), so that their gradients reach autograd
    as the node's outputs (DDP / FSDP hooks see them once). skip_in_recompute: the caller's output
    is not saved by anything after it inside a checkpointed layer (see the module docstring).
    Returns (..., out) in run's dtype. `tile_tokens` >= the token count runs ``run(x)`` as it is.
    """
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be positive, got {tile_tokens}")
    lead, hidden = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.shape[0] <= tile_tokens:
        return run(x)

    def run_rows(t: torch.Tensor) -> torch.Tensor:
        return run(t.unsqueeze(0)).squeeze(0)

    params = [p for p in params if isinstance(p, torch.Tensor)]
    out = _TiledMLPFunction.apply(run_rows, tile_tokens, skip_in_recompute, rows, *params)
    return out.view(*lead, out.shape[-1])


def tiled_module_forward(module: torch.nn.Module, body: Callable[[torch.Tensor], torch.Tensor],
                         x: torch.Tensor) -> torch.Tensor:
    """``body(x)`` for an MLP module, tiled when `maximus.memory.checkpointing` turned tiling on for
    it (``module._maximus_tile_tokens``) and autograd is recording a training step; as is otherwise."""
    tile = module.__dict__.get("_maximus_tile_tokens")
    if not tile or not (module.training and torch.is_grad_enabled()):
        return body(x)
    params = [p for p in module.parameters() if p.requires_grad]
    return tiled_mlp(body, x, tile, params, skip_in_recompute=module.__dict__.get("_maximus_tile_skip", False))
