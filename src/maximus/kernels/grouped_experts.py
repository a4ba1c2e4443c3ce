"""Grouped expert forward: one matmul per expert over the tokens routed to it, LoRA kept factored.

Transformers keeps a mixture-of-experts layer's experts as fused 3-D parameters (Mixtral,
Qwen3-MoE: ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; gpt-oss transposed, with
biases and its clamped, interleaved SwiGLU). Its ``eager`` experts forward builds a one-hot
``E x k x T`` mask and loops over the experts that were hit, a ``torch.where`` per expert; its
``grouped_mm`` forward (the default with torch >= 2.9) sorts the routed tokens and runs
``torch._grouped_mm``. With LoRA on the experts (PEFT ``target_parameters``), PEFT folds the
adapters into the weights on every forward (``W + s * B @ A`` for the whole expert stack, one
``baddbmm``), so both forwards multiply by a merged copy of every expert's weights, and backward
computes the full ``[E, out, in]`` gradient of that copy before projecting it onto the rank-r
factors: as many FLOPs as the weight gradient of full fine-tuning, and, in the eager loop, one
zero-filled ``[E, out, in]`` gradient per expert hit (the backward of ``W[e]``).

`grouped_experts` computes the same function another way:

* the ``T x k`` routed (token, expert) pairs are sorted by expert once (a stable sort, so each
  expert's tokens stay in token order) and the tokens gathered once;
* per expert with tokens, on its contiguous slice (one ``split``, one ``cat`` back):
  ``gate_up = x_e W_e^T (+ b_e)``, the model's own gate (``_apply_gate``: SiLU/GELU x up; gpt-oss's
  clamped SwiGLU as one autograd function that keeps only its input), ``down``;
* LoRA stays factored: ``+ s * (x_e A_e^T) B_e^T``, the rank-r product only, so backward
  computes the adapters' gradients from ``T x r`` products and never a weight-sized tensor;
* the rows go back to token order (one gather) and each token's k rows are weighted and summed
  in one batched matmul (``[1, k] x [k, hidden]`` per token).

The base weights are split once per forward (``unbind``: one autograd node, so a trainable base,
as in full fine-tuning, gets one weight-sized gradient, not one per expert). Same results as
Transformers' forward to float32 rounding (LoRA is ``x W^T + s (x A^T) B^T`` instead of
``x (W + s B A)^T``); tests/fused/test_grouped_experts.py checks loss and every gradient, base
and adapter, against the eager experts forward of Mixtral, Qwen3-MoE and gpt-oss.

Installed per module instance (`install_grouped_experts`) on the outermost module at each experts
position (PEFT's ``ParamWrapper`` chain when the experts carry adapters), so the classes,
state_dict keys and the saved adapter stay PEFT's. A wrapper in a state this path does not
compute (adapters disabled or merged, several active adapters, a LoRA bias) runs the library's
forward for that call. `uninstall_grouped_experts` takes it off again.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from maximus.kernels.forward_override import install_forward_override, is_transformers_class, remove_forward_overrides

__all__ = ["EXPERT_CLASSES", "grouped_experts", "install_grouped_experts", "uninstall_grouped_experts"]

#: Transformers' fused experts classes this forward computes (their layout is read from the module:
#: ``is_transposed``, ``has_bias`` and ``_apply_gate``, set by Transformers' experts decorator).
EXPERT_CLASSES = ("MixtralExperts", "Qwen3MoeExperts", "GptOssExperts")
_MARK = "_maximus_grouped_experts"
_PROJECTIONS = ("gate_up_proj", "down_proj")


def _lora_factors(wrapper) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A [E, r, in], B [E, out, r], scaling) of a PEFT ``ParamWrapper``'s one active adapter, in
    PEFT's layout (``lora_A`` rows expert-major, ``lora_B`` columns rank-major); None when the
    wrapper is in a state `grouped_experts` does not compute."""
    if wrapper.disable_adapters or wrapper.merged:
        return None
    active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if len(active) != 1 or wrapper.lora_bias.get(active[0], False) or wrapper.parameter_name not in _PROJECTIONS:
        return None
    name, experts = active[0], wrapper.num_experts
    a = wrapper.lora_A[name].weight
    b = wrapper.lora_B[name].weight
    return (a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts).permute(2, 0, 1),
            float(wrapper.scaling[name]))


def _unwrap(module) -> tuple[torch.nn.Module, dict] | None:
    """(the Transformers experts module, {parameter name: LoRA factors}) under `module`'s PEFT
    wrappers; None when some wrapper cannot take this path."""
    adapters = {}
    while hasattr(module, "parameter_name") and hasattr(module, "base_layer"):  # PEFT ParamWrapper
        factors = _lora_factors(module)
        if factors is None:
            return None
        adapters[module.parameter_name] = factors
        module = module.base_layer
    return module, adapters


def _projection(x: torch.Tensor, weight: torch.Tensor, bias, transposed: bool, lora) -> torch.Tensor:
    """One expert's projection of rows `x`: ``x W^T`` (``x W`` for transposed storage), bias, LoRA
    (``+ (s x A^T) B^T``: the scaling on the rank-r product, the add fused into its matmul)."""
    if transposed:
        y = x @ weight if bias is None else torch.addmm(bias, x, weight)
    else:
        y = torch.nn.functional.linear(x, weight, bias)
    if lora is not None:
        a, b, scaling = lora
        y = torch.addmm(y, (x @ a.to(x.dtype).T) * scaling, b.to(x.dtype).T)
    return y


class _ClampedSwiGLU(torch.autograd.Function):
    """gpt-oss's gate (`GptOssExperts._apply_gate`) on interleaved ``[gate, up]`` columns:
    ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha g)`` with ``g = clamp(gate, max=l)``, the same
    float32 operations forward; backward from the saved input alone (autograd's version keeps five
    tensors and zero-fills an input-sized gradient for each strided half)."""

    @staticmethod
    def forward(ctx, gate_up, alpha: float, limit: float):
        ctx.save_for_backward(gate_up)
        ctx.alpha, ctx.limit = alpha, limit
        gate = gate_up[..., ::2].clamp(max=limit)
        up = gate_up[..., 1::2].clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        alpha, limit = ctx.alpha, ctx.limit
        raw_gate, raw_up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = raw_gate.clamp(max=limit)
        up = raw_up.clamp(-limit, limit)
        scaled = gate * alpha
        out = torch.empty_like(gate_up)
        # clamp passes the gradient where its input lies within the bounds, bounds included (where
        # clamping left it unchanged; NaN compares unequal, as in clamp's backward)
        d_up = grad * (gate * torch.sigmoid(scaled))
        torch.mul(d_up, up == raw_up, out=out[..., 1::2])
        # d/dg g sigmoid(a g) = silu'(a g): SiLU's own backward kernel at a g
        d_glu = grad * (up + 1)
        d_glu.mul_(gate == raw_gate)
        torch.ops.aten.silu_backward.grad_input(d_glu, scaled, grad_input=out[..., ::2])
        return out, None, None


class _SiluGate(torch.autograd.Function):
    """Transformers' default gate (`_default_apply_gate` with a SiLU ``act_fn``: Mixtral, Qwen3-MoE)
    on concatenated ``[gate | up]`` columns: ``silu(gate) * up``, the same float32 operations
    forward; backward from the saved input alone, written into the two halves of one gradient
    (autograd's version keeps ``silu(gate)`` beside the input and concatenates the halves'
    gradients)."""

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.empty_like(gate_up)
        d_gate, d_up = out.chunk(2, dim=-1)
        torch.mul(grad, torch.nn.functional.silu(gate), out=d_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)  # SiLU's own backward kernel
        return out


class _Combine(torch.autograd.Function):
    """The routed rows back to their tokens: ``out[t] = sum of w_i * rows_i over the rows i of token
    t``, for `rows [N, H]` in expert order with their routing weights ``weights [N]`` and tokens
    ``token [N]`` (one ``index_add_`` forward, in expert order as Transformers' experts add them);
    backward gathers the output's gradient once (``index_select``) for both inputs' gradients, and
    keeps the rows as they are (no permuted copy, no per-token batched matmul)."""

    @staticmethod
    def forward(ctx, rows, weights, token, tokens: int):
        ctx.save_for_backward(rows, weights, token)
        out = rows.new_zeros(tokens, rows.shape[-1])
        return out.index_add_(0, token, rows * weights.unsqueeze(-1))

    @staticmethod
    def backward(ctx, grad):
        rows, weights, token = ctx.saved_tensors
        g = grad.index_select(0, token)
        d_weights = torch.linalg.vecdot(g, rows) if ctx.needs_input_grad[1] else None
        d_rows = g.mul_(weights.unsqueeze(-1)) if ctx.needs_input_grad[0] else None
        return d_rows, d_weights, None, None


def _silu_gate(experts) -> bool:
    """Whether `experts` gates with Transformers' default ``act_fn(gate) * up`` and a SiLU."""
    try:
        from transformers.activations import SiLUActivation
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return False
    gate = getattr(type(experts), "_apply_gate", None)
    return gate is _default_apply_gate and isinstance(getattr(experts, "act_fn", None), (SiLUActivation, torch.nn.SiLU))


def _gate(experts, gate_up: torch.Tensor, silu: bool) -> torch.Tensor:
    """The experts' gate on one expert's ``gate_up`` rows: gpt-oss's clamped SwiGLU through
    `_ClampedSwiGLU`, the default SiLU gate through `_SiluGate` (`silu`: `_silu_gate`), any
    other through the module's own `_apply_gate`."""
    if type(experts).__name__ == "GptOssExperts" and hasattr(experts, "alpha") and hasattr(experts, "limit"):
        return _ClampedSwiGLU.apply(gate_up, float(experts.alpha), float(experts.limit))
    if silu:
        return _SiluGate.apply(gate_up)
    return experts._apply_gate(gate_up)


def _per_expert(factors):
    """[(A_e, B_e, scaling) per expert] (split with `unbind`: one autograd node, so backward builds
    each factor's gradient once, not a zero-filled one per expert); [None, ...] without LoRA."""
    if factors is None:
        return defaultdict(lambda: None)
    a, b, scaling = factors
    return [(a_e, b_e, scaling) for a_e, b_e in zip(a.unbind(0), b.unbind(0))]


def grouped_experts(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, adapters: dict | None = None) -> torch.Tensor:
    """The output of Transformers' fused `experts` module (one of `EXPERT_CLASSES`) for
    ``hidden_states [T, H]`` routed to ``top_k_index [T, k]`` with ``top_k_weights [T, k]``, computed
    per expert over its routed tokens (module docstring). `adapters`: {``gate_up_proj`` |
    ``down_proj``: (A [E, r, in], B [E, out, r], scaling)} LoRA factors added to those weights."""
    adapters = adapters or {}
    num_experts = experts.gate_up_proj.shape[0]
    k = top_k_index.shape[-1]
    transposed = bool(getattr(experts, "is_transposed", False))
    has_bias = bool(getattr(experts, "has_bias", False))
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # Index num_experts is Transformers' expert-parallel sentinel ("no expert here"): sorted last, skipped.
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    routed = order[:sum(counts)]
    token = routed // k
    expert_rows = _expert_rows(experts, hidden_states.index_select(0, token), counts, transposed, has_bias, adapters)
    # Each row weighted and added to its token's output in expert order (`_Combine`); autograd keeps
    # the expert-order rows, their weights and tokens: no permuted copy of the rows.
    weights = top_k_weights.to(hidden_states.dtype).reshape(-1).index_select(0, routed)
    return _Combine.apply(expert_rows, weights, token, hidden_states.shape[0])


def _expert_rows(experts, rows: torch.Tensor, counts: list[int], transposed: bool, has_bias: bool,
                 adapters: dict) -> torch.Tensor:
    """The experts' outputs for `rows` (the routed tokens in expert order, `counts` per expert). A
    function of its own so that the gathered rows and the per-expert outputs die when it returns
    (autograd keeps what it needs)."""
    gate_up_w = experts.gate_up_proj.unbind(0)
    down_w = experts.down_proj.unbind(0)
    gate_up_b = experts.gate_up_proj_bias.unbind(0) if has_bias else None
    down_b = experts.down_proj_bias.unbind(0) if has_bias else None
    lora_gate_up = _per_expert(adapters.get("gate_up_proj"))
    lora_down = _per_expert(adapters.get("down_proj"))
    # Per-expert views with `split` and one `cat` of the outputs: one autograd node each way (slicing
    # would give each expert's backward a zero-filled rows-sized gradient, writing into a buffer one
    # copy of the whole buffer's gradient per expert).
    silu = _silu_gate(experts)
    outputs = []
    for e, x in enumerate(rows.split(counts)):
        if not counts[e]:
            continue
        h = _projection(x, gate_up_w[e], gate_up_b[e] if has_bias else None, transposed, lora_gate_up[e])
        h = _gate(experts, h, silu)
        outputs.append(_projection(h, down_w[e], down_b[e] if has_bias else None, transposed, lora_down[e]))
    return torch.cat(outputs) if outputs else rows.new_zeros(0, rows.shape[-1])


def _grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    unwrapped = _unwrap(self)
    if unwrapped is None:  # e.g. adapters disabled for a reference forward: the library's path
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    experts, adapters = unwrapped
    return grouped_experts(experts, hidden_states, top_k_index, top_k_weights, adapters)


setattr(_grouped_experts_forward, _MARK, True)


def _innermost(module):
    while hasattr(module, "parameter_name") and hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def install_grouped_experts(model: torch.nn.Module) -> list[str]:
    """Route every fused Transformers experts module of `model` (`EXPERT_CLASSES`, bare or under
    PEFT's ``target_parameters`` wrappers) through `grouped_experts`; returns their module paths."""
    inner = {id(m.base_layer) for m in model.modules() if hasattr(m, "parameter_name") and hasattr(m, "base_layer")}

    def wanted(module):
        return id(module) not in inner and is_transformers_class(_innermost(module), EXPERT_CLASSES)

    return install_forward_override(model, wanted, _grouped_experts_forward, _MARK)


def uninstall_grouped_experts(model: torch.nn.Module) -> int:
    """Undo `install_grouped_experts`; returns how many modules went back to the library's forward."""
    return remove_forward_overrides(model, _MARK)
