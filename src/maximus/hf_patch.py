"""`maximus.patch(model)`: our memory techniques inside an existing Hugging Face / TRL script.

``patch`` changes a Transformers causal LM (plain, or inside a PEFT LoRA / QLoRA / DoRA wrapper)
in place:

* **loss**: a forward with ``labels`` (or ``shift_labels``) runs the decoder to hidden states and
  computes Transformers' causal-LM loss (same shift, ignore index -100, ``num_items_in_batch``
  normalisation) with `maximus.losses.linear_cross_entropy`, one chunk of tokens at a time, over
  the labelled tokens only; ``.logits`` is None unless the call passes ``return_logits=True``
  (which runs the model's own forward). A forward without labels (generation, evaluation
  without labels) is the model's own. As the model's own loss, it includes Gemma's final
  soft-cap, Granite's ``logits_scaling`` and, for a mixture of experts asked for its router
  logits (the call or the config), ``router_aux_loss_coef`` x its load-balancing loss (returned
  as ``aux_loss``). A logit scale we do not model (Cohere's ``logit_scale``, ...) keeps the
  model's own loss, with a notice.
* **TRL's fused LM head** (``model(..., fused_lm_head=True)``, installed by TRL's trainers with
  ``add_fused_lm_head``): served from our chunked head (`maximus.losses.token_outputs`), with
  every field TRL asked for (``log_probs``, ``entropy``, ``is_top1``, ...). TRL's own head is
  never installed on a patched model, so the two never both run; where we cannot serve it (a
  logit scale we do not model, an unknown TRL version) TRL's head is left alone, with a notice.
* **checkpointing**: `maximus.memory.checkpointing` per layer by cost (``auto``), or as given.
  A trainer's own ``gradient_checkpointing=True`` is absorbed with a notice: the layers are
  recomputed once, by us, never twice.
* **kernels**: `maximus.kernels.apply_kernels` (padding-free attention over packed rows, Triton on
  CUDA).
* **sizing**: with ``target_vram``, `maximus.memory.planner.plan_for_budget` picks the
  checkpointing and the loss chunk for ``micro_batch_size`` x ``seq_len`` tokens.

The mechanism is a class swap (the checkpointing module's reason: same ``__name__``, so
``save_pretrained``, PEFT and the trainers see the model they know; state_dict keys do not
change, so adapters save exactly as PEFT's would). `unpatch` restores the class, the layers, the
attention and, where TRL had asked for its head, re-installs it.
"""
from __future__ import annotations

import functools
import inspect
import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.utils import ModelOutput

from maximus.compat import TRL_FUSED_CLOSURE, TRL_FUSED_FORWARD_NAME
from maximus.errors import ConfigError, ModelError
from maximus.families import is_mixture_of_experts
from maximus.forward import IGNORE_INDEX, logits_divisor, output_head, router_aux_loss, through_head, token_loss_sum
from maximus.structure import causal_lm_of, compute_device, find_decoder_layers

LOSSES = ("exact", "off")
CHECKPOINTING = ("auto", "none", "off", "full", "selective")

#: Config attributes that scale the logits before the softmax; our head does not model them, so
#: on such a model (Cohere, Falcon-H1, ...) the loss stays the model's own. Granite's
#: ``logits_scaling`` is modelled (`maximus.forward.logits_divisor`: the head sees the hidden states divided).
_LOGIT_SCALE_ATTRS = ("logit_scale", "output_multiplier", "lm_head_multiplier")


@dataclass
class FusedHeadOutput(ModelOutput):
    """The fields of TRL's ``FusedCausalLMOutput`` (same names, same meaning: per-token tensors
    [B, T-1], zero where the label is -100)."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


@dataclass
class TRLHead:
    """What TRL's ``add_fused_lm_head`` asked for, read from the forward it tried to install."""

    outputs: tuple[str, ...] = ("log_probs",)
    temperature: float = 1.0
    cast_lm_head_to_fp32: bool = False


@dataclass
class PatchReport:
    """What `patch` did to a model (``maximus.patch_report(model)``)."""

    loss: str
    chunk_size: int | None
    checkpointing: list[str]
    kernels: dict
    trl_head: TRLHead | None = None
    plan: Any = None
    notices: list[str] = field(default_factory=list)
    # restore state for `unpatch`
    base_class: type | None = field(default=None, repr=False)
    attention: str | None = field(default=None, repr=False)
    hf_checkpointing: list[bool] = field(default_factory=list, repr=False)
    trainer_checkpointing_absorbed: bool = False

    def notice(self, message: str) -> None:
        if message not in self.notices:
            self.notices.append(message)
            print(f"notice: {message}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------


def patch(model, *, loss: str = "exact", gradient_checkpointing: str | bool | list = "auto", kernels: str = "auto",
          target_vram: Any = None, seq_len: int = 2048, micro_batch_size: int = 1):
    """Apply Maximus's loss, checkpointing, kernels and sizing to ``model`` in place; returns it.

    loss: ``exact`` (chunked exact loss, no logits) or ``off`` (the model's own loss).
    gradient_checkpointing: ``auto`` (per layer by cost; by the planner with ``target_vram``),
      ``off``, ``full``, ``selective``, True (= full), False (= off), or one of none/selective/full
      per decoder layer.
    kernels: ``auto`` | ``triton`` | ``compile`` | ``eager`` (`maximus.kernels`).
    target_vram: a budget (``"16GB"``, bytes, a card name, ``auto``): the planner sizes the
      checkpointing and the loss chunk for ``micro_batch_size`` sequences of ``seq_len`` tokens
      (also the shape the ``auto`` checkpointing costs are measured for).

    Raises ConfigError for an unknown option, ModelError for a model that is not a decoder-only
    causal LM, BudgetError when nothing fits ``target_vram``. Patching a patched model re-patches.
    """
    if loss not in LOSSES:
        raise ConfigError(f"maximus.patch: unknown loss {loss!r}", "use loss='exact' or loss='off'")
    policy = _checkpointing_policy(gradient_checkpointing)
    lm = causal_lm_of(model)
    if not (hasattr(lm, "get_decoder") and hasattr(lm, "get_output_embeddings") and hasattr(lm, "config")):
        raise ModelError(f"maximus.patch: {type(lm).__name__} is not a Transformers causal language model",
                         "pass an AutoModelForCausalLM model (or a PEFT model wrapping one)")
    if "_maximus_patch" in lm.__dict__:
        unpatch(model)
    from maximus.kernels import apply_kernels
    from maximus.memory.checkpointing import apply_checkpointing

    _, layers = find_decoder_layers(lm)
    device = compute_device(lm)
    report = PatchReport(loss=loss, chunk_size=None, checkpointing=[], kernels={},
                         attention=getattr(lm.config, "_attn_implementation", None),
                         hf_checkpointing=[bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers])
    if loss == "exact":
        scale = next((a for a in _LOGIT_SCALE_ATTRS if getattr(lm.config.get_text_config(), a, None) not in (None, 1, 1.0)),
                     None)
        if scale is not None:
            report.loss = "off"
            report.notice(f"maximus.patch: {type(lm).__name__} scales its logits ({scale}); the loss stays the model's own")
        elif hasattr(lm.config.get_text_config(), "output_router_logits") and not _router_loss_known(lm):
            report.loss = "off"
            report.notice(f"maximus.patch: {type(lm).__name__} is a mixture of experts whose router loss Maximus "
                          "does not know; the loss (with its router loss) stays the model's own")

    if target_vram is not None:
        policy, report.chunk_size, report.plan = _plan(model, lm, policy, target_vram, seq_len, micro_batch_size, device)
    ckpt = apply_checkpointing(lm, policy, micro_batch=micro_batch_size, seq_len=seq_len)
    report.checkpointing = list(ckpt.modes)
    kernel_report = apply_kernels(model, kernels, device)
    report.kernels = kernel_report.to_dict()
    report.kernels["patched_modules"] = list(kernel_report.patched)
    for message in kernel_report.notices:
        report.notice(message.removeprefix("notice: "))

    installed = lm.__dict__.pop("forward", None)  # patched after a TRL trainer installed its head
    lm.__dict__["_maximus_patch"] = report
    report.base_class = type(lm)
    lm.__class__ = _patched_class(type(lm))
    if installed is not None:
        lm.forward = installed  # through our __setattr__: a TRL head is taken over, anything else kept
    return model


def unpatch(model):
    """Undo `patch`: the original class (and forward), checkpointing, attention and compiled
    layers; a TRL fused head that `patch` served is re-installed as TRL's own. Returns the model."""
    from maximus.memory.checkpointing import remove_checkpointing

    lm = causal_lm_of(model)
    report = lm.__dict__.get("_maximus_patch")
    if report is None:
        return model
    lm.__class__ = report.base_class
    del lm.__dict__["_maximus_patch"]
    remove_checkpointing(lm)
    from maximus.kernels.grouped_experts import uninstall_grouped_experts
    from maximus.kernels.lean_lora import uninstall_lean_lora
    from maximus.kernels.lean_norm import uninstall_lean_norm
    from maximus.kernels.triton.install import uninstall_triton_kernels

    uninstall_lean_lora(lm)  # apply_kernels routed the LoRA linears through lean projections
    uninstall_lean_norm(lm)  # ... and the RMSNorms through the lean norm
    uninstall_grouped_experts(lm)  # ... and, on CPU, the fused experts through the grouped forward
    uninstall_triton_kernels(lm)  # ... and, on CUDA, the norms, MLPs, attentions and 4-bit LoRA through Triton
    _, layers = find_decoder_layers(lm)
    for layer, was_on in zip(layers, report.hf_checkpointing):
        if hasattr(layer, "gradient_checkpointing"):
            layer.gradient_checkpointing = was_on or report.trainer_checkpointing_absorbed
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is not None:
            layer._compiled_call_impl = None
    if report.attention and getattr(lm.config, "_attn_implementation", None) != report.attention:
        lm.set_attn_implementation(report.attention)
    if report.trl_head is not None:
        from trl.trainer.utils import add_fused_lm_head

        head = report.trl_head
        add_fused_lm_head(lm, temperature=head.temperature, cast_lm_head_to_fp32=head.cast_lm_head_to_fp32,
                          outputs=head.outputs)
    return model


def patch_report(model) -> PatchReport | None:
    """What `patch` did to ``model`` (None when it is not patched)."""
    return causal_lm_of(model).__dict__.get("_maximus_patch")


# ------------------------------------------------------------------------------------------------


def _router_loss_known(lm) -> bool:
    """Whether `maximus.forward.router_aux_loss` computes this mixture of experts' load-balancing loss
    as its own forward does (its module's `load_balancing_loss_func`, its expert counts)."""
    return is_mixture_of_experts(lm) and hasattr(sys.modules[type(lm).__module__], "load_balancing_loss_func")


def _checkpointing_policy(value):
    if value is True:
        return "full"
    if value is False:
        return "none"
    if isinstance(value, str):
        if value not in CHECKPOINTING:
            raise ConfigError(f"maximus.patch: unknown gradient_checkpointing {value!r}",
                              "use auto, none, full, selective, True/False, or one of none/selective/full per layer")
        return "none" if value == "off" else value  # off: the former word for none
    return list(value)


def _plan(model, lm, policy, target_vram, seq_len, micro_batch_size, device):
    """(checkpointing policy, loss chunk, Plan) for the budget; the planner may only change what
    `patch` controls (checkpointing, loss chunk): batch, optimizer and offload are the trainer's."""
    from maximus.memory.planner import plan_for_budget, resolve_budget

    method = "full"
    if hasattr(model, "peft_config"):
        method = "qlora" if getattr(lm, "is_loaded_in_4bit", False) else "lora"
    dtype = {torch.float32: "fp32", torch.float16: "fp16"}.get(lm.dtype, "bf16")
    peft_cfg = next(iter(getattr(model, "peft_config", {}).values()), None)
    budget = resolve_budget(target_vram, device.type)
    fixed = policy if isinstance(policy, str) and policy != "auto" else "auto"
    plan = plan_for_budget(lm.config, budget, method=method, batch_size=micro_batch_size,
                           micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype,
                           lora_r=int(getattr(peft_cfg, "r", 16) or 16), gradient_checkpointing=fixed,
                           offload_activations=False, offload_optimizer=False,
                           allow={"checkpointing", "selective", "loss_chunk"}, device=device.type)
    chosen = policy if isinstance(policy, list) else list(plan.recompute)  # one mode per decoder layer
    return chosen, plan.loss_chunk_size, plan


_PATCHED_CLASSES: dict[type, type] = {}


def _patched_class(base: type) -> type:
    cls = _PATCHED_CLASSES.get(base)
    if cls is not None:
        return cls
    base_setattr = base.__setattr__

    @functools.wraps(base.forward)
    def forward(self, *args, **kwargs):
        return _forward(self, base, args, kwargs)

    def __setattr__(self, name, value):
        report = self.__dict__.get("_maximus_patch")
        if name == "forward" and report is not None and report.loss == "exact":
            head = _trl_head_of(value, report, self)
            if head is not None:
                report.trl_head = head
                report.notice(f"maximus.patch: TRL's fused LM head ({', '.join(head.outputs)}) is served by "
                              "Maximus's chunked exact head; TRL's own head is not installed")
                return
        base_setattr(self, name, value)

    def activation_checkpointing_enable(self, *args, **kwargs):
        report = self.__dict__["_maximus_patch"]
        report.trainer_checkpointing_absorbed = True
        label = _modes_label(report.checkpointing)
        report.notice(f"maximus.patch: the trainer's gradient_checkpointing is served by Maximus's checkpointing "
                      f"({label}); Transformers' own recompute stays off, so no layer is recomputed twice")

    cls = type(base.__name__, (base,), {
        "forward": forward,
        "__setattr__": __setattr__,
        "activation_checkpointing_enable": activation_checkpointing_enable,
        "gradient_checkpointing_enable": activation_checkpointing_enable,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
    })
    _PATCHED_CLASSES[base] = cls
    return cls


def _modes_label(modes: list[str]) -> str:
    kinds = sorted(set(modes))
    if len(kinds) == 1:
        return f"{kinds[0]} on all {len(modes)} layers"
    return ", ".join(f"{m} x{modes.count(m)}" for m in kinds)


def _trl_head_of(value, report: PatchReport, lm) -> TRLHead | None:
    """The options of TRL's ``add_fused_lm_head`` forward (None when ``value`` is not one, or one
    we cannot serve: then TRL's head is installed as it is, with a notice). Its logit scale must be
    the one our head applies: 1, or Granite's 1 / ``logits_scaling``."""
    func = getattr(value, "__func__", value)
    code = getattr(func, "__code__", None)
    if code is None or code.co_name != TRL_FUSED_FORWARD_NAME or "trl" not in code.co_filename:
        return None
    try:
        found = inspect.getclosurevars(func).nonlocals
    except (TypeError, ValueError):
        found = {}
    modelled = 1.0 / logits_divisor(lm.config)
    if not TRL_FUSED_CLOSURE <= set(found) or not math.isclose(float(found.get("logit_scale", 1.0)), modelled):
        report.notice("maximus.patch: this TRL version's fused LM head is not one Maximus can serve; TRL's own head "
                      "computes its log-probs (the loss's memory savings do not apply to those calls)")
        return None
    return TRLHead(outputs=tuple(found["outputs"]), temperature=float(found["temperature"]),
                   cast_lm_head_to_fp32=bool(found["cast_lm_head_to_fp32"]))


@functools.lru_cache(maxsize=None)
def _forward_parameters(base: type) -> tuple[str, ...]:
    return tuple(n for n in inspect.signature(base.forward).parameters if n != "self")


def _forward(self, base: type, args: tuple, kwargs: dict):
    report: PatchReport = self.__dict__["_maximus_patch"]
    if args:  # bind positional arguments by the original signature's names
        kwargs = {**dict(zip(_forward_parameters(base), args)), **kwargs}
    fused = kwargs.pop("fused_lm_head", False)
    return_logits = kwargs.pop("return_logits", False)
    labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
    if report.loss != "exact" or return_logits or (labels is None and shift_labels is None):
        if fused:
            raise ModelError("maximus.patch: fused_lm_head=True needs labels and the exact loss",
                             "pass labels, or patch with loss='exact'")
        return base.forward(self, **kwargs)
    kwargs.pop("labels", None)
    kwargs.pop("shift_labels", None)
    kwargs.pop("logits_to_keep", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs["use_cache"] = False
    # A mixture of experts adds its router load-balancing loss as its own forward does: when asked
    # (the call, else the config), coefficient x the model's load_balancing_loss_func.
    router = is_mixture_of_experts(self) and bool(
        kwargs.pop("output_router_logits", None) or getattr(self.config, "output_router_logits", False))
    if router:
        kwargs["output_router_logits"] = True
    out = self.get_decoder()(**kwargs)
    aux_loss = router_aux_loss(self, out.router_logits, kwargs.get("attention_mask")) if router else None
    # With the model split across devices (`device_map`), the decoder may end where the head is not.
    hidden = out.last_hidden_state.to(self.get_output_embeddings().weight.device)
    if shift_labels is None:
        hidden, target = hidden[:, :-1], labels[:, 1:]
    else:
        target = shift_labels
    target = target.to(hidden.device)
    mask = target != IGNORE_INDEX
    count = mask.sum()
    # an all-masked batch gives 0, not 0 / 0 (as linear_cross_entropy's mean does)
    denominator = (count if num_items is None else torch.as_tensor(num_items, device=hidden.device)).clamp(min=1)
    rows, row_targets = hidden[mask], target[mask]  # labelled tokens only (completion-only loss skips prompts)
    if fused:
        head_opts = report.trl_head or TRLHead()
        fields = through_head(self, rows, lambda h: _fused_fields(self, h, row_targets, head_opts, report.chunk_size))
        per_token = {k: (None if v is None else v.new_zeros(mask.shape).masked_scatter(mask, v))
                     for k, v in fields.items()}
        loss = _with_router_loss(self, -per_token["log_probs"].sum() / denominator, aux_loss)
        return FusedHeadOutput(loss=loss, label_mask=mask, aux_loss=aux_loss, **per_token)
    if rows.shape[0] == 0:
        loss_sum = hidden.sum() * 0.0  # stays connected to the graph: backward of an all-masked batch is zero
    else:
        loss_sum = through_head(self, rows, lambda h: token_loss_sum(h, output_head(self), row_targets,
                                                                      mode="exact", chunk_size=report.chunk_size))
    loss = _with_router_loss(self, loss_sum / denominator, aux_loss)
    if router:
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=None, hidden_states=out.hidden_states,
                                         attentions=out.attentions, router_logits=out.router_logits)
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=out.hidden_states, attentions=out.attentions)


def _with_router_loss(lm, loss: torch.Tensor, aux_loss: torch.Tensor | None) -> torch.Tensor:
    if aux_loss is None:
        return loss
    return loss + lm.router_aux_loss_coef * aux_loss.to(loss.device)


def _fused_fields(lm, rows: torch.Tensor, targets: torch.Tensor, head_opts: TRLHead, chunk_size: int | None) -> dict:
    from maximus.losses.token_outputs import token_outputs

    head = output_head(lm)
    weight, bias = head.weight, head.bias
    if head_opts.cast_lm_head_to_fp32:
        rows, weight = rows.float(), weight.float()
        bias = None if bias is None else bias.float()
    with torch.autocast(rows.device.type, enabled=False) if head_opts.cast_lm_head_to_fp32 else nullcontext():
        return token_outputs(rows, weight, targets, outputs=head_opts.outputs, bias=bias, softcap=head.softcap,
                             temperature=head_opts.temperature, chunk_size=chunk_size)
