"""Load Hugging Face causal LMs and apply what the config asks for.

Order matters and is fixed here: resolve device and dtype -> load (4-bit NF4 for QLoRA) ->
attention swap (Kronecker sketching) -> PEFT adapter (LoRA / DoRA, or an existing adapter) ->
trainable-parameter dtypes. Gradient checkpointing and offload are applied by the trainer, which
knows the plan.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch

from maximus.compat import keep_4bit_training_layout
from maximus.config import Config
from maximus.errors import ConfigError, ModelError
from maximus.gguf_base import gguf_location, is_gguf, metadata_read_once, shared_tensor_name_maps
from maximus.model_source import ModelSource, resolve_source
from maximus.structure import causal_lm_of
from maximus.vision import adapter_targets, freeze_for_full
from maximus.vision import auto_model_class as vision_auto_model_class
from maximus.device import resolve_dtype

def resolve_device(name: str = "auto") -> torch.device:
    """`auto` = cuda, then mps, then cpu. Under torchrun each rank takes its LOCAL_RANK GPU."""
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            name = "mps"
        else:
            name = "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ModelError("device: cuda was requested but no CUDA GPU is available", "set device: auto or cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ModelError("device: mps was requested but MPS is not available", "set device: auto or cpu")
    return torch.device(name)


def load_tokenizer(cfg: Config, source: ModelSource | None = None):
    """The run's tokenizer: `tokenizer:` when the config names one, else the model's own (from
    `source`, resolved here when not given; a GGUF file's is the vocabulary stored in it)."""
    from transformers import AutoTokenizer

    if cfg.tokenizer:
        where, kwargs = cfg.tokenizer, {}
        if is_gguf(cfg.tokenizer):  # the vocabulary stored in the GGUF file itself
            where, kwargs["gguf_file"] = gguf_location(cfg.tokenizer)
    else:
        source = source or resolve_source(cfg)
        where, kwargs = source.pretrained_args()
        kwargs.pop("use_safetensors", None)
    shown = cfg.tokenizer or (source.name if source else cfg.model)
    try:
        if "gguf_file" in kwargs:
            with metadata_read_once():
                tok = AutoTokenizer.from_pretrained(where, gguf_file=kwargs["gguf_file"],
                                                    trust_remote_code=cfg.trust_remote_code)
        else:
            tok = AutoTokenizer.from_pretrained(where, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load tokenizer from {shown}: {str(exc).splitlines()[0]}",
                         "set `tokenizer:` to a directory or hub id with a tokenizer") from None
    if tok.pad_token_id is None:
        if tok.eos_token is not None:
            tok.pad_token = tok.eos_token
        else:
            raise ModelError(f"tokenizer {shown} has neither a pad nor an eos token", "use a tokenizer with an eos token")
    tok.padding_side = "right"
    return tok


def _quantization_config(dtype: torch.dtype, skip_modules: tuple[str, ...] | None = None):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=torch.uint8,
                              llm_int8_skip_modules=list(skip_modules) if skip_modules is not None else None)


def load_base_model(cfg: Config, device: torch.device, dtype: torch.dtype, method: str | None = None,
                    weight_store=None, *, source: ModelSource | None = None):
    """The plain Transformers model: full precision master weights for full fine-tuning, the compute
    dtype for a frozen LoRA base, NF4 for QLoRA.

    `source`: the model's resolved source (`maximus.model_source`), resolved here when not given.

    `weight_store` (``optimization.offload.params``): a QLoRA base in a local safetensors directory
    loads one layer at a time into it, never whole on the device (`maximus.layerwise_load`).

    `model:` may be a GGUF file: Transformers dequantizes its weights to `dtype` (`maximus.gguf_base`).
    Attention is SDPA where the class has it, else the class's own (with a notice,
    `maximus.families.attention_implementation`)."""
    import sys

    from maximus.families import attention_implementation

    method = method or cfg.method
    source = source or resolve_source(cfg)
    where, kwargs = source.pretrained_args()
    if method == "full":
        # Master weights in fp32 when training in reduced precision: bf16 updates lose small steps,
        # unless each update is rounded stochastically (training.master_weights: bf16).
        kwargs["dtype"] = torch.bfloat16 if cfg.training.master_weights == "bf16" else torch.float32
    elif method == "qlora":
        kwargs["dtype"] = dtype
        kwargs["quantization_config"] = _quantization_config(dtype, source.nf4_skip_modules)
        kwargs["device_map"] = {"": device}
    else:
        kwargs["dtype"] = dtype
    attention, notice = attention_implementation(source.config)
    if notice:
        print(notice, file=sys.stderr)
    kwargs["attn_implementation"] = attention
    if method == "qlora" and weight_store is not None and source.layerwise_directory is not None and not source.vision:
        from maximus.layerwise_load import load_layerwise_qlora

        model = load_layerwise_qlora(source.layerwise_directory, source.fresh_config(), device=device, dtype=dtype,
                                     attention=attention, trust_remote_code=source.trust_remote_code,
                                     store=weight_store)
        if model is not None:
            return model
    model = _from_pretrained(source, where, kwargs)
    if method != "qlora":
        model.to(device)
    model.config.use_cache = False
    return model


def _from_pretrained(source: ModelSource, where: str, kwargs: dict):
    """Transformers' `from_pretrained` of `source` with `kwargs`: the causal-LM or vision class,
    a GGUF file's metadata parsed once; its errors as one-line ModelErrors."""
    from transformers import AutoModelForCausalLM

    try:
        if source.kind == "gguf" and "quantization_config" in kwargs:
            return _gguf_as_nf4(where, kwargs)
        if source.kind == "gguf":
            with shared_tensor_name_maps(), metadata_read_once():
                return _as_dense(AutoModelForCausalLM.from_pretrained(where, **kwargs))
        auto = vision_auto_model_class() if source.vision else AutoModelForCausalLM
        return auto.from_pretrained(where, **kwargs)
    except OSError as exc:
        first = str(exc).splitlines()[0]
        raise ModelError(f"cannot load model {source.name}: {first}",
                         "check the id or path; hub models need network access (or a local copy)") from None
    except ValueError as exc:
        hint = ("set trust_remote_code: true only if you trust its code" if "trust_remote_code" in str(exc)
                else "Transformers refused the model's files; check that they match its config.json")
        raise ModelError(f"cannot load model {source.name}: {str(exc).splitlines()[0]}", hint) from None


def _as_dense(model):
    """A model Transformers dequantized from a GGUF file, without the marks of its GGUF quantizer:
    its weights are plain dense tensors, and the marks would make `save_pretrained` refuse it (a full
    fine-tune's final weights, the NF4 round trip below)."""
    model.hf_quantizer = None
    for config in (model.config, getattr(model.config, "text_config", None)):
        if config is not None and hasattr(config, "quantization_config"):
            del config.quantization_config
    return model


def _gguf_as_nf4(directory: str, kwargs: dict):
    """QLoRA on a GGUF base. Transformers does not quantize while it dequantizes a GGUF file, so
    the dequantized model is written once to a temporary safetensors directory (as large as the
    model at the compute dtype) and loaded from there in NF4; the directory is removed after."""
    import tempfile

    from transformers import AutoModelForCausalLM

    dense = {k: v for k, v in kwargs.items() if k not in ("quantization_config", "device_map")}
    with shared_tensor_name_maps(), metadata_read_once():
        model = _as_dense(AutoModelForCausalLM.from_pretrained(directory, **dense))
    with tempfile.TemporaryDirectory(prefix="maximus-gguf-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        del model
        nf4 = {k: v for k, v in kwargs.items() if k != "gguf_file"}
        return AutoModelForCausalLM.from_pretrained(tmp, use_safetensors=True, **nf4)


#: `lora.*` keys that fix an adapter's shape, and the LoraConfig field each one is saved as.
_ADAPTER_SHAPE_KEYS = {"r": "r", "alpha": "lora_alpha", "target_modules": "target_modules",
                       "use_dora": "use_dora", "use_rslora": "use_rslora"}


def _targeted_linears(model, spec) -> set[str]:
    """Qualified names of the linear layers a LoRA `target_modules` spec selects, by PEFT's rules
    (see `_select`); the output head is never one."""
    head = causal_lm_of(model).get_output_embeddings()
    return _select({name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head},
                   spec)


def _select(names: set[str], spec) -> set[str]:
    """Those of `names` a LoRA `target_modules` spec selects: `all-linear` = all of them, another
    string = a full regex match, a list = names equal to an entry or ending in `.entry`."""
    import re

    if spec == "all-linear":
        return set(names)
    if isinstance(spec, str):
        return {n for n in names if re.fullmatch(spec, n)}
    return {n for n in names if any(n == t or n.endswith("." + t) for t in spec)}


def expert_parameters(model) -> list[str]:
    """Names (leaf) of the fused 3-D expert weights of a mixture of experts (`[experts, out, in]`
    tensors inside a module whose path has `experts`), e.g. gate_up_proj, down_proj; [] for a dense model."""
    return sorted({name.rsplit(".", 1)[-1] for name, p in model.named_parameters()
                   if p.dim() == 3 and ".experts." in f".{name}"})


def _routers(model) -> set[str]:
    """Qualified names of the router modules of a mixture of experts (and everything inside them)."""
    roots = [name for name, m in model.named_modules() if type(m).__name__.endswith("Router")]
    return {name for name, _ in model.named_modules() if any(name == r or name.startswith(r + ".") for r in roots)}


class LoraTargets(NamedTuple):
    """What `lora_targets` resolves: PEFT's `target_modules` and `target_parameters`, and the
    qualified names of the linears `modules` selects (by PEFT's rules)."""

    modules: str | list[str]
    parameters: list[str]
    linears: set[str]


def lora_targets(model, cfg: Config) -> LoraTargets:
    """The LoRA adapter's targets (`LoraTargets`).

    A dense model: `lora.target_modules` as written (PEFT resolves `all-linear`). A mixture of
    experts: the linears are resolved here, without the router (it stays frozen); the experts are
    reached when `lora.experts` is true, or unset with `all-linear`: per-expert linears by name,
    fused 3-D expert weights through PEFT's `target_parameters`.

    Raises:
        ConfigError: `lora.experts: true` on a dense model.
    """
    from maximus.families import is_mixture_of_experts
    from maximus.memory.spec_from_config import lora_reaches_experts

    spec, experts = cfg.lora.target_modules, cfg.lora.experts
    linears = _targeted_linears(model, "all-linear")
    if not is_mixture_of_experts(causal_lm_of(model)):
        if experts:
            raise ConfigError(f"lora.experts: true, but {type(causal_lm_of(model)).__name__} is not a mixture of experts",
                              "drop lora.experts (it applies to mixture-of-experts models only)")
        return LoraTargets(spec, [], _select(linears, spec))
    with_experts = lora_reaches_experts(cfg)
    routers = _routers(model)
    names = {n for n in _select(linears, spec) if n not in routers}
    if not with_experts:
        names = {n for n in names if ".experts." not in f".{n}."}
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    return LoraTargets(leaves, expert_parameters(model) if with_experts else [], _select(linears, leaves))


def init_adapter_config(model, cfg: Config):
    """The saved LoraConfig of `cfg.init_adapter`, with the config's trainable settings applied.

    The adapter keeps the shape it was trained with: a shape key (`lora.r`, `alpha`,
    `target_modules`, `use_dora`, `use_rslora`) written in the config must match it. `lora.dropout`
    written in the config replaces the saved dropout (`apply_adapter` adds `lora.modules_to_save`
    and the Kronecker sketches to the adapter's own). Keys not written in the config come from the
    adapter.

    Raises:
        ModelError: no PEFT LoRA adapter at the path.
        ConfigError: a shape key written in the config differs from the adapter's.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftConfig

    path = Path(cfg.init_adapter)
    if not (path / "adapter_config.json").is_file():
        raise ModelError(f"init_adapter: no PEFT adapter at {path} (adapter_config.json missing)",
                         "point it at a run's adapter/ directory")
    saved = PeftConfig.from_pretrained(str(path))
    if not isinstance(saved, PeftLoraConfig):
        raise ModelError(f"init_adapter: {path} holds a {saved.peft_type} adapter, not LoRA",
                         "point it at an adapter written by Maximus or PEFT's LoraConfig")
    written = cfg.lora.model_fields_set
    for key, attr in _ADAPTER_SHAPE_KEYS.items():
        if key not in written:
            continue
        want, have = getattr(cfg.lora, key), getattr(saved, attr)
        if key == "target_modules":
            targeted = _targeted_linears(model, have)
            same = _targeted_linears(model, want) == targeted
            have = sorted({n.rsplit(".", 1)[-1] for n in targeted})
        else:
            same = want == have
        if not same:
            raise ConfigError(f"lora.{key}: {want} differs from the init_adapter {path} ({attr}: {have})",
                              f"an adapter keeps the shape it was trained with: drop lora.{key}, "
                              "or train a new adapter without init_adapter")
    if "dropout" in written:
        saved.lora_dropout = cfg.lora.dropout
    saved.inference_mode = False
    return saved


def _train_more_modules(peft_model, names: list[str]) -> None:
    """Wrap `names` (not in the loaded adapter) in PEFT's ModulesToSaveWrapper: trained in full and
    saved with the adapter from now on. The adapter's own copies are left as loaded."""
    import copy

    from peft.utils import set_additional_trainable_modules

    config = peft_model.peft_config["default"]
    new = [n for n in names if n not in (config.modules_to_save or [])]
    if not new:
        return
    only_new = copy.copy(config)
    only_new.modules_to_save = new
    set_additional_trainable_modules(model=peft_model.base_model, peft_config=only_new, model_config=None,
                                     adapter_name="default")
    config.modules_to_save = list(config.modules_to_save or []) + new


def apply_adapter(model, cfg: Config, method: str, extra_modules_to_save: list[str] | None = None, *,
                  vision: bool = False):
    """Wrap the base in a PEFT adapter (LoRA / DoRA / rsLoRA), or load `init_adapter` trainable
    (with the config's dropout and modules_to_save, see `init_adapter_config`). `vision`: the base
    is a vision-language model (`ModelSource.vision`)."""
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

    if method == "qlora":
        # PEFT's recipe: norms and other small params to fp32, input grads on. Checkpointing is ours.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if cfg.init_adapter:
        config = init_adapter_config(model, cfg)
        peft_model = PeftModel.from_pretrained(model, cfg.init_adapter, is_trainable=True, config=config)
        _train_more_modules(peft_model, list(cfg.lora.modules_to_save) + list(extra_modules_to_save or []))
        return peft_model
    targets, parameters, wanted = lora_targets(model, cfg)
    modules_to_save = list(cfg.lora.modules_to_save) + list(extra_modules_to_save or [])
    if vision:  # the language model only, unless lora.vision / lora.projector
        targets, more = adapter_targets(model, cfg.lora, wanted)
        wanted = _select(wanted, targets)
        modules_to_save += more
    lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=targets, target_parameters=parameters or None, use_dora=cfg.lora.use_dora,
                      use_rslora=cfg.lora.use_rslora, modules_to_save=modules_to_save or None,
                      task_type="CAUSAL_LM", bias="none")
    from maximus.families import is_mixture_of_experts

    moe = is_mixture_of_experts(causal_lm_of(model))
    try:
        peft_model = get_peft_model(model, lora)
    except ValueError as exc:
        raise ModelError(f"lora.target_modules: {str(exc).splitlines()[0]}",
                         "use all-linear or names of linear layers such as q_proj, v_proj") from None
    if moe:
        _check_moe_targets(peft_model, wanted)
    return peft_model


def _check_moe_targets(peft_model, wanted: set[str]) -> None:
    """PEFT (0.21) rewrites a mixture of experts' LoRA targets for models whose experts Transformers
    v5 fused (Qwen2/3-MoE, Mixtral): every target named like a pre-fusion expert projection
    (`gate_proj`, `up_proj`, `down_proj`, `w1`..`w3`) becomes the fused expert weights. A linear of
    that name outside the experts (Qwen3-MoE's dense `mlp_only_layers`) then gets no adapter, and
    `lora.experts: false` would still train the experts: refused by name rather than trained wrong.

    Raises:
        ModelError: a targeted linear that got no adapter.
    """
    import peft

    prefix = "base_model.model."
    adapted = {name.removeprefix(prefix).removesuffix(".base_layer")
               for name, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    cls = type(causal_lm_of(peft_model)).__name__
    missing = sorted(wanted - adapted)
    if missing:
        leaves = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in missing}))
        raise ModelError(f"lora.target_modules: PEFT {peft.__version__} maps {leaves} of {cls} to its fused experts, "
                         f"so {len(missing)} linears outside the experts would train no adapter ({missing[0]}, ...)",
                         f"leave {leaves} out of lora.target_modules (e.g. [q_proj, k_proj, v_proj, o_proj], "
                         "with lora.experts: true to train the experts)")


def merge_init_adapter(model, cfg: Config):
    """`method: full` from `init_adapter`: the adapter merged into the base weights, all of them
    then trained (the adapter's modules_to_save copies replace their modules)."""
    from peft import PeftModel

    config = init_adapter_config(model, cfg)
    return PeftModel.from_pretrained(model, cfg.init_adapter, config=config).merge_and_unload()


def load_model(cfg: Config, *, device: torch.device | None = None, method: str | None = None, for_training: bool = True,
               tokenizer=None, weight_store=None, source: ModelSource | None = None):
    """Load `(model, tokenizer)` with quantization, attention swap and adapters applied.

    `source`: the model's resolved source (`maximus.model_source.resolve_source`), resolved here
    once when not given.

    `weight_store`: where streamed layers live (`load_base_model`; the trainer's, with
    ``optimization.offload.params``).

    `method` overrides `cfg.method` (the planner resolves `auto`). `init_adapter` is loaded
    trainable for LoRA / QLoRA and merged into the base for `method: full`.
    Raises ModelError for a missing model, pickle-only weights, bad target modules or a bad init
    adapter; ConfigError for a `lora.*` shape key that contradicts the init adapter.
    """
    from maximus.builtin import resolve

    cfg = resolve(cfg)
    device = device or resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.training.dtype, device)
    method = method or (cfg.method if cfg.method != "auto" else "lora")
    source = source or resolve_source(cfg)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg, source)
    model = load_base_model(cfg, device, dtype, method, weight_store=weight_store, source=source)
    extra: list[str] = []
    if cfg.optimization.kronecker is not None:
        from maximus.attention import install_kronecker, kronecker_module_names

        model = install_kronecker(model, cfg.optimization.kronecker)
        extra = kronecker_module_names(model)
    if method in ("lora", "qlora"):
        model = apply_adapter(model, cfg, method, extra, vision=source.vision)
        if method == "qlora" and for_training:  # an eval forward must not switch it to a layout without backward
            keep_4bit_training_layout(model)
        if method == "qlora" and dtype != torch.float32:
            # prepare_model_for_kbit_training upcasts every non-quantized weight to fp32. The frozen
            # embedding and head do not need it (an fp32 head costs a cast per step). Under bf16 the
            # frozen norms go back too (fp16 keeps them fp32, the safeguard they are upcast for):
            # fp32 norm weights turn the whole residual stream fp32 (RMSNorm returns weight * x), so
            # every projection casts its input. The norms still compute in fp32 inside; measured
            # 2-7 % faster per step on the reference model (`speed_parts.py norms`), same step-1 loss to 1e-5.
            lm = causal_lm_of(model)
            frozen = [m for m in (lm.get_input_embeddings(), lm.get_output_embeddings()) if m is not None]
            params = [p for m in frozen for p in m.parameters()]
            if dtype == torch.bfloat16:
                params = list(model.parameters())
            for p in params:
                if not p.requires_grad and p.dtype == torch.float32:
                    p.data = p.data.to(dtype)
        if dtype != torch.float32:
            # Adapters train in fp32 (PEFT's default autocast_adapter_dtype); the frozen base stays in dtype.
            for p in model.parameters():
                if p.requires_grad and p.dtype != torch.float32:
                    p.data = p.data.float()
    else:
        if cfg.init_adapter:
            model = merge_init_adapter(model, cfg)
        model.requires_grad_(True)
        if source.vision:
            freeze_for_full(model, cfg.lora)
    if not for_training:
        model.eval()
    return model, tokenizer


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit packed weights count as their logical size."""
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        if getattr(p, "quant_state", None) is not None or p.__class__.__name__ == "Params4bit":
            n *= 2
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total
