"""Every private hook Maximus has into torch, Transformers, PEFT, TRL and torchao, with the versions
it was tested on, and a check that each one still resolves (and, where a changed meaning would go
unnoticed, still computes what we rely on).

The code that uses a hook falls back (with a notice) when it is gone, or would compute something
else without an error (a reordered positional argument of torchao's Adam step), so a new release
could break it quietly; `tests/structure/test_compat.py` runs `broken_hooks()` and fails naming
the hook instead. pyproject.toml bounds each library below its next minor release.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

#: Versions every hook below was tested on (the CI install).
TESTED_VERSIONS = {"torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2", "trl": "1.16.0",
                   "bitsandbytes": "0.50.2", "torchao": "0.18.0"}

#: TRL's fused LM head: `trl.trainer.utils.add_fused_lm_head` installs a nested forward by this
#: name whose closure holds these options (`maximus.hf_patch._trl_head_of` reads them).
TRL_FUSED_HEAD = "trl.trainer.utils.add_fused_lm_head"
TRL_FUSED_FORWARD_NAME = "_fused_forward"
TRL_FUSED_CLOSURE = frozenset({"outputs", "temperature", "cast_lm_head_to_fp32"})

#: Modeling modules whose global `apply_rotary_pos_emb` the Triton RoPE kernel routes
#: (`maximus.kernels.triton.install`), restored by `uninstall_triton_kernels`.
ROPE_MODELING_MODULES = ("transformers.models.llama.modeling_llama", "transformers.models.mistral.modeling_mistral",
                         "transformers.models.qwen2.modeling_qwen2")

#: PEFT LoRA-layer attributes the lean LoRA projection reads to decide it is plain LoRA
#: (`maximus.kernels.lean_lora.single_lora_adapter`, shared by the lean forward and the Triton 4-bit path).
PEFT_LORA_ATTRIBUTES = ("disable_adapters", "merged", "active_adapters", "lora_A", "lora_B", "use_dora",
                        "lora_dropout", "scaling", "lora_variant", "lora_bias", "cast_input_dtype_enabled",
                        "fan_in_fan_out", "get_base_layer")


#: torchao's per-tensor Adam update, called positionally by `maximus.train.optimizers` (its row
#: chunks): a release that reorders these would feed one argument as another, with no error.
TORCHAO_SINGLE_PARAM_ADAM = ("p", "grad", "step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "lr", "beta1", "beta2",
                             "weight_decay", "eps", "IS_ADAMW", "BF16_STOCHASTIC_ROUND")

#: PEFT ``ParamWrapper`` (LoRA on a parameter: PEFT ``target_parameters``) attributes the grouped
#: experts read (`maximus.kernels.grouped_experts._lora_factors` / `_unwrap`).
PEFT_PARAM_WRAPPER_ATTRIBUTES = ("disable_adapters", "merged", "active_adapters", "lora_A", "lora_B", "lora_bias",
                                 "scaling", "parameter_name", "num_experts", "base_layer")


#: bitsandbytes' `Linear4bit` flag: on a CPU with AVX512-BF16 the first forward in eval mode with an
#: input that needs no gradient repacks the 4-bit weight for an inference kernel (`gemv_4bit`) that
#: has no backward, and the layer keeps that layout: a later training step loses the frozen
#: layer's input gradient (measured: a QLoRA run's step-2 loss after the eval before training
#: 5.6749 against 5.4983 without it, tiny Llama, fp32). The streamer would also lose the layout
#: it refills. `keep_4bit_training_layout` turns it off.
BNB_CPU_REPACK_FLAG = "support_avx512bf16_for_cpu"


def keep_4bit_training_layout(model) -> None:
    """Keep every bitsandbytes 4-bit layer of `model` in the layout training reads (see
    `BNB_CPU_REPACK_FLAG`): for QLoRA training and streamed weights."""
    for module in model.modules():
        if hasattr(module, BNB_CPU_REPACK_FLAG):
            setattr(module, BNB_CPU_REPACK_FLAG, False)


def ddp_leave_out(module, names: list[str]) -> None:
    """Leave `module`'s parameters `names` out of DistributedDataParallel (its start-up broadcast
    and its one-device-type check), through torch's private static method for it."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def current_graph_task_id() -> int:
    """autograd's running graph task (-1 outside a backward pass); `maximus.kernels.tiled_mlp`."""
    import torch

    return torch._C._current_graph_task_id()


@dataclass(frozen=True)
class Hook:
    """One private hook: what it is, who uses it, and a check that raises when it no longer resolves."""

    name: str
    used_by: str
    check: Callable[[], None]


def _trl_fused_head() -> None:
    module, _, attr = TRL_FUSED_HEAD.rpartition(".")
    func = getattr(importlib.import_module(module), attr)
    nested = [c for c in func.__code__.co_consts if inspect.iscode(c) and c.co_name == TRL_FUSED_FORWARD_NAME]
    if not nested:
        raise LookupError(f"{TRL_FUSED_HEAD} no longer defines {TRL_FUSED_FORWARD_NAME}")
    missing = TRL_FUSED_CLOSURE - set(nested[0].co_freevars)
    if missing:
        raise LookupError(f"{TRL_FUSED_FORWARD_NAME}'s closure lacks {sorted(missing)}")


def _attn_implementation() -> None:
    from transformers import LlamaConfig

    if not hasattr(LlamaConfig(), "_attn_implementation"):
        raise LookupError("PretrainedConfig._attn_implementation is gone")


def _compiled_call_impl() -> None:
    import torch

    if not hasattr(torch.nn.Module, "_compiled_call_impl") or "_compiled_call_impl" not in inspect.getsource(
            torch.nn.Module.compile):
        raise LookupError("torch.nn.Module.compile no longer stores _compiled_call_impl")


def _rope_globals() -> None:
    for name in ROPE_MODELING_MODULES:
        if not callable(getattr(importlib.import_module(name), "apply_rotary_pos_emb", None)):
            raise LookupError(f"{name}.apply_rotary_pos_emb is gone")


def _graph_task_id() -> None:
    if current_graph_task_id() != -1:
        raise LookupError("torch._C._current_graph_task_id() is not -1 outside backward")


def _peft_lora_layer() -> None:
    import torch
    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear

    layer = Linear(torch.nn.Linear(4, 4), adapter_name="default", config=LoraConfig(r=2, lora_alpha=4), r=2,
                   lora_alpha=4)
    missing = [a for a in PEFT_LORA_ATTRIBUTES if not hasattr(layer, a)]
    if missing:
        raise LookupError(f"peft.tuners.lora.layer.Linear lacks {missing}")
    importlib.import_module("peft.tuners.lora.bnb").Linear4bit  # noqa: B018 - the 4-bit class the kernels route


def _processor_attributes() -> None:
    from transformers import Qwen2VLProcessor

    from maximus.vision import image_only_processor

    got = image_only_processor(Qwen2VLProcessor).get_attributes()
    if got != ["image_processor", "tokenizer"]:
        raise LookupError(f"ProcessorMixin.get_attributes() of a subclass without video_processor gives {got}")


def _torchao_optimizer() -> None:
    import torch
    from torchao.optim import AdamW4bit, AdamW8bit, _AdamW
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    got = tuple(inspect.signature(single_param_adam).parameters)
    if got != TORCHAO_SINGLE_PARAM_ADAM:
        raise LookupError(f"torchao.optim.adam.single_param_adam takes {got}, not {TORCHAO_SINGLE_PARAM_ADAM}")
    if list(OptimState4bit.tensor_attrs) != ["codes", "scale", "qmap"]:
        raise LookupError(f"OptimState4bit.tensor_attrs is {OptimState4bit.tensor_attrs}")
    for cls, params in ((OptimState4bit, ("codes", "scale", "qmap", "signed", "shape", "dtype")),
                        (OptimState8bit, ("codes", "scale", "qmap", "signed", "dtype"))):
        if tuple(inspect.signature(cls.__init__).parameters)[1:] != params:
            raise LookupError(f"{cls.__name__}({', '.join(inspect.signature(cls.__init__).parameters)})")
    p = torch.nn.Parameter(torch.zeros(32, 256))  # large enough for quantized moments (small ones stay float32)
    for cls, bits in ((AdamW4bit, 4), (AdamW8bit, 8), (_AdamW, None)):
        opt = cls([p], bf16_stochastic_round=True)
        missing = [a for a in ("_new_buffer", "bf16_stochastic_round", "is_adamw") if not hasattr(opt, a)]
        if missing:
            raise LookupError(f"torchao.optim.{cls.__name__} lacks {missing}")
        state = opt._new_buffer(p, True)
        if bits is not None:
            names, attrs = state.__tensor_flatten__()
            packed = p.numel() // 2 if bits == 4 else p.numel()
            if (names != ["codes", "scale", "qmap"] or attrs[0] is not True or state.codes.numel() != packed
                    or not hasattr(state, "block_size")):
                raise LookupError(f"torchao.optim.{cls.__name__}'s {bits}-bit moment is laid out otherwise")


def _torchao_stochastic_rounding() -> None:
    import torch
    from torchao.optim.quant_utils import _fp32_to_bf16_sr

    x = torch.full((64,), 1.0 + 2**-9)  # between the bf16 values 1 and 1 + 2**-7: rounded to one of them
    got = _fp32_to_bf16_sr(x)
    if got.dtype != torch.bfloat16 or not torch.isin(got.float(), torch.tensor([1.0, 1.0 + 2**-7])).all():
        raise LookupError("torchao.optim.quant_utils._fp32_to_bf16_sr no longer rounds float32 to a neighbouring bf16")


def _grouped_mm() -> None:
    import torch

    if not hasattr(torch, "_grouped_mm"):
        raise LookupError("torch._grouped_mm is gone (the grouped experts take the per-expert loop)")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 16, generator=g), torch.randn(2, 16, 8, generator=g)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    want = torch.cat([x[:2] @ w[0], x[2:] @ w[1]])
    if not torch.allclose(torch._grouped_mm(x, w, offs=offs), want, atol=1e-5):
        raise LookupError("torch._grouped_mm(x, w, offs=row ends) no longer multiplies each group by its matrix")


def _python_dispatch() -> None:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily
    from torch.utils._pytree import tree_leaves

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    if _get_current_dispatch_mode() is not None:
        raise LookupError("_get_current_dispatch_mode() is not None outside any mode")
    with Seen() as mode:
        if _get_current_dispatch_mode() is not mode:
            raise LookupError("_get_current_dispatch_mode() does not return the mode in force")
        with _pop_mode_temporarily():
            torch.ones(1)
    if tree_leaves(((1, [2]), {"a": 3})) != [1, 2, 3]:
        raise LookupError("torch.utils._pytree.tree_leaves flattens otherwise")


def _torch_internals() -> None:
    import torch

    torch._dynamo.utils.disable_cache_limit  # noqa: B018 - the optimizer step's compile
    torch.ops.aten._softmax.out  # noqa: B018 - the chunked loss writes its softmax over the logits
    if not isinstance(torch.ops.mkldnn._is_mkldnn_bf16_supported(), bool):
        raise LookupError("torch.ops.mkldnn._is_mkldnn_bf16_supported() is not a bool")
    t = torch.zeros(2)
    before = t._version
    t.add_(1)
    if t._version == before:
        raise LookupError("Tensor._version does not count in-place writes")


def _tiny_experts():
    from transformers import GptOssConfig, MixtralConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    mixtral = MixtralExperts(MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=2,
                                           num_experts_per_tok=1))
    gpt_oss = GptOssExperts(GptOssConfig(hidden_size=16, intermediate_size=32, num_local_experts=2,
                                         num_experts_per_tok=1, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=8))
    return mixtral, gpt_oss


def _experts_layout() -> None:
    import torch
    from transformers.integrations.moe import _default_apply_gate

    from maximus.kernels.grouped_experts import _ClampedSwiGLU

    mixtral, gpt_oss = _tiny_experts()
    for experts, transposed, bias in ((mixtral, False, False), (gpt_oss, True, True)):
        if (getattr(experts, "is_transposed", None), getattr(experts, "has_bias", None)) != (transposed, bias):
            raise LookupError(f"{type(experts).__name__} no longer says is_transposed={transposed}, has_bias={bias}")
    if type(mixtral)._apply_gate is not _default_apply_gate:
        raise LookupError("MixtralExperts._apply_gate is not transformers.integrations.moe._default_apply_gate")
    gate_up = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * 4
    ours = _ClampedSwiGLU.apply(gate_up, float(gpt_oss.alpha), float(gpt_oss.limit), None)
    if not torch.allclose(gpt_oss._apply_gate(gate_up), ours, atol=1e-6):
        raise LookupError("GptOssExperts._apply_gate no longer computes the clamped SwiGLU of interleaved columns")


def _peft_param_wrapper() -> None:
    import torch
    from peft import LoraConfig
    from peft.tuners.lora.layer import ParamWrapper

    from maximus.kernels.grouped_experts import _lora_factors

    mixtral, _ = _tiny_experts()
    wrapper = ParamWrapper(mixtral, adapter_name="default", parameter_name="gate_up_proj", r=2, lora_alpha=4,
                           config=LoraConfig(r=2, lora_alpha=4, target_parameters=["gate_up_proj"]))
    missing = [a for a in PEFT_PARAM_WRAPPER_ATTRIBUTES if not hasattr(wrapper, a)]
    if missing:
        raise LookupError(f"peft.tuners.lora.layer.ParamWrapper lacks {missing}")
    torch.nn.init.normal_(wrapper.lora_B["default"].weight, generator=torch.Generator().manual_seed(0))
    a, b, scaling = _lora_factors(wrapper)
    if not torch.allclose(wrapper.get_delta_weight("default"), scaling * torch.einsum("eor,eri->eoi", b, a), atol=1e-6):
        raise LookupError("ParamWrapper's lora_A / lora_B are no longer laid out expert-major / rank-major")


def _attention_backend_flags() -> None:
    from transformers import LlamaForCausalLM

    for flag in ("_supports_attention_backend", "_supports_sdpa"):
        if getattr(LlamaForCausalLM, flag, None) is not True:
            raise LookupError(f"PreTrainedModel.{flag} is not True for Llama")


def _ddp_leave_out() -> None:
    from torch.nn.parallel import DistributedDataParallel

    if not callable(getattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None)):
        raise LookupError("DistributedDataParallel._set_params_and_buffers_to_ignore_for_model is gone")


def _bnb_cpu_repack_flag() -> None:
    import bitsandbytes as bnb

    if not hasattr(bnb.nn.Linear4bit(64, 64, quant_type="nf4"), BNB_CPU_REPACK_FLAG):
        raise LookupError(f"bitsandbytes.nn.Linear4bit no longer has {BNB_CPU_REPACK_FLAG}")


HOOKS = (
    Hook("DistributedDataParallel._set_params_and_buffers_to_ignore_for_model", "maximus.train.distributed (DDP)",
         _ddp_leave_out),
    Hook("bitsandbytes.nn.Linear4bit.support_avx512bf16_for_cpu (the CPU inference repack)",
         "maximus.models.load_model (QLoRA training), maximus.memory.weight_streaming", _bnb_cpu_repack_flag),
    Hook("trl.trainer.utils.add_fused_lm_head: _fused_forward and its closure names", "maximus.hf_patch", _trl_fused_head),
    Hook("PretrainedConfig._attn_implementation", "maximus.hf_patch (patch / unpatch)", _attn_implementation),
    Hook("torch.nn.Module._compiled_call_impl", "maximus.hf_patch.unpatch (regional compilation)", _compiled_call_impl),
    Hook("apply_rotary_pos_emb in Transformers' Llama / Mistral / Qwen2 modeling modules",
         "maximus.kernels.triton.install", _rope_globals),
    Hook("torch._C._current_graph_task_id", "maximus.kernels.tiled_mlp", _graph_task_id),
    Hook("PEFT LoRA layer internals (peft.tuners.lora.layer.Linear, bnb.Linear4bit)",
         "maximus.kernels.lean_lora, maximus.kernels.triton.install", _peft_lora_layer),
    Hook("ProcessorMixin takes its sub-processors from the __init__ signature (a processor without its video "
         "processor)", "maximus.vision.image_only_processor (Qwen2-VL / Qwen2.5-VL without torchvision)",
         _processor_attributes),
    Hook("torchao's private optimizer parts (single_param_adam called positionally, _AdamW, AdamW4bit / AdamW8bit "
         "._new_buffer, OptimState4bit / OptimState8bit)", "maximus.train.optimizers (adamw_4bit, adamw_8bit_torchao, "
         "bf16 weights)", _torchao_optimizer),
    Hook("torchao.optim.quant_utils._fp32_to_bf16_sr", "maximus.train.optimizers (bf16 weights in the backward)",
         _torchao_stochastic_rounding),
    Hook("torch._grouped_mm", "maximus.kernels.grouped_experts (without it: the per-expert loop, slower)", _grouped_mm),
    Hook("torch.utils._python_dispatch (TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily) and "
         "torch.utils._pytree.tree_leaves", "maximus.memory.meter, maximus.memory.checkpointing, "
         "maximus.train.optimizers", _python_dispatch),
    Hook("torch._dynamo.utils.disable_cache_limit, aten._softmax.out, mkldnn._is_mkldnn_bf16_supported, "
         "Tensor._version", "maximus.train.optimizers, maximus.losses.linear_cross_entropy, maximus.device, "
         "maximus.attention (varlen, sinks)", _torch_internals),
    Hook("Transformers' fused experts (is_transposed, has_bias, _apply_gate: _default_apply_gate, gpt-oss's "
         "clamped SwiGLU)", "maximus.kernels.grouped_experts", _experts_layout),
    Hook("PEFT ParamWrapper internals (lora_A / lora_B layout, num_experts, parameter_name, base_layer)",
         "maximus.kernels.grouped_experts", _peft_param_wrapper),
    Hook("PreTrainedModel._supports_attention_backend / _supports_sdpa", "maximus.attention (install, varlen), "
         "maximus.families", _attention_backend_flags),
)


def broken_hooks() -> list[str]:
    """'hook: why' for each hook that no longer resolves with the installed libraries."""
    broken = []
    for hook in HOOKS:
        try:
            hook.check()
        except Exception as exc:  # any failure to resolve is the finding
            broken.append(f"{hook.name} (used by {hook.used_by}): {exc}")
    return broken
