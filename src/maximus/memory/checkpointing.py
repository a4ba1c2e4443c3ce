"""Gradient Checkpointing 2.0: recompute each decoder layer by its cost in memory and time.

Every decoder layer of a Hugging Face decoder (Llama, Mistral, Qwen2, ... also inside a PEFT
wrapper) gets one of three recompute modes:

* ``none``: autograd keeps everything the layer's backward needs (fastest, most memory);
* ``selective``: per-op checkpointing (`torch.utils.checkpoint.create_selective_checkpoint_contexts`):
  the outputs of ops that are expensive to recompute and cheap to store (matmuls with a large
  inner dimension, attention kernels) are kept, the cheap rest (norms, RoPE, activations,
  residual adds, rank-r LoRA up-projections) is recomputed in backward;
* ``full``: only the layer input is kept and the whole layer is recomputed in backward.

`apply_checkpointing(model, policy)` sets the modes: ``off`` (all ``none``), ``full``,
``selective``, ``auto`` (chosen per layer by cost, see `choose_recompute_modes`) or an explicit
list with one mode per layer. The costs come from a short trace of the model itself (two
forward/backward passes of a few dozen tokens, fitted as ``b*T + c*T^2`` and scaled to
``micro_batch x seq_len``), so LoRA, QLoRA, biases and the attention implementation are all
accounted for without a per-architecture table.

The mechanism is a class swap, not a wrapper module: each layer's class becomes a subclass of
itself (same ``__name__``) whose ``forward`` runs the original one under
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`. Module names, ``state_dict`` keys and
PEFT adapter names do not change, module hooks stay outside the recomputed region, and
frozen inputs (LoRA with a frozen embedding) need no ``enable_input_require_grads`` trick.
Recompute only happens in training mode with gradients enabled; evaluation and generation run
the layer as is. A KV cache passed to a checkpointed layer is dropped (the backward replay
would otherwise write to it twice), as Transformers' own checkpointing does.

Sequence tiling (`tile_tokens`): in a fully checkpointed layer the MLP (with its LoRA
projections) can run over tiles of tokens (`maximus.kernels.tiled_mlp`), so that in the layer's
backward its ``tokens x intermediate`` tensors exist for one tile at a time. The MLP's class is
swapped the same way (same name, a subclass); attention keeps its own kernel (SDPA or Kronecker)
and runs over the whole sequence. Layers in ``none`` or ``selective`` mode are never tiled.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from maximus.config import format_bytes
from maximus.errors import BudgetError, ConfigError, ModelError
from maximus.memory.plan import RECOMPUTE_MODES
from maximus.structure import find_decoder_layers

__all__ = [
    "RECOMPUTE_MODES",
    "CheckpointReport",
    "LayerCost",
    "apply_checkpointing",
    "checkpoint_tower",
    "choose_recompute_modes",
    "measure_layer_costs",
    "remove_checkpointing",
    "selective_policy",
    "set_recompute_modes",
    "TILED_RESIDUAL_LAYERS",
]

POLICIES = ("none", "full", "selective", "auto")

# Extra step time allowed when `auto` has no memory budget: recompute FLOPs / (forward + backward FLOPs).
DEFAULT_MAX_EXTRA_TIME = 0.25

# A matmul output is kept by `selective` when its contraction dimension is at least this: it then
# costs >= 2 * 256 FLOPs per stored element to recompute. Rank-r LoRA up-projections (r = 8..64)
# and head-dim score products fall below and are recomputed; every base projection is kept.
MIN_SAVED_MATMUL_INNER_DIM = 256

_aten = torch.ops.aten
_ATTENTION = {
    getattr(_aten, name)
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(_aten, name)
}


# --------------------------------------------------------------------------------------------
# The per-op policy of `selective`


def _matmul_shapes(packet, args) -> tuple[int, int, int, int] | None:
    """(batch, rows, inner, cols) of a matmul op call, or None if it is not one."""
    if packet is _aten.mm:
        a, b = args[0], args[1]
    elif packet in (_aten.addmm, _aten.baddbmm):
        a, b = args[1], args[2]
    elif packet is _aten.bmm:
        a, b = args[0], args[1]
    else:
        return None
    batch = a.shape[0] if a.dim() == 3 else 1
    return batch, a.shape[-2], a.shape[-1], b.shape[-1]


def is_saved_op(op, args) -> bool:
    """Whether `selective` keeps this op's output: attention kernels always, matmuls whose inner
    dimension is at least `MIN_SAVED_MATMUL_INNER_DIM`."""
    packet = op.overloadpacket
    if packet in _ATTENTION:
        return True
    shapes = _matmul_shapes(packet, args)
    return shapes is not None and shapes[2] >= MIN_SAVED_MATMUL_INNER_DIM


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Policy for `create_selective_checkpoint_contexts`: save expensive outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if is_saved_op(op, args) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(selective_policy)


# --------------------------------------------------------------------------------------------
# The class swap


_CHECKPOINTED_CLASSES: dict[type, type] = {}
_TILED_MLP_CLASSES: dict[type, type] = {}

#: Decoder layers whose MLP output feeds only the residual add (nothing after the MLP keeps it
#: for backward): their checkpoint recompute skips the tiled MLP, see `maximus.kernels.tiled_mlp`.
TILED_RESIDUAL_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer",
                                   "Qwen3DecoderLayer"})
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _checkpointed_class(base: type) -> type:
    """A subclass of `base` whose forward recomputes per the instance's `_maximus_recompute` mode."""
    if getattr(base, "_maximus_base_class", None) is not None:
        return base
    cls = _CHECKPOINTED_CLASSES.get(base)
    if cls is not None:
        return cls
    base_forward = base.forward

    def forward(self, *args, **kwargs):
        mode = self.__dict__.get("_maximus_recompute", "none")
        if mode == "none" or not (self.training and torch.is_grad_enabled()):
            return base_forward(self, *args, **kwargs)
        # The backward replay would append to a KV cache a second time.
        for key in _CACHE_KWARGS:
            if kwargs.get(key) is not None:
                kwargs[key] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        context_fn = _selective_context if mode == "selective" else noop_context_fn
        run = functools.partial(base_forward, self)
        offloader = self.__dict__.get("_maximus_offloader")
        if offloader is not None:
            return offloader.checkpoint(run, args, kwargs, context_fn)
        return checkpoint(run, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    # Same name as the base: Transformers, PEFT, accelerate and FSDP wrap policies match layers by
    # class name; isinstance checks keep working because it is a subclass.
    cls = type(base.__name__, (base,), {
        "forward": forward,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "_maximus_base_class": base,
    })
    _CHECKPOINTED_CLASSES[base] = cls
    return cls


def _tiled_mlp_class(base: type) -> type:
    """A subclass of the MLP class `base` whose forward runs over tiles of tokens when the instance's
    ``_maximus_tile_tokens`` is set (`maximus.kernels.tiled_mlp.tiled_module_forward`)."""
    if getattr(base, "_maximus_untiled_class", None) is not None:
        return base
    cls = _TILED_MLP_CLASSES.get(base)
    if cls is not None:
        return cls
    base_forward = base.forward

    def forward(self, x, *args, **kwargs):
        if args or kwargs:
            return base_forward(self, x, *args, **kwargs)
        from maximus.kernels.tiled_mlp import tiled_module_forward

        return tiled_module_forward(self, functools.partial(base_forward, self), x)

    cls = type(base.__name__, (base,), {
        "forward": forward,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "_maximus_untiled_class": base,
    })
    _TILED_MLP_CLASSES[base] = cls
    return cls


def _layer_mlp(layer: nn.Module) -> nn.Module:
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, nn.Module):
        raise ModelError(f"optimization.tile_tokens: the decoder layer {type(layer).__name__} has no `mlp` module to tile",
                         "set optimization.tile_tokens: off for this model")
    return mlp


def _set_tiling(layer: nn.Module, mode: str, tile_tokens: int | None) -> None:
    """Tile the layer's MLP when the layer is fully recomputed and a tile size is given; else untile it."""
    if not tile_tokens or mode != "full":
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, nn.Module):
            mlp.__dict__.pop("_maximus_tile_tokens", None)
            mlp.__dict__.pop("_maximus_tile_skip", None)
        return
    mlp = _layer_mlp(layer)
    mlp.__class__ = _tiled_mlp_class(type(mlp))
    mlp._maximus_tile_tokens = int(tile_tokens)
    base = getattr(type(layer), "_maximus_base_class", type(layer))
    mlp._maximus_tile_skip = base.__name__ in TILED_RESIDUAL_LAYERS


def _check_tile_tokens(tile_tokens: int | None) -> int | None:
    if tile_tokens is None:
        return None
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ConfigError(f"optimization.tile_tokens must be a positive number of tokens, auto or off, got {tile_tokens!r}",
                          "use e.g. tile_tokens: 4096, or off")
    return tile_tokens


def set_recompute_modes(model: nn.Module, modes: Sequence[str], offloader=None, tile_tokens: int | None = None) -> None:
    """Set the decoder layers' recompute modes directly (no cost trace, no report); `offloader`
    (an `ActivationOffloader`) moves the inputs of checkpointed layers to host memory;
    `tile_tokens` tiles the MLP of every fully recomputed layer (None: no tiling)."""
    _, layers = find_decoder_layers(model)
    _set_modes(layers, _policy_modes(list(modes), len(layers)), offloader, _check_tile_tokens(tile_tokens))


def _set_modes(layers: Sequence[nn.Module], modes: Sequence[str], offloader=None,
               tile_tokens: int | None = None) -> None:
    for layer, mode in zip(layers, modes):
        _set_tiling(layer, mode, tile_tokens)
        layer.__class__ = _checkpointed_class(type(layer))
        layer._maximus_recompute = mode
        if offloader is not None and mode != "none":
            layer._maximus_offloader = offloader
        else:
            layer.__dict__.pop("_maximus_offloader", None)
        # Transformers' own checkpointing would recompute the layer a second time.
        if getattr(layer, "gradient_checkpointing", False):
            layer.gradient_checkpointing = False


def checkpoint_tower(tower: nn.Module) -> int:
    """Full recompute for every layer of a VLM's vision tower (its longest layer list: CLIP /
    SigLIP ``encoder.layers``, Qwen2-VL ``blocks``); returns how many. A tower trained with
    ``lora.vision`` is checkpointed whenever the language model is (`maximus.memory.vision_terms`)."""
    lists = [m for m in tower.modules() if isinstance(m, nn.ModuleList)]
    layers = max(lists, key=len) if lists else []
    _set_modes(layers, ["full"] * len(layers))
    return len(layers)


def remove_checkpointing(model: nn.Module) -> None:
    """Undo `apply_checkpointing`: every decoder layer gets its original class back."""
    _, layers = find_decoder_layers(model)
    for layer in layers:
        base = getattr(type(layer), "_maximus_base_class", None)
        if base is not None:
            layer.__class__ = base
        layer.__dict__.pop("_maximus_recompute", None)
        layer.__dict__.pop("_maximus_offloader", None)
        mlp = getattr(layer, "mlp", None)
        untiled = getattr(type(mlp), "_maximus_untiled_class", None)
        if untiled is not None:
            mlp.__class__ = untiled
            mlp.__dict__.pop("_maximus_tile_tokens", None)
            mlp.__dict__.pop("_maximus_tile_skip", None)


# --------------------------------------------------------------------------------------------
# Costs


@dataclass
class LayerCost:
    """What one decoder layer costs for one micro-batch, by recompute mode.

    saved_bytes: activation bytes held from forward to backward (device memory).
    recompute_flops: extra forward FLOPs spent in backward (matmuls and attention; element-wise
    ops count 0, as in `torch.utils.flop_counter`)."""

    saved_bytes: dict[str, int]
    recompute_flops: dict[str, int]


def _tensors(obj) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    if t.device.type == "meta" or t.layout != torch.strided:
        return None
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _op_flops(op, args, out) -> tuple[int, bool]:
    """(FLOPs, is_attention) of one aten op; 0 for everything but matmuls and attention."""
    packet = op.overloadpacket
    shapes = _matmul_shapes(packet, args)
    if shapes is not None:
        batch, rows, inner, cols = shapes
        return 2 * batch * rows * inner * cols, False
    name = packet.__name__
    if "attention" in name and args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
        if name.endswith("_backward"):
            q, k = args[1], args[2]  # (grad_out, query, key, value, ...)
            return 8 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3], True
        q, k = args[0], args[1]  # (batch, heads, tokens, head_dim); full square, as flop_counter counts it
        return 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3], True
    return 0, False


class _LayerTrace(TorchDispatchMode):
    """Per-layer forward FLOPs, FLOPs `selective` would recompute, and bytes `selective` keeps;
    plus FLOPs of the whole forward + backward."""

    def __init__(self, n_layers: int):
        super().__init__()
        self.current: int | None = None
        self.forward_flops = [0] * n_layers
        self.selective_flops = [0] * n_layers
        self.selective_bytes = [0] * n_layers
        self.step_flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flops, _ = _op_flops(func, args, out)
        self.step_flops += flops
        i = self.current
        if i is not None:
            self.forward_flops[i] += flops
            if is_saved_op(func, args):
                seen: set = set()
                for t in _tensors(out):
                    key = _storage_key(t)
                    if key is not None and key not in seen:
                        seen.add(key)
                        self.selective_bytes[i] += key[1]
            else:
                self.selective_flops[i] += flops
        return out


def _trace_once(stack: nn.Module, layers: nn.ModuleList, tokens: int) -> dict[str, list[int] | int]:
    """Run the stack forward and backward once on `tokens` random tokens (batch 1) and measure."""
    n = len(layers)
    embed = stack.embed_tokens
    ids = torch.randint(0, embed.num_embeddings, (1, tokens), device=embed.weight.device)
    frozen = set()
    for p in stack.parameters():
        frozen.add(_storage_key(p))
        qs = getattr(p, "quant_state", None)
        for t in (getattr(qs, "absmax", None), getattr(qs, "code", None)):
            if isinstance(t, torch.Tensor):
                frozen.add(_storage_key(t))
    for b in stack.buffers():
        frozen.add(_storage_key(b))

    trace = _LayerTrace(n)
    saved_none = [0] * n
    input_bytes = [0] * n
    charged: set = set()  # storages already charged to a layer (cos/sin, shared across layers)

    def pack(t):
        i = trace.current
        key = _storage_key(t)
        if i is not None and key is not None and key not in frozen and key not in charged:
            charged.add(key)
            saved_none[i] += key[1]
        return t

    def pre_hook(index, module, args, kwargs):
        trace.current = index
        for t in _tensors((args, kwargs)):
            key = _storage_key(t)
            if key is not None and key not in frozen and key not in seen_inputs:
                seen_inputs.add(key)
                input_bytes[index] += key[1]

    def post_hook(module, args, kwargs, out):
        trace.current = None

    seen_inputs: set = set()
    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(functools.partial(pre_hook, i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post_hook, with_kwargs=True))
    trainable = [p for p in stack.parameters() if p.requires_grad]
    try:
        with torch.enable_grad(), _step_autocast(layers, embed.weight.device), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), trace:
            out = stack(input_ids=ids, use_cache=False)
            hidden = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
            forward_flops = trace.step_flops
            if trainable and hidden.requires_grad:
                torch.autograd.grad(hidden.float().sum(), trainable, allow_unused=True)
                backward_flops = trace.step_flops - forward_flops
            else:
                backward_flops = 2 * forward_flops  # nothing trainable in the stack: the usual estimate
    finally:
        for h in handles:
            h.remove()
    return {
        "none": saved_none, "input": input_bytes, "selective_saved": trace.selective_bytes,
        "forward_flops": trace.forward_flops, "selective_flops": trace.selective_flops,
        "step_flops": forward_flops + backward_flops,
    }


def _step_autocast(layers: nn.ModuleList, device: torch.device):
    """The trainer's autocast for a model whose frozen weights are 16-bit (`maximus.forward.autocast_for`):
    float32 modules beside them (PEFT's adapters, a trained `modules_to_save` embedding copy) feed
    16-bit linears only under it. A no-op for a float32 model."""
    from maximus.forward import autocast_for

    frozen = (p.dtype for p in layers.parameters() if not p.requires_grad and p.dtype.is_floating_point)
    return autocast_for(device, next(frozen, torch.float32))


def _fit(q1: float, q2: float, t1: int, target: float) -> float:
    """Extrapolate a quantity measured at t1 and 2*t1 tokens as b*T + c*T^2 (c >= 0)."""
    c = (q2 - 2 * q1) / (2 * t1 * t1)
    if c < 0:
        c, b = 0.0, q2 / (2 * t1)
    else:
        b = (q1 - c * t1 * t1) / t1
    return max(0.0, b * target + c * target * target)


def _head_flops(model: nn.Module, tokens: int) -> int:
    """Forward + backward FLOPs of the output projection (not in the traced stack)."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    weight = getattr(head, "weight", None)
    if weight is None or weight.dim() != 2:
        return 0
    fwd = 2 * tokens * weight.shape[0] * weight.shape[1]
    return fwd * (3 if weight.requires_grad else 2)


def measure_layer_costs(model: nn.Module, *, micro_batch: int = 1, seq_len: int = 2048,
                        probe_tokens: int = 32) -> tuple[list[LayerCost], int]:
    """Per-layer costs of each recompute mode at `micro_batch` x `seq_len`, and the FLOPs of one
    whole training step (forward + backward, output projection included) at that size.

    Traces the model twice (``probe_tokens`` and twice that, batch 1) with every layer in mode
    ``none``; RNG state, train/eval flags and recompute modes are restored afterwards."""
    stack, layers = find_decoder_layers(model)
    modes = [layer.__dict__.get("_maximus_recompute") for layer in layers]
    flags = {m: m.training for m in model.modules()}
    devices = [stack.embed_tokens.weight.device] if stack.embed_tokens.weight.is_cuda else []
    # Traced untiled: the costs are those of plain layers (tiling is applied on top of `full`).
    tiles = [getattr(layer, "mlp", None).__dict__.pop("_maximus_tile_tokens", None)
             if isinstance(getattr(layer, "mlp", None), nn.Module) else None for layer in layers]
    try:
        for layer in layers:
            layer.__dict__["_maximus_recompute"] = "none"
        model.train()
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            a = _trace_once(stack, layers, probe_tokens)
            b = _trace_once(stack, layers, 2 * probe_tokens)
    finally:
        for layer, mode in zip(layers, modes):
            if mode is None:
                layer.__dict__.pop("_maximus_recompute", None)
            else:
                layer.__dict__["_maximus_recompute"] = mode
        for layer, tile in zip(layers, tiles):
            if tile is not None:
                layer.mlp._maximus_tile_tokens = tile
        for m, flag in flags.items():
            m.training = flag

    def scaled(key: str, i: int) -> int:
        return int(round(micro_batch * _fit(a[key][i], b[key][i], probe_tokens, seq_len)))

    costs = []
    for i in range(len(layers)):
        inputs = scaled("input", i)
        costs.append(LayerCost(
            saved_bytes={"none": scaled("none", i), "selective": inputs + scaled("selective_saved", i),
                         "full": inputs},
            recompute_flops={"none": 0, "selective": scaled("selective_flops", i),
                             "full": scaled("forward_flops", i)},
        ))
    step = micro_batch * _fit(a["step_flops"], b["step_flops"], probe_tokens, seq_len)
    step += _head_flops(model, micro_batch * seq_len)
    return costs, int(step)


# --------------------------------------------------------------------------------------------
# Choosing


def _device_bytes(cost: LayerCost, mode: str, offload_activations: bool) -> int:
    """Device bytes a layer holds in `mode`; with offload the checkpointed layer input lives on the host."""
    saved = cost.saved_bytes[mode]
    if offload_activations and mode != "none":
        saved -= cost.saved_bytes["full"]
    return max(0, saved)


def _hull_upgrades(cost: LayerCost, offload_activations: bool) -> list[tuple[float, int, int, str]]:
    """The layer's efficient upgrades from `none`, in order: (bytes saved per FLOP, bytes saved,
    extra FLOPs, mode reached). Modes that are dominated (no cheaper per byte than a later one)
    are skipped, so the steps have falling efficiency (lower convex hull)."""
    points = [(_device_bytes(cost, m, offload_activations), cost.recompute_flops[m], m) for m in RECOMPUTE_MODES]
    current_bytes, current_flops, _ = points[0]
    steps = []
    remaining = points[1:]
    while remaining:
        best = None
        for b, f, m in remaining:
            saved = current_bytes - b
            if saved <= 0:
                continue
            rate = saved / max(f - current_flops, 1)
            if best is None or rate > best[0]:
                best = (rate, saved, max(f - current_flops, 0), m, b, f)
        if best is None:
            break
        rate, saved, extra, mode, current_bytes, current_flops = best
        steps.append((rate, saved, extra, mode))
        remaining = [p for p in remaining if p[1] > current_flops]
    return steps


def choose_recompute_modes(costs: Sequence[LayerCost], *, budget_bytes: int | None = None,
                           step_flops: int | None = None, max_extra_time: float = DEFAULT_MAX_EXTRA_TIME,
                           offload_activations: bool = False) -> list[str]:
    """One recompute mode per layer.

    With `budget_bytes` (device bytes for all layers' saved activations): the least recompute
    FLOPs whose saved bytes fit. Without: the least saved bytes whose recompute FLOPs stay
    within `max_extra_time` x `step_flops`. Greedy over each layer's convex hull of
    (bytes, FLOPs), best bytes-per-FLOP first: optimal up to one layer for identical layers.
    Raises `BudgetError` when even `full` everywhere does not fit the budget."""
    modes = ["none"] * len(costs)
    total = sum(_device_bytes(c, "none", offload_activations) for c in costs)
    queue = []  # (-rate, layer, step index) so each layer's steps are taken in order
    plans = [_hull_upgrades(c, offload_activations) for c in costs]
    for i, steps in enumerate(plans):
        for k, (rate, saved, extra, mode) in enumerate(steps):
            queue.append((-rate, i, k, saved, extra, mode))
    queue.sort(key=lambda item: (item[0], item[1], item[2]))

    if budget_bytes is not None:
        floor = sum(min(_device_bytes(c, m, offload_activations) for m in RECOMPUTE_MODES) for c in costs)
        if floor > budget_bytes:
            raise BudgetError(
                f"activation budget {format_bytes(budget_bytes)} is below the {format_bytes(floor)} "
                f"that recomputing every layer in full still needs",
                "lower training.micro_batch_size or training.seq_len, raise optimization.target_vram, "
                "or set optimization.offload.activations: on",
            )
        next_step = [0] * len(costs)
        while total > budget_bytes:
            for item in queue:
                _, i, k, saved, extra, mode = item
                if next_step[i] == k:
                    break
            else:  # pragma: no cover - the floor check above guarantees a step remains
                break
            queue.remove(item)
            next_step[i] += 1
            modes[i] = mode
            total -= saved
        return modes

    if step_flops is None:
        raise ValueError("choose_recompute_modes needs step_flops when no budget_bytes is given")
    allowance = max_extra_time * step_flops
    spent = 0
    blocked = set()
    next_step = [0] * len(costs)
    for _, i, k, saved, extra, mode in queue:
        if i in blocked or next_step[i] != k:
            continue
        if spent + extra > allowance:
            blocked.add(i)  # the layer's later steps are less efficient still
            continue
        spent += extra
        next_step[i] += 1
        modes[i] = mode
    return modes


# --------------------------------------------------------------------------------------------
# The public entry point


@dataclass
class CheckpointReport:
    """What `apply_checkpointing` chose, and what it expects that to cost.

    Bytes are device bytes of activations saved from forward to backward by the decoder layers
    for one micro-batch of `micro_batch` x `seq_len` tokens; FLOPs are the extra forward FLOPs
    recomputed in backward; `extra_time_fraction` is recompute FLOPs / forward+backward FLOPs of
    the whole step."""

    policy: str
    modes: list[str]
    saved_bytes: list[int]
    recompute_flops: list[int]
    saved_bytes_without_checkpointing: int
    step_flops: int
    micro_batch: int
    seq_len: int
    budget_bytes: int | None = None
    offload_activations: bool = False
    tile_tokens: int | None = None
    layer_costs: list[LayerCost] = field(default_factory=list, repr=False)

    @property
    def total_saved_bytes(self) -> int:
        return sum(self.saved_bytes)

    @property
    def total_recompute_flops(self) -> int:
        return sum(self.recompute_flops)

    @property
    def extra_time_fraction(self) -> float:
        return self.total_recompute_flops / self.step_flops if self.step_flops else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("layer_costs")
        data.update(total_saved_bytes=self.total_saved_bytes, total_recompute_flops=self.total_recompute_flops,
                    extra_time_fraction=self.extra_time_fraction)
        return data


def _policy_modes(policy, n_layers: int) -> list[str] | None:
    """The explicit modes of a policy, or None for `auto`."""
    if isinstance(policy, str):
        if policy == "auto":
            return None
        if policy in ("off", "none"):  # off: the config's former word for none
            return ["none"] * n_layers
        if policy in ("full", "selective"):
            return [policy] * n_layers
        raise ConfigError(f"gradient checkpointing: unknown policy {policy!r}",
                          "use none, full, selective, auto, or a list with none/selective/full per layer")
    modes = list(policy)
    if len(modes) != n_layers:
        raise ConfigError(f"gradient checkpointing: the policy lists {len(modes)} modes for {n_layers} decoder layers",
                          "give exactly one of none/selective/full per layer")
    for mode in modes:
        if mode not in RECOMPUTE_MODES:
            raise ConfigError(f"gradient checkpointing: unknown layer mode {mode!r}", "use none, selective or full")
    return modes


def apply_checkpointing(model: nn.Module, policy: str | Sequence[str], *, budget_bytes: int | None = None,
                        micro_batch: int = 1, seq_len: int | None = None, offload_activations: bool = False,
                        max_extra_time: float = DEFAULT_MAX_EXTRA_TIME, offloader=None,
                        tile_tokens: int | None = None) -> CheckpointReport:
    """Set each decoder layer's recompute mode; returns what was chosen and its estimated cost.

    policy: ``off`` | ``full`` | ``selective`` | ``auto`` | a list of ``none``/``selective``/``full``
      (one per decoder layer).
    budget_bytes: device bytes allowed for the saved activations of all decoder layers (what is
      left after weights, gradients, optimizer state and the loss); `auto` then picks the least
      recompute that fits. Without it `auto` minimises memory at <= `max_extra_time` extra step
      time (recompute FLOPs / forward+backward FLOPs).
    micro_batch, seq_len: the shape of one forward pass (sequences, tokens; seq_len defaults to 2048).
    offload_activations: move checkpointed layer inputs to host memory (`maximus.memory.offload`);
      `auto` then counts them as free on the device. `offloader` may pass an existing
      `ActivationOffloader` (its counters show what went through the path).
    tile_tokens: run the MLP of every fully recomputed layer over tiles of this many tokens in
      its backward (None: untiled); the costs traced for `auto` are those of untiled layers.

    Call it after the model is wrapped by PEFT, before training; calling it again replaces the
    previous choice. Raises `ConfigError` for an unknown policy or a tile_tokens below 1,
    `ModelError` when the model has no decoder layer list (or, with tile_tokens, a layer has no
    `mlp`), `BudgetError` when the budget cannot be met."""
    stack, layers = find_decoder_layers(model)
    tile_tokens = _check_tile_tokens(tile_tokens)
    if tile_tokens:
        for layer in layers:
            _layer_mlp(layer)
    modes = _policy_modes(policy, len(layers))
    seq_len = 2048 if seq_len is None else int(seq_len)
    if micro_batch < 1 or seq_len < 1:
        raise ConfigError(f"gradient checkpointing: micro_batch and seq_len must be positive, got {micro_batch} and {seq_len}")
    costs, step_flops = measure_layer_costs(model, micro_batch=micro_batch, seq_len=seq_len)
    if modes is None:
        modes = choose_recompute_modes(costs, budget_bytes=budget_bytes, step_flops=step_flops,
                                       max_extra_time=max_extra_time, offload_activations=offload_activations)
    if offload_activations and offloader is None:
        from maximus.memory.offload import ActivationOffloader

        offloader = ActivationOffloader()
    _set_modes(layers, modes, offloader if offload_activations else None, tile_tokens)
    return CheckpointReport(
        policy=policy if isinstance(policy, str) else "per-layer",
        modes=list(modes),
        saved_bytes=[_device_bytes(c, m, offload_activations) for c, m in zip(costs, modes)],
        recompute_flops=[c.recompute_flops[m] for c, m in zip(costs, modes)],
        saved_bytes_without_checkpointing=sum(c.saved_bytes["none"] for c in costs),
        step_flops=step_flops,
        micro_batch=micro_batch,
        seq_len=seq_len,
        budget_bytes=budget_bytes,
        offload_activations=offload_activations,
        tile_tokens=tile_tokens if "full" in modes else None,
        layer_costs=costs,
    )
