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
* every expert's contiguous rows in one ``torch._grouped_mm`` per product (the weights as stored,
  no copy; with float64 or a matrix dimension that is not a multiple of 16 bytes, a loop of one
  matmul per expert with tokens, one ``split`` and one ``cat``): ``gate_up = x_e W_e^T (+ b_e)``,
  the model's own gate (``_apply_gate``: SiLU/GELU x up; gpt-oss's clamped SwiGLU; both as
  autograd functions that keep only their input and work a mean expert's rows at a time), ``down``;
* LoRA stays factored: ``+ s * (x_e A_e^T) B_e^T``, the rank-r product only, so backward
  computes the adapters' gradients from ``T x r`` products and never a weight-sized tensor;
* the rows are weighted by their routing weights and added to their tokens' outputs in expert
  order with one ``index_add_`` (`_Combine`; backward: one ``index_select`` of the output's
  gradient gives both the rows' and the routing weights' gradients), so no permuted copy of the
  rows is kept.

A trainable base (full fine-tuning) gets one weight-sized gradient per projection, not one per
expert (the grouped matmul's own; in the loop, the weights are split once with ``unbind``). Same results as
Transformers' forward to float32 rounding (LoRA is ``x W^T + s (x A^T) B^T`` instead of
``x (W + s B A)^T``); tests/kernels/test_grouped_experts.py checks loss and every gradient, base
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


def _row_blocks(rows: int, block: int | None):
    """Row slices of at most `block` rows covering `rows` (one slice when `block` is None)."""
    step = max(1, block or rows)
    return [slice(i, min(i + step, rows)) for i in range(0, max(rows, 1), step)]


class _ClampedSwiGLU(torch.autograd.Function):
    """gpt-oss's gate (`GptOssExperts._apply_gate`) on interleaved ``[gate, up]`` columns:
    ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha g)`` with ``g = clamp(gate, max=l)``, the same
    float32 operations forward; backward from the saved input alone (autograd's version keeps five
    tensors and zero-fills an input-sized gradient for each strided half). `block`: rows computed at
    a time, so the intermediates of a grouped call over every routed row stay one expert's size."""

    @staticmethod
    def forward(ctx, gate_up, alpha: float, limit: float, block: int | None = None):
        ctx.save_for_backward(gate_up)
        ctx.alpha, ctx.limit, ctx.block = alpha, limit, block
        flat = gate_up.reshape(-1, gate_up.shape[-1])
        out = flat.new_empty(flat.shape[0], flat.shape[-1] // 2)
        for rows in _row_blocks(flat.shape[0], block):
            gate = flat[rows, ::2].clamp(max=limit)
            up = flat[rows, 1::2].clamp(-limit, limit)
            torch.mul(up.add_(1), gate.mul_(torch.sigmoid(gate * alpha)), out=out[rows])
        return out.reshape(*gate_up.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        alpha, limit = ctx.alpha, ctx.limit
        flat, grad = gate_up.reshape(-1, gate_up.shape[-1]), grad.reshape(-1, grad.shape[-1])
        out = torch.empty_like(flat)
        for rows in _row_blocks(flat.shape[0], ctx.block):
            raw_gate, raw_up = flat[rows, ::2], flat[rows, 1::2]
            gate = raw_gate.clamp(max=limit)
            up = raw_up.clamp(-limit, limit)
            scaled = gate * alpha
            # clamp passes the gradient where its input lies within the bounds, bounds included (where
            # clamping left it unchanged; NaN compares unequal, as in clamp's backward)
            d_up = grad[rows] * (gate * torch.sigmoid(scaled))
            torch.mul(d_up, up == raw_up, out=out[rows, 1::2])
            # d/dg g sigmoid(a g) = silu'(a g): SiLU's own backward kernel at a g
            d_glu = grad[rows] * (up + 1)
            d_glu.mul_(gate == raw_gate)
            torch.ops.aten.silu_backward.grad_input(d_glu, scaled, grad_input=out[rows, ::2])
        return out.reshape(gate_up.shape), None, None, None


class _SiluGate(torch.autograd.Function):
    """Transformers' default gate (`_default_apply_gate` with a SiLU ``act_fn``: Mixtral, Qwen3-MoE)
    on concatenated ``[gate | up]`` columns: ``silu(gate) * up``, the same float32 operations
    forward; backward from the saved input alone, written into the two halves of one gradient
    (autograd's version keeps ``silu(gate)`` beside the input and concatenates the halves'
    gradients). `block`: rows computed at a time (as `_ClampedSwiGLU`)."""

    @staticmethod
    def forward(ctx, gate_up, block: int | None = None):
        ctx.save_for_backward(gate_up)
        ctx.block = block
        flat = gate_up.reshape(-1, gate_up.shape[-1])
        half = flat.shape[-1] // 2
        out = flat.new_empty(flat.shape[0], half)
        for rows in _row_blocks(flat.shape[0], block):
            torch.mul(torch.nn.functional.silu(flat[rows, :half]), flat[rows, half:], out=out[rows])
        return out.reshape(*gate_up.shape[:-1], half)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        flat, grad = gate_up.reshape(-1, gate_up.shape[-1]), grad.reshape(-1, grad.shape[-1])
        half = flat.shape[-1] // 2
        out = torch.empty_like(flat)
        for rows in _row_blocks(flat.shape[0], ctx.block):
            gate, up = flat[rows, :half], flat[rows, half:]
            torch.mul(grad[rows], torch.nn.functional.silu(gate), out=out[rows, half:])
            # SiLU's own backward kernel
            torch.ops.aten.silu_backward.grad_input(grad[rows] * up, gate, grad_input=out[rows, :half])
        return out.reshape(gate_up.shape), None


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


def _gate(experts, gate_up: torch.Tensor, silu: bool, block: int | None = None) -> torch.Tensor:
    """The experts' gate on ``gate_up`` rows: gpt-oss's clamped SwiGLU through `_ClampedSwiGLU`,
    the default SiLU gate through `_SiluGate` (`silu`: `_silu_gate`), both `block` rows at a time,
    any other through the module's own `_apply_gate`."""
    if type(experts).__name__ == "GptOssExperts" and hasattr(experts, "alpha") and hasattr(experts, "limit"):
        return _ClampedSwiGLU.apply(gate_up, float(experts.alpha), float(experts.limit), block)
    if silu:
        return _SiluGate.apply(gate_up, block)
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


class _RankUp(torch.autograd.Function):
    """``y_e = h_e B_e^T`` for each expert's rows of ``h [N, r]`` (`offs`: the experts' row ends),
    with ``B [E, out, r]`` in any layout (PEFT's ``lora_B`` is rank-major, a layout the grouped
    matmul does not take): a contiguous copy of `B` is made for each product and not kept for
    backward, which makes it again (``torch._grouped_mm``'s own backward would keep it)."""

    @staticmethod
    def forward(ctx, h, b, offs):
        ctx.save_for_backward(h, b, offs)
        return torch._grouped_mm(h, b.contiguous().transpose(-1, -2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        h, b, offs = ctx.saved_tensors
        grad = grad.contiguous()
        d_h = torch._grouped_mm(grad, b.contiguous(), offs=offs) if ctx.needs_input_grad[0] else None
        # d B_e = grad_e^T h_e: the grouped matmul over the shared (row) dimension
        d_b = torch._grouped_mm(grad.T, h, offs=offs) if ctx.needs_input_grad[1] else None
        return d_h, d_b, None


class _AddExpertBias(torch.autograd.Function):
    """``y[rows of expert e] += bias[e]`` in place (`counts`: rows per expert, in order): no
    per-row copy of the biases; backward sums each expert's rows of the gradient (one
    ``index_add_`` by `row_expert`)."""

    @staticmethod
    def forward(ctx, y, bias, counts: list[int], row_expert):
        ctx.mark_dirty(y)
        ctx.save_for_backward(row_expert)
        ctx.experts = bias.shape[0]
        for y_e, b_e in zip(y.split(counts), bias):
            y_e.add_(b_e)
        return y

    @staticmethod
    def backward(ctx, grad):
        (row_expert,) = ctx.saved_tensors
        d_bias = None
        if ctx.needs_input_grad[1]:
            d_bias = grad.new_zeros(ctx.experts, grad.shape[-1]).index_add_(0, row_expert, grad)
        return grad, d_bias, None, None


def _grouped_mm_takes(*tensors: torch.Tensor, sizes: tuple[int, ...]) -> bool:
    """Whether ``torch._grouped_mm`` computes these operands here: it exists, a float32 / bfloat16 /
    float16 dtype, and every matrix dimension (`sizes`) a multiple of 16 bytes (its layout rule);
    otherwise `_expert_rows` loops over the experts."""
    if not hasattr(torch, "_grouped_mm") or tensors[0].dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if any(t.dtype != tensors[0].dtype for t in tensors):
        return False
    return all(size * tensors[0].element_size() % 16 == 0 for size in sizes)


def _grouped_projection(x, weight, bias, transposed: bool, lora, offs, counts, row_expert) -> torch.Tensor:
    """`_projection` for all experts at once: ``x [N, in]`` in expert order (`offs`: the experts'
    row ends, `row_expert`: each row's expert) through ``torch._grouped_mm``, the base weights as
    stored (no copy, no weight gradient unless they train), the biases added in place per expert
    (`_AddExpertBias`), LoRA kept factored (``(s x A^T)``, then `_RankUp`)."""
    y = torch._grouped_mm(x, weight if transposed else weight.transpose(-1, -2), offs=offs)
    if bias is not None:
        y = _AddExpertBias.apply(y, bias, counts, row_expert)  # the grouped matmul's backward keeps x, not y
    if lora is not None:
        a, b, scaling = lora
        h = torch._grouped_mm(x, a.to(x.dtype).transpose(-1, -2), offs=offs).mul_(scaling)
        y = y.add_(_RankUp.apply(h, b.to(x.dtype), offs))
    return y


def _expert_rows(experts, rows: torch.Tensor, counts: list[int], transposed: bool, has_bias: bool,
                 adapters: dict) -> torch.Tensor:
    """The experts' outputs for `rows` (the routed tokens in expert order, `counts` per expert). A
    function of its own so that the gathered rows and the per-expert outputs die when it returns
    (autograd keeps what it needs). All experts in one grouped matmul per product where
    ``torch._grouped_mm`` takes the shapes (`_grouped_mm_takes`), else a loop over the experts
    with tokens (`_looped_rows`)."""
    # The adapters are cast to the rows' dtype (PEFT keeps them in float32 beside bf16 weights), so
    # only their rank counts here.
    rank = [a.shape[1] for a, _, _ in adapters.values()]
    gate_up, down = experts.gate_up_proj, experts.down_proj
    sizes = (*gate_up.shape[1:], *down.shape[1:], *rank)
    if not rows.shape[0] or not _grouped_mm_takes(rows, gate_up, down, sizes=sizes):  # no rows: the loop's zeros
        return _looped_rows(experts, rows, counts, transposed, has_bias, adapters)
    counts_t = torch.tensor(counts, device=rows.device)
    offs = counts_t.cumsum(0).to(torch.int32)
    row_expert = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), counts_t) if has_bias else None
    h = _grouped_projection(rows, gate_up, experts.gate_up_proj_bias if has_bias else None, transposed,
                            adapters.get("gate_up_proj"), offs, counts, row_expert)
    # The gate a mean expert's rows at a time: its intermediates no larger than the loop's.
    block = -(-rows.shape[0] // max(1, sum(1 for c in counts if c)))
    h = _gate(experts, h, _silu_gate(experts), block)
    return _grouped_projection(h, down, experts.down_proj_bias if has_bias else None, transposed,
                               adapters.get("down_proj"), offs, counts, row_expert)


def _looped_rows(experts, rows: torch.Tensor, counts: list[int], transposed: bool, has_bias: bool,
                 adapters: dict) -> torch.Tensor:
    """`_expert_rows` as a loop over the experts with tokens, one matmul each (`_projection`)."""
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
