"""Every private hook Maximus has into torch, Transformers, PEFT and TRL, with the versions it was
tested on, and a check that each one still resolves.

The code that uses a hook falls back (with a notice) when it is gone, so a new release could break
it quietly; `tests/structure/test_compat.py` runs `broken_hooks()` and fails naming the hook
instead. pyproject.toml bounds each library below its next minor release.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

#: Versions every hook below was tested on (the CI install).
TESTED_VERSIONS = {"torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2", "trl": "1.16.0",
                   "bitsandbytes": "0.50.2"}

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


HOOKS = (
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
