"""Quantization-aware training: every forward in training mode sees the weights the export writes.

`install_qat(model, target)` changes each quantized matrix of `model` (the decoder's linears, the
token embedding and the output layer; `maximus.qat.targets` decides each one's type):

- a trained weight (full fine-tuning) reads as its fake-quantized self, with a straight-through
  gradient (the gradient of the rounded weight is the weight's gradient);
- a frozen base weight under a LoRA adapter reads as `Q(W + s B A) - s B A`, so the layer's output
  `x (Q(W + s B A) - s B A)^T + x (s B A)^T` is `x Q(W + s B A)^T`: the adapter trains against the
  quantized merged weight, which is what the export writes (PEFT merges W + s B A, then the file is
  quantized). The adapter's gradient is the straight-through one: the correction is constant;
- a QLoRA base layer dequantizes its NF4 weight and does the same (the export merges into the
  full-precision base, so there the deployed weights differ from the trained ones by NF4's rounding);
- with `adapter="separate"` (`training.qat_adapter`) a LoRA layer's frozen base reads as `Q(W)`
  alone, so the layer computes `x Q(W)^T + x (s B A)^T`: the base file rounded, the adapter in
  float, as llama.cpp applies a LoRA file to a quantized base (`maximus export --format gguf-lora`).

Reading `module.weight` gives the fake-quantized tensor to everyone (PEFT, the lean LoRA kernel,
the chunked loss that reads the head), while `state_dict`, the optimizer and checkpoints keep the
master weights: the module's class is swapped for a subclass whose `weight` is a property over
`_parameters["weight"]`. In eval mode (`model.eval()`) the weights read as they are, so held-out
evaluation scores the float model; the deployed file is scored by `maximus eval --gguf`.

Each fake-quantized weight is cached until the weights it comes from change (their in-place
version counters): gradient accumulation and recomputation reuse it. The cache holds one copy of
every quantized matrix (the planner counts it: `maximus.memory.estimate`).
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from maximus.qat.ggml_rounding import fake_quantize
from maximus.qat.targets import GGUF_TARGETS, INT4_GROUP_SIZE, GGUFTensor, ggml_types, rounds_to_fp16_first


class _StraightThrough(torch.autograd.Function):
    """Forward: the rounded weight (its exact values); backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx, weight, rounded):
        return rounded

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@dataclass
class QatReport:
    """What `install_qat` did: {module path: ggml type (or ``int4``)} and the bytes its cache may hold."""

    target: str
    types: dict[str, str] = field(default_factory=dict)
    cache_bytes: int = 0
    roundings: list = field(default_factory=list, repr=False)
    #: under adapter="separate": {LoRA layer path in the causal LM: (its base layer, its rounding)}
    apart: dict = field(default_factory=dict, repr=False)

    def set_active(self, active: bool | list[bool]) -> None:
        """Whether the forward sees the rounded weights (True from `install_qat`); False reads the
        weights as they are, as in eval mode (`training.qat_start`: the plain first steps). A list
        says it per rounding, in the order of `roundings` (`training.qat_fraction`)."""
        flags = active if isinstance(active, list) else [active] * len(self.roundings)
        if len(flags) != len(self.roundings):
            raise ValueError(f"{len(flags)} flags for {len(self.roundings)} roundings")
        for rounding, flag in zip(self.roundings, flags):
            rounding.active = flag

    @contextmanager
    def floating(self):
        """The weights read as they are inside the block (`training.qat_float_weight`'s float pass);
        each rounding's flag is restored after, and its cache kept."""
        flags = [rounding.active for rounding in self.roundings]
        self.set_active(False)
        try:
            yield
        finally:
            self.set_active(flags)

    @property
    def rounds(self) -> bool:
        """Whether the forward now sees any rounded weight."""
        return any(rounding.active for rounding in self.roundings)


class _Rounding:
    """One module's fake quantizer: its rounding function, an optional LoRA owner whose delta is
    merged first, and the cache (keyed by the version counters of what it reads)."""

    def __init__(self, rounding, owner=None):
        self.rounding = rounding
        self.owner = owner
        self.active = True
        self.key = None
        self.value = None

    def _delta(self):
        owner = self.owner
        if owner is None or getattr(owner, "merged", False) or getattr(owner, "disable_adapters", False):
            return None, ()
        names = [n for n in owner.active_adapters if n in owner.lora_A]
        if not names:
            return None, ()
        delta = sum(owner.get_delta_weight(n).float() for n in names)
        return delta, tuple(p._version for n in names for p in (owner.lora_A[n].weight, owner.lora_B[n].weight))

    def rounded(self, weight: torch.Tensor, read_weight=None) -> torch.Tensor:
        """The weight to use: fake-quantized (full), or the corrected base (LoRA); cached."""
        with torch.no_grad():
            delta, versions = self._delta()
            key = (weight._version, weight.data_ptr(), versions, delta is None)
            if self.key == key:
                return self.value
            base = (read_weight() if read_weight is not None else weight).float()
            merged = base if delta is None else base + delta
            quantized = self.rounding(merged)
            value = quantized if delta is None else quantized - delta
            self.key, self.value = None, None  # free the old copy before keeping the new one
            self.key, self.value = key, value.to(weight.dtype if read_weight is None else value.dtype)
            return self.value


def _weight_property(self):
    weight = self._parameters["weight"]
    rounding = self.__dict__.get("_qat_rounding")
    if rounding is None or not self.training or weight is None or not rounding.active:
        return weight
    value = rounding.rounded(weight)
    if rounding.owner is None and weight.requires_grad:
        return _StraightThrough.apply(weight, value)
    return value


_SUBCLASSES: dict[type, type] = {}


def _swap_class(module: torch.nn.Module, rounding: _Rounding) -> None:
    cls = type(module)
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Qat{cls.__name__}", (cls,), {"weight": property(_weight_property),
                                                                 "__module__": cls.__module__})
    module.__class__ = _SUBCLASSES[cls]
    module.__dict__["_qat_rounding"] = rounding


def _swap_4bit_forward(module: torch.nn.Module, rounding: _Rounding) -> None:
    """A bitsandbytes 4-bit base layer: dequantize, merge, round, matmul (training mode only)."""
    cls = type(module)

    def forward(self, x, *args, **kwargs):
        own = self.__dict__["_qat_rounding"]  # each layer's own (the subclass is shared by every layer of the class)
        if not self.training or not own.active:
            return cls.forward(self, x, *args, **kwargs)
        weight = self.weight
        value = own.rounded(weight, read_weight=lambda: base_weight(self))
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return torch.nn.functional.linear(x, value.to(x.dtype), bias)

    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Qat{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__})
    module.__class__ = _SUBCLASSES[cls]
    module.__dict__["_qat_rounding"] = rounding


def _is_lora_layer(module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "get_delta_weight")


def _quantized_modules(lm) -> list[tuple[str, torch.nn.Module, torch.nn.Module | None]]:
    """(path in the causal LM, the module holding the weight, its LoRA owner or None) for every
    linear and the embedding; LoRA layers are reported by their own path (as the export names them)."""
    found = []
    for path, module in lm.named_modules():
        if _is_lora_layer(module):
            found.append((path, module.get_base_layer(), module))
        elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and not path.endswith(".base_layer") \
                and ".lora_" not in path and not re.search(r"\.(modules_to_save|original_module)\b", path):
            found.append((path, module, None))
    return found


def _gguf_plan(lm, target: str, modules) -> dict[str, str]:
    """{module path: ggml type} for the matrices the GGUF file holds, as `ggml_types` picks them."""
    import gguf

    from maximus.export.gguf_arch import gguf_arch

    config = lm.config
    spec, arch = gguf_arch(config)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors, by_name = [], {}
    tied_head = bool(getattr(config, "tie_word_embeddings", False))
    for path, holder, _ in modules:
        if path == "lm_head" and tied_head and spec.head != "required":
            continue  # the file holds it once, as token_embd (handled with the embedding below)
        gguf_name = names.get_name(path + ".weight", try_suffixes=(".weight",))
        if gguf_name is None:
            continue
        layer = re.match(r"blk\.(\d+)\.", gguf_name)
        tensors.append(GGUFTensor(gguf_name, int(holder.weight.shape[-1]) if not hasattr(holder.weight, "quant_state")
                                  else int(holder.in_features), int(layer.group(1)) if layer else None))
        by_name[gguf_name] = path
    types = ggml_types(target, tensors, layers=config.num_hidden_layers)
    plan = {by_name[name]: kind for name, kind in types.items()}
    if tied_head and "lm_head" not in plan and "token_embd.weight" in types:
        plan["lm_head"] = types["token_embd.weight"]
    return plan


def gguf_rounding(ggml_type: str, fp16_first: bool):
    """The fake quantizer of one GGUF tensor type (float32 in, float32 out)."""
    def rounding(weight: torch.Tensor) -> torch.Tensor:
        if fp16_first:
            weight = weight.to(torch.float16).to(torch.float32)
        return fake_quantize(weight, ggml_type)

    return rounding


def int4_rounding(weight: torch.Tensor) -> torch.Tensor:
    """torchao's symmetric int4 fake quantization, groups of INT4_GROUP_SIZE along each row."""
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer

    quantizer = IntxFakeQuantizer(IntxFakeQuantizeConfig(torch.int4, group_size=INT4_GROUP_SIZE, is_symmetric=True))
    return quantizer(weight.float())


def install_qat(model, target: str, *, adapter: str = "merged") -> QatReport:
    """Fake-quantize `model`'s matrices for `target` (a `maximus.qat.targets.QAT_TARGETS` value)
    in training mode. `adapter` (`training.qat_adapter`): ``merged`` rounds each LoRA layer's
    merged weight, ``separate`` its base alone (a GGUF target only). Returns what was installed;
    the model's parameters are unchanged."""
    if adapter not in ("merged", "separate"):
        raise ValueError(f"adapter must be 'merged' or 'separate', not {adapter!r}")
    if adapter == "separate" and target not in GGUF_TARGETS:
        raise ValueError(f"adapter='separate' keeps the adapter beside a GGUF base file; {target} is not a GGUF target")
    from maximus.structure import causal_lm_of

    lm = causal_lm_of(model)
    modules = _quantized_modules(lm)
    report = QatReport(target)
    if target in GGUF_TARGETS:
        plan = _gguf_plan(lm, target, modules)
    else:  # int4: the decoder's linears (not the embedding, not the head)
        head = lm.get_output_embeddings()
        plan = {path: "int4" for path, holder, owner in modules
                if isinstance(holder, torch.nn.Linear) and (owner or holder) is not head
                and holder.weight.shape[-1] % INT4_GROUP_SIZE == 0}
    shared: dict[int, _Rounding] = {}
    for path, holder, owner in modules:
        kind = plan.get(path)
        if kind is None or kind == "f32":
            continue
        fn = int4_rounding if kind == "int4" else gguf_rounding(kind, rounds_to_fp16_first(target))
        weight = holder.weight
        # a tied head and embedding share one parameter: one cache for both
        rounding = shared.get(id(weight)) if owner is None else None
        if rounding is None:
            rounding = _Rounding(fn, owner if adapter == "merged" else None)
            report.roundings.append(rounding)
            if owner is None:
                shared[id(weight)] = rounding
            elif adapter == "separate":
                report.apart[path] = (holder, rounding)
            report.cache_bytes += weight.numel() * (4 if hasattr(weight, "quant_state") else weight.element_size())
        if hasattr(weight, "quant_state"):
            _swap_4bit_forward(holder, rounding)
        else:
            _swap_class(holder, rounding)
        report.types[path] = kind
    return report


class _Corrected:
    """A base weight's rounding plus its frozen low-rank correction: Q(W) + L R."""

    def __init__(self, rounding, left: torch.Tensor, right: torch.Tensor):
        self.inner, self.left, self.right = rounding, left, right

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        fix = self.left.to(weight.device, torch.float32) @ self.right.to(weight.device, torch.float32)
        return self.inner(weight) + fix


def apply_corrections(report: QatReport, factors: dict) -> None:
    """Each separate LoRA layer named in `factors` ({path: (L, R)}, `maximus.qat.correction`) reads
    its base as Q(W) + L R from now on (the cache is computed anew once); the factors stay where
    they are (the CPU), for the run's outputs (`corrections_of`)."""
    for path, (left, right) in factors.items():
        _, rounding = report.apart[path]
        rounding.rounding = _Corrected(rounding.rounding, left, right)
        rounding.key, rounding.value = None, None


def base_weight(holder: torch.nn.Module) -> torch.Tensor:
    """The weight a (frozen) base layer holds, as a tensor: a bitsandbytes 4-bit one dequantized."""
    weight = holder._parameters["weight"]
    with torch.no_grad():
        if hasattr(weight, "quant_state"):
            import bitsandbytes.functional as bnb_f

            return bnb_f.dequantize_4bit(weight.data, weight.quant_state)
        return weight.detach()


def corrections_of(model) -> dict:
    """{LoRA layer path in the causal LM: (L, R)} of the corrections `apply_corrections` installed."""
    from maximus.structure import causal_lm_of

    found = {}
    for path, module in causal_lm_of(model).named_modules():
        if _is_lora_layer(module):
            rounding = module.get_base_layer().__dict__.get("_qat_rounding")
            if rounding is not None and isinstance(rounding.rounding, _Corrected):
                found[path] = (rounding.rounding.left, rounding.rounding.right)
    return found


def fake_quantized_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The rounded weight `module` (a linear, embedding or PEFT LoRA layer) is trained against,
    exactly: the fake-quantized (merged) weight, or under ``adapter="separate"`` the rounded base
    alone (plus its correction, `apply_corrections`; the adapter adds to it in float), float32; None when QAT did not touch it. For checks."""
    holder = module.get_base_layer() if _is_lora_layer(module) else module
    rounding = holder.__dict__.get("_qat_rounding")
    if rounding is None:
        return None
    weight = base_weight(holder)
    with torch.no_grad():
        delta, _ = rounding._delta()
        merged = weight.float() if delta is None else weight.float() + delta
        return rounding.rounding(merged)
