"""The model families Maximus is tested on, and how a model's class is checked before loading.

`FAMILIES` is the tested matrix (tests/models/test_families.py builds a tiny random model of each
and docs/models.md shows what each cell proves). A causal LM outside it still loads and trains
through Transformers' own layers, with one notice (`untested_family_notice`): the planner's
figures for it were never checked against a measured run. A model with no causal-LM class (an
encoder, an encoder-decoder) is refused with one line that names its class and the nearest family.

Attention: Maximus asks for SDPA (and swaps it for its padding-free per-document SDPA when
packing). A class that Transformers gives no SDPA path, because its attention is not plain
softmax attention, gets its own eager attention instead, with a notice: SDPA could not compute
it, and forcing it would either fail or train a different model (Gemma 2's attention-logit
soft-cap). gpt-oss's attention sinks are the exception: one extra key per head computes them
exactly through SDPA (`maximus.attention.sink_attention`).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from maximus.errors import ModelError

__all__ = ["Family", "FAMILIES", "causal_lm_class", "check_causal_lm", "attention_implementation", "nearest_family",
           "is_mixture_of_experts", "untested_family_notice"]


@dataclass(frozen=True)
class Family:
    """One row of the tested matrix. `experts`: how a mixture-of-experts layer holds its experts:
    ``fused`` = 3-D parameters (one tensor for all experts), ``linears`` = one nn.Linear per
    expert, None = dense."""

    model_type: str
    name: str
    experts: str | None = None

    @property
    def moe(self) -> bool:
        return self.experts is not None


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "Llama"),
    Family("mistral", "Mistral"),
    Family("qwen2", "Qwen2"),
    Family("qwen3", "Qwen3"),
    Family("gemma2", "Gemma 2"),
    Family("gemma3_text", "Gemma 3 (text)"),
    Family("phi3", "Phi-3"),
    Family("olmo2", "OLMo 2"),
    Family("granite", "Granite"),
    Family("qwen3_moe", "Qwen3-MoE", experts="fused"),
    Family("mixtral", "Mixtral", experts="fused"),
    Family("gpt_oss", "gpt-oss", experts="fused"),
)}


def nearest_family(model_type: str) -> Family | None:
    """The tested family whose model type reads closest to `model_type` (None when none is close)."""
    match = difflib.get_close_matches(model_type, list(FAMILIES), n=1, cutoff=0.5)
    return FAMILIES[match[0]] if match else None


def _class_name(config: Any) -> str:
    names = getattr(config, "architectures", None) or []
    return names[0] if names else type(config).__name__.removesuffix("Config")


def causal_lm_class(config: Any):
    """The Transformers `*ForCausalLM` class `AutoModelForCausalLM` builds for `config`, or None
    (no such class; or the model brings its own code through `auto_map`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(config, "auto_map", None) and "AutoModelForCausalLM" in (config.auto_map or {}):
        return None
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def check_causal_lm(config: Any, source: str) -> None:
    """Raise a one-line ModelError unless `config` describes a decoder-only causal LM.

    The message names the model's class and the nearest tested family."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    remote = getattr(config, "auto_map", None) and "AutoModelForCausalLM" in (config.auto_map or {})
    if remote:
        return
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING and not getattr(config, "is_encoder_decoder", False):
        return
    model_type = str(getattr(config, "model_type", "") or "")
    near = nearest_family(model_type)
    tested = ", ".join(f.name for f in FAMILIES.values())
    hint = (f"the nearest supported family is {near.name} ({near.model_type}); " if near else "") + \
        f"Maximus trains decoder-only causal language models: {tested}"
    raise ModelError(f"cannot load model {source}: {_class_name(config)} (model type '{model_type}') is not a "
                     "causal language model Transformers' AutoModelForCausalLM can build", hint)


def untested_family_notice(config: Any) -> str | None:
    """The one notice for a model outside the tested families (`FAMILIES` and the vision-language
    ones, `maximus.vision.VISION_FAMILIES`), naming its family; None for a tested one."""
    from maximus.vision import VISION_FAMILIES

    model_type = str(getattr(config, "model_type", "") or "")
    if model_type in FAMILIES or model_type in VISION_FAMILIES:
        return None
    return (f"notice: {_class_name(config)} (model type '{model_type}') is outside the tested model families "
            "(docs/models.md): it trains through Transformers' own layers, and the planner's memory figures for it "
            "are not verified")


def attention_implementation(config: Any) -> tuple[str, str | None]:
    """(attn_implementation, notice or None): SDPA where the model's class has it; attention with
    learned sinks (gpt-oss) through SDPA with a sink key (`maximus.attention.sink_attention`, exact); else
    the class's own eager attention with a notice saying why."""
    from maximus.attention.sink_attention import IMPLEMENTATION, SINK_MODEL_TYPES, register_sink_attention

    cls = causal_lm_class(config)
    if cls is None or getattr(cls, "_supports_sdpa", True):
        return "sdpa", None
    if getattr(config, "model_type", None) in SINK_MODEL_TYPES:
        register_sink_attention()
        return IMPLEMENTATION, None
    return "eager", (f"notice: {cls.__name__} has no SDPA attention in Transformers (its attention is not plain "
                     "softmax attention); training with its own eager attention")


def is_mixture_of_experts(lm) -> bool:
    """Whether a Transformers causal LM routes tokens to experts (it has a router load-balancing loss)."""
    return hasattr(lm, "router_aux_loss_coef") and hasattr(lm, "num_experts_per_tok")
