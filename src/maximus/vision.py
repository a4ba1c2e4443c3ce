"""Vision-language models: which models are, where their parts are, what the adapter trains.

A vision-language model (VLM) is a Transformers `*ForConditionalGeneration` whose config has a
`vision_config`: a vision tower (CLIP / SigLIP / Qwen2-VL's ViT) encodes the image into patch
features, a projector maps them into the language model's embedding space, and those features
replace the image placeholder tokens of the prompt. Tested classes: LLaVA (CLIP + Llama),
Idefics3 / SmolVLM, Gemma 3, Qwen2-VL and Qwen2.5-VL (`VISION_FAMILIES`).

What trains by default: LoRA on the language model's linears only; the tower and the projector
are frozen (a frozen tower keeps no activations for backward: its output needs no gradient).
`lora.vision: true` adds LoRA to the tower's linears, `lora.projector: true` trains the
projector in full (saved with the adapter as a PEFT `modules_to_save`). The adapter's target
names are qualified, so it loads in PEFT on the same Transformers class.

Raises ModelError (one line) for a model whose directory has no processor.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from maximus.errors import ModelError

#: model_type -> family name, for docs and messages.
VISION_FAMILIES = {"llava": "LLaVA", "idefics3": "Idefics3 / SmolVLM", "smolvlm": "SmolVLM", "gemma3": "Gemma 3",
                   "qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL"}

#: Module names of the vision tower and of the projector, by family (the projector of Qwen2-VL,
#: `merger`, sits inside its tower `visual`).
TOWER_NAMES = ("vision_tower", "visual", "vision_model")
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "merger")

#: Batch keys that carry images into the model's forward (`maximus.data.vision.collate_vision`).
MEDIA_KEYS = ("pixel_values", "pixel_attention_mask", "image_grid_thw", "image_sizes", "token_type_ids",
              "mm_token_type_ids")


def is_vision_config(config) -> bool:
    """Whether a Transformers config (or its config.json dict) describes a vision-language model."""
    if isinstance(config, dict):
        return "vision_config" in config
    return getattr(config, "vision_config", None) is not None


def model_is_vision(model_source: str, trust_remote_code: bool = False) -> bool:
    """Whether `model:` is a VLM: read from config.json of a local directory, else from the hub config."""
    path = Path(model_source).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        try:
            return is_vision_config(json.loads((path / "config.json").read_text()))
        except (OSError, ValueError):
            return False
    if path.suffix == ".gguf" or path.exists():
        return False
    try:
        from transformers import AutoConfig

        return is_vision_config(AutoConfig.from_pretrained(model_source, trust_remote_code=trust_remote_code))
    except Exception:  # no network, not a model: the causal-LM path reports it
        return False


def load_processor(source: str, trust_remote_code: bool = False):
    """The model's Transformers processor (tokenizer + image processor), built without torchvision
    (Transformers' PIL image processors): a processor whose video processor needs torchvision
    (Qwen2-VL, Qwen2.5-VL) is built from its image processor and tokenizer alone
    (`image_only_processor`). Raises ModelError when the model has none."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        videos = any(word in str(exc).lower() for word in ("torchvision", "video processor"))
        processor = _without_video(source, trust_remote_code) if videos else None
        if processor is None:
            raise ModelError(f"cannot load the image processor of {source}: {first}",
                             "save the processor next to the model (processor.save_pretrained(model_dir))") from None
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        raise ModelError(f"model {source} has no image processor ({type(processor).__name__}): its architecture "
                         "cannot be fed images", "save the model's processor (tokenizer and image processor) "
                         "with save_pretrained next to the weights")
    tok = processor.tokenizer
    if tok.pad_token_id is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return processor


def image_only_processor(processor_cls):
    """`processor_cls` (a Transformers processor whose `__init__` takes a `video_processor`) with
    the video processor left out: Transformers' ProcessorMixin takes its sub-processors from the
    `__init__` signature, so a subclass without the argument builds, saves and applies its chat
    template with the image processor and tokenizer only (videos are not supported)."""

    class ImageOnly(processor_cls):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    ImageOnly.__name__ = ImageOnly.__qualname__ = processor_cls.__name__
    return ImageOnly


def _without_video(source: str, trust_remote_code: bool):
    """The processor of `source` built without its video processor (`image_only_processor`), or
    None when its class has no video processor to leave out."""
    import inspect

    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    path = Path(source).expanduser()
    try:
        if path.is_dir():
            config = json.loads((path / "processor_config.json").read_text())
        else:
            from huggingface_hub import hf_hub_download

            config = json.loads(Path(hf_hub_download(source, "processor_config.json")).read_text())
    except (OSError, ValueError):
        return None
    cls = getattr(transformers, str(config.get("processor_class")), None)
    if cls is None or "video_processor" not in inspect.signature(cls.__init__).parameters:
        return None
    image_processor = AutoImageProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    extra = {k: v for k, v in config.items() if k not in ("processor_class", "image_processor", "video_processor",
                                                           "tokenizer", "chat_template")}
    return image_only_processor(cls)(image_processor=image_processor, tokenizer=tokenizer,
                                     chat_template=tokenizer.chat_template, **extra)


def auto_model_class():
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText


@dataclass
class VisionParts:
    """Qualified module names (in the un-wrapped Transformers model) of a VLM's three parts."""

    tower: str
    projector: str
    language: str


def vision_parts(model) -> VisionParts:
    """Where the tower, the projector and the language model are in `model` (a VLM, maybe
    PEFT-wrapped: names are those of the Transformers model inside)."""
    from maximus.structure import causal_lm_of

    lm = causal_lm_of(model)
    names = {id(m): n for n, m in lm.named_modules()}
    tower = next((n for n, _ in lm.named_modules() if n.rsplit(".", 1)[-1] in TOWER_NAMES), None)
    projector = next((n for n, _ in lm.named_modules() if n.rsplit(".", 1)[-1] in PROJECTOR_NAMES), None)
    language = names.get(id(lm.get_decoder()))
    if tower is None or projector is None or language is None:
        raise ModelError(f"{type(lm).__name__}: cannot find its vision tower, projector and language model",
                         f"supported vision-language families: {', '.join(sorted(set(VISION_FAMILIES.values())))}")
    return VisionParts(tower, projector, language)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def adapter_targets(model, lora, selected: set[str]) -> tuple[str | list[str], list[str]]:
    """(PEFT target_modules, extra modules_to_save) for a VLM.

    `selected`: the linears `lora.target_modules` names (by PEFT's rules). Kept: those of the
    language model, and those of the tower (not the projector) with `lora.vision`. Returned as
    one regular expression when it selects exactly these names (short adapter_config.json), else
    as the list of qualified names. `lora.projector` adds the projector to modules_to_save."""
    parts = vision_parts(model)
    keep = {n for n in selected if _under(n, parts.language)}
    prefixes = [parts.language]
    if lora.vision:
        keep |= {n for n in selected if _under(n, parts.tower) and not _under(n, parts.projector)}
        prefixes.append(parts.tower)
    if not keep:
        raise ModelError(f"lora.target_modules: {lora.target_modules} selects no linear layer of the language model",
                         "use all-linear or names such as q_proj, v_proj")
    leaves = sorted({n.rsplit(".", 1)[-1] for n in keep})
    pattern = (rf"(?:{'|'.join(re.escape(p) for p in prefixes)})\..*\.(?:{'|'.join(re.escape(x) for x in leaves)})")
    targets: str | list[str] = pattern if {n for n in selected if re.fullmatch(pattern, n)} == keep else sorted(keep)
    if any(re.fullmatch(pattern, n) for n in selected - keep):
        targets = sorted(keep)
    extra = [parts.projector.rsplit(".", 1)[-1]] if lora.projector else []
    return targets, extra


def freeze_for_full(model, lora) -> None:
    """`method: full` on a VLM: every language-model weight trains; the tower and the projector
    only with `lora.vision` / `lora.projector` (as under LoRA)."""
    from maximus.structure import causal_lm_of

    parts = vision_parts(model)
    for name, p in causal_lm_of(model).named_parameters():
        if _under(name, parts.projector):
            p.requires_grad_(bool(lora.projector))
        elif _under(name, parts.tower):
            p.requires_grad_(bool(lora.vision))


def quantization_skip_modules(config) -> list[str]:
    """Modules QLoRA leaves unquantized in a VLM: the tower, the projector and the head (small,
    and quantizing the tower costs image fidelity for little memory)."""
    return [*TOWER_NAMES, *PROJECTOR_NAMES, "lm_head"]
