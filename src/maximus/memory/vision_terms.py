"""What a vision-language model adds to the memory of a training step, from its config files alone.

A VLM (`maximus.vision`) is a language model plus a vision tower and a projector. The language
model is estimated as any decoder (`maximus.memory.estimate`): its rows already hold the image
tokens, which the processor wrote into ``input_ids``. This module adds the rest:

* **weights**: the tower and the projector, in the compute dtype (QLoRA leaves both unquantized,
  `maximus.vision.quantization_skip_modules`);
* **image tokens per image** from the processor's arithmetic at the capped resolution
  (``vision.max_pixels``): LLaVA and Gemma 3 resize every image to the tower's fixed size
  ((size / patch)^2 patches); Qwen2-VL / Qwen2.5-VL keep the resolution, rounded to whole
  ``patch x merge`` blocks within ``[min_pixels, max_pixels]`` (``smart_resize``), and merge
  ``merge^2`` patches into one token; `image_geometry` says which and how many;
* **the tower's activations**: a frozen tower runs without a graph (nothing requires a gradient):
  only its forward's transients, one phase of their own (``vision``: every hidden state the tower
  returns plus one layer's working set). With ``lora.vision`` the tower's layers keep what autograd
  saves for backward, per patch, until the backward reaches them (measured coefficients, below),
  or only their inputs when the tower is checkpointed (`tower_checkpointed`: the trainer recomputes
  the tower whenever it recomputes any language-model layer);
* **the projector**: frozen, nothing; trained (``lora.projector``: a PEFT ``modules_to_save`` copy
  in float32 beside the frozen original) its weights, gradients and optimizer state, and the
  tensors its backward needs.

`vision_spec` reads everything from the model (config.json and the processor's
preprocessor_config.json, no weights); `estimate_peak(..., vision=spec)` adds `vision_terms`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from maximus.errors import ConfigError, ModelError

__all__ = ["VisionShape", "VisionSpec", "VisionTerms", "ImageGeometry", "image_geometry", "vision_shape",
           "vision_spec", "vision_terms", "smart_resize", "processor_limits", "processor_config", "tower_checkpointed",
           "check_row_fits", "TOWER_LORA_LINEARS"]

#: LoRA targets of a CLIP / SigLIP tower layer, and the language-model names that select them.
TOWER_LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")

# Bytes one CLIP encoder layer saves for backward per patch, LoRA on its six linears (PEFT, SDPA):
# ch * hidden + ci * intermediate + 4 * heads (log-sum-exp) + cr * r per LoRA target (its rank-r
# product) + c0, by dtype bytes. Measured with saved_tensors_hooks on Transformers 5
# CLIPEncoderLayer, hidden 64-128, intermediate 128-512, 2-4 heads, r 8-16, 64-256 patches
# (docs/planner.md, "Vision-language models"): exact on all 14 shapes. bf16 runs under autocast with
# the frozen base in bf16, as the trainer runs it; autocast also keeps a 16-bit copy of each float32
# adapter weight per forward (2 bytes x r x (in + out) per target and layer, not per patch).
_TOWER_COEF = {4: (32, 12, 4, 16), 2: (22, 6, 2, 8)}


@dataclass(frozen=True)
class VisionShape:
    """The dimensions of a VLM's tower and projector that memory depends on."""

    model_type: str
    hidden_size: int  # the tower's width
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    #: Fixed-resolution towers (LLaVA / CLIP, Gemma 3 / SigLIP): the image side in pixels; 0 when
    #: the processor keeps the image's resolution (Qwen2-VL).
    image_size: int
    #: Patches merged into one image token (Qwen2-VL's spatial merge: merge^2), 1 otherwise.
    merge: int = 1
    #: Extra tower tokens (CLIP's class token) and whether the image tokens keep it.
    extra_tokens: int = 0
    keep_extra: bool = False
    #: Image tokens per image when the config fixes them (Gemma 3: mm_tokens_per_image; 0 = from patches).
    fixed_tokens: int = 0
    text_hidden: int = 0
    projector_in: int = 0
    projector_params: int = 0
    tower_params: int = 0
    #: The hidden states the tower returns (LLaVA: all of them, for `vision_feature_layer`).
    returned_states: int = 1
    #: Idefics3 / SmolVLM: the processor cuts the image into tiles of the tower's size plus a
    #: global view; each tile's patches are merged (pixel shuffle) into image tokens.
    tiled: bool = False

    def layer_linear_shapes(self) -> dict[str, tuple[int, int]]:
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, h), "k_proj": (h, h), "v_proj": (h, h), "out_proj": (h, h), "fc1": (h, i), "fc2": (i, h)}


@dataclass(frozen=True)
class ImageGeometry:
    """One image after the processor: its size (pixels), the tower's tokens, the language model's image tokens."""

    width: int
    height: int
    patches: int
    tokens: int
    fixed: bool  # the processor resizes every image to one size: vision.max_pixels does not change it


@dataclass(frozen=True)
class VisionSpec:
    """What `estimate_peak` needs to add a VLM's tower and projector (`vision_spec` builds it)."""

    shape: VisionShape
    geometry: ImageGeometry
    images_per_row: int = 1
    lora_vision: bool = False
    lora_projector: bool = False
    tower_targets: tuple[str, ...] = ()
    #: Whether a micro-batch's rows may differ in length (padding: an attention mask). The data
    #: says (`RowLengths`); without it, assumed.
    padded: bool = True
    #: The image processor's settings (preprocessor_config.json), for other image sizes.
    processor: dict = field(default_factory=dict, compare=False, repr=False)

    def for_data(self, images_per_row: int, padded: bool) -> "VisionSpec":
        """This spec for the rows the data has: the most images in one row, whether lengths differ."""
        return replace(self, images_per_row=max(1, int(images_per_row)), padded=bool(padded))


@dataclass(frozen=True)
class VisionTerms:
    """Bytes a VLM's tower and projector add, per part of the estimate."""

    weights: int
    adapters: int  # trainable parameters' bytes (float32)
    trainable: int  # trainable parameters (count)
    saved: int  # activations held from the tower's forward to the end of backward
    forward_peak: int  # the tower's forward transients (the `vision` phase)
    images: int
    inputs: int = 0  # the step's pixel tensors (every micro-batch's, collated before the first runs)
    in_backward: int = 0  # a recomputed layer's padded-attention tensors, in its backward

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def add_to_phases(self, phases: dict[str, dict[str, int]], gradients_before: int) -> None:
        """Add these terms to `estimate_peak`'s phases: the saved tensors are held through the
        language model's forward and backward; the tower's forward is a phase of its own."""
        for name in ("loss", "backward"):
            phases[name]["activations"] += self.saved
        phases["backward"]["activations"] += self.in_backward
        phases["vision"] = {"gradients": gradients_before, "activations": self.forward_peak, "loss": 0,
                            "workspace": phases["loss"].get("workspace", 0)}
        for phase in phases.values():
            phase["activations"] = phase.get("activations", 0) + self.inputs


def _get(fields: Any, name: str, default: Any = None) -> Any:
    value = fields.get(name) if isinstance(fields, dict) else getattr(fields, name, None)
    return default if value is None else value


def _as_dict(fields: Any) -> dict:
    return fields if isinstance(fields, dict) else fields.to_dict()


def vision_shape(model_config: Any) -> VisionShape:
    """The tower and projector shape of a VLM config (config.json dict or PretrainedConfig).
    Raises ModelError for a family whose tower the estimator does not know."""
    cfg = _as_dict(model_config)
    vc, tc = cfg.get("vision_config") or {}, cfg.get("text_config") or {}
    model_type = str(cfg.get("model_type", ""))
    text_hidden = int(_get(tc, "hidden_size", _get(cfg, "hidden_size", 0)))
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        h = int(_get(vc, "embed_dim", _get(vc, "hidden_size")))
        inter = int(_get(vc, "intermediate_size", h * int(_get(vc, "mlp_ratio", 4))))
        merge = int(_get(vc, "spatial_merge_size", 2))
        layers, patch = int(_get(vc, "depth")), int(_get(vc, "patch_size", 14))
        temporal = int(_get(vc, "temporal_patch_size", 2))
        out = int(_get(vc, "out_hidden_size", _get(vc, "hidden_size", text_hidden)))
        proj_in = h * merge * merge
        projector = proj_in * proj_in + proj_in + proj_in * out + out + 2 * h
        embed = 3 * temporal * patch * patch * h
        return VisionShape(model_type, h, inter, layers, int(_get(vc, "num_heads", 16)), patch, 0, merge=merge * merge,
                           text_hidden=out, projector_in=proj_in, projector_params=projector,
                           tower_params=layers * _layer_params(h, inter) + embed)
    if not vc or "hidden_size" not in vc:
        raise ModelError(f"the memory estimator does not know the vision tower of model type {model_type!r}",
                         "supported: llava, gemma3, idefics3, smolvlm, qwen2_vl, qwen2_5_vl (docs/vision.md)")
    h, inter = int(vc["hidden_size"]), int(_get(vc, "intermediate_size", 4 * vc["hidden_size"]))
    layers, heads = int(_get(vc, "num_hidden_layers", 12)), int(_get(vc, "num_attention_heads", 12))
    patch, size = int(_get(vc, "patch_size", 14)), int(_get(vc, "image_size", 224))
    grid = (size // patch) ** 2
    if model_type == "gemma3":
        tokens = int(_get(cfg, "mm_tokens_per_image", 256))
        projector = h * text_hidden + h  # the soft-embedding norm and the projection
        embed = 3 * patch * patch * h + h + grid * h
        return VisionShape(model_type, h, inter, layers, heads, patch, size, fixed_tokens=tokens,
                           text_hidden=text_hidden, projector_in=h, projector_params=projector,
                           tower_params=layers * _layer_params(h, inter) + embed + 2 * h)
    if model_type in ("idefics3", "smolvlm"):
        scale = int(cfg.get("scale_factor", 2))
        proj_in = h * scale * scale
        embed = 3 * patch * patch * h + h + grid * h
        return VisionShape(model_type, h, inter, layers, heads, patch, size, merge=scale * scale, tiled=True,
                           text_hidden=text_hidden, projector_in=proj_in, projector_params=proj_in * text_hidden,
                           tower_params=layers * _layer_params(h, inter) + embed + 2 * h)
    if model_type != "llava":
        raise ModelError(f"the memory estimator does not know the vision tower of model type {model_type!r}",
                         "supported: llava, gemma3, idefics3, smolvlm, qwen2_vl, qwen2_5_vl (docs/vision.md)")
    feature_layer = cfg.get("vision_feature_layer", -2)
    n_feature = len(feature_layer) if isinstance(feature_layer, list) else 1
    bias = bool(cfg.get("multimodal_projector_bias", True))
    proj_in = h * n_feature
    projector = proj_in * text_hidden + text_hidden * text_hidden + (2 * text_hidden if bias else 0)
    embed = 3 * patch * patch * h + h + (grid + 1) * h
    return VisionShape(model_type, h, inter, layers, heads, patch, size, extra_tokens=1,
                       keep_extra=cfg.get("vision_feature_select_strategy", "default") == "full",
                       text_hidden=text_hidden, projector_in=proj_in, projector_params=projector,
                       tower_params=layers * _layer_params(h, inter) + embed + 4 * h, returned_states=layers + 1)


def _layer_params(h: int, inter: int) -> int:
    """One CLIP / SigLIP / Qwen2-VL tower layer: four h x h attention linears, fc1 and fc2, biases, two norms."""
    return 4 * (h * h + h) + h * inter + inter + inter * h + h + 4 * h


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's image processor rounding (`transformers...image_processing_qwen2_vl.smart_resize`):
    both sides multiples of `factor`, the area within [min_pixels, max_pixels], the aspect kept."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_geometry(shape: VisionShape, processor: dict | None = None, max_pixels: int | None = None,
                   image: tuple[int, int] | None = None) -> ImageGeometry:
    """The image tokens of one image (`ImageGeometry`) as the model's processor makes them.

    `processor`: the preprocessor_config.json dict (None: the family's defaults). `max_pixels`:
    ``vision.max_pixels``, the cap Maximus resizes to before the processor. `image`: the
    (width, height) of the largest image (None: a square image at the cap, or at the processor's
    largest size when there is no cap)."""
    processor = processor or {}
    if shape.tiled:
        return _tiled_geometry(shape, processor, image)
    if shape.image_size:  # fixed resolution: every image becomes image_size x image_size
        side = shape.image_size
        crop = processor.get("crop_size") or processor.get("size") or {}
        if isinstance(crop, dict) and crop.get("height") and crop.get("width"):
            w, hgt = int(crop["width"]), int(crop["height"])
        else:
            w = hgt = side
        grid = (hgt // shape.patch_size) * (w // shape.patch_size)
        patches = grid + shape.extra_tokens
        tokens = shape.fixed_tokens or (grid + (shape.extra_tokens if shape.keep_extra else 0))
        return ImageGeometry(w, hgt, patches, tokens, fixed=True)
    factor = shape.patch_size * int(math.isqrt(shape.merge))
    lo, hi = processor_limits(shape, processor)
    if max_pixels is not None:
        hi = min(hi, int(max_pixels))
    if image is None:
        side = math.isqrt(hi)
        image = (side, side)
    w, hgt = image
    if max_pixels is not None and w * hgt > max_pixels:  # Maximus' own resize (maximus.data.vision.open_image)
        scale = math.sqrt(max_pixels / (w * hgt))
        w, hgt = max(1, math.floor(w * scale)), max(1, math.floor(hgt * scale))
    rh, rw = smart_resize(hgt, w, factor, lo, hi)
    patches = (rh // shape.patch_size) * (rw // shape.patch_size)
    return ImageGeometry(rw, rh, patches, patches // shape.merge, fixed=False)


def _tiled_geometry(shape: VisionShape, processor: dict, image: tuple[int, int] | None) -> ImageGeometry:
    """Idefics3 / SmolVLM: the longest edge is scaled to ``size.longest_edge`` (whatever the image's
    size, so ``vision.max_pixels`` does not change it), both sides rounded up to whole tiles of
    ``max_image_size.longest_edge``; more than one tile adds the global view. Each tile is
    (tile / patch)^2 tower patches and that / merge image tokens, plus its markers (the
    processor's ``<fake_token_around_image>``, row/column tags: 2 per tile, 3 for the global view)."""
    tile = int((processor.get("max_image_size") or {}).get("longest_edge") or shape.image_size)
    longest = int((processor.get("size") or {}).get("longest_edge") or 4 * tile)
    split = processor.get("do_image_splitting", True)
    w, hgt = image or (longest, longest)
    if w >= hgt:
        w, hgt = longest, max(1, int(longest / (w / hgt)))
    else:
        w, hgt = max(1, int(longest * (w / hgt))), longest
    cols, rows = (math.ceil(w / tile), math.ceil(hgt / tile)) if split else (1, 1)
    tiles = cols * rows + (1 if cols * rows > 1 else 0)
    per_tile = (tile // shape.patch_size) ** 2
    tokens = tiles * (per_tile // shape.merge) + 2 * tiles + 1
    return ImageGeometry(cols * tile, rows * tile, tiles * per_tile, tokens, fixed=True)


def processor_limits(shape: VisionShape, processor: dict | None) -> tuple[int, int]:
    """(min, max) pixels of one image for a processor that keeps the resolution (Qwen2-VL's
    ``min_pixels`` / ``max_pixels``, or ``size.shortest_edge`` / ``size.longest_edge``, which
    Transformers 5 uses for those); a fixed-size tower's own area twice."""
    if shape.image_size:
        return shape.image_size ** 2, shape.image_size ** 2
    processor = processor or {}
    size = processor.get("size") or {}
    lo = int(processor.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
    hi = int(processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
    return lo, hi


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def processor_config(model: Any) -> dict:
    """The image processor's settings of a local model directory (preprocessor_config.json, or
    processor_config.json's ``image_processor``); {} when there is none (the family's defaults)."""
    path = Path(str(model)).expanduser()
    if not path.is_dir():
        return {}
    pre = _read_json(path / "preprocessor_config.json")
    if pre:
        return pre
    return _read_json(path / "processor_config.json").get("image_processor", {})


def tower_targets(lora_targets: Any) -> tuple[str, ...]:
    """The tower linears `lora.target_modules` selects (all-linear: all; else the names it lists)."""
    if lora_targets in (None, "all-linear"):
        return TOWER_LORA_LINEARS
    names = [lora_targets] if isinstance(lora_targets, str) else list(lora_targets)
    return tuple(n for n in TOWER_LORA_LINEARS if n in names)


def vision_spec(model: Any, model_config: Any, *, max_pixels: int | None, lora_vision: bool,
                lora_projector: bool, target_modules: Any) -> VisionSpec | None:
    """The `VisionSpec` of `model` (its path or hub id: the processor's settings are read beside
    it) whose config.json is `model_config`, None for a text model; images capped at `max_pixels`,
    the tower and the projector adapted as `lora.vision` / `lora.projector` say
    (`maximus.memory.spec_from_config` reads them). Raises ModelError for a tower the estimator
    does not know."""
    if "vision_config" not in _as_dict(model_config):
        return None
    shape = vision_shape(model_config)
    processor = processor_config(model)
    return VisionSpec(shape, image_geometry(shape, processor, max_pixels), lora_vision=bool(lora_vision),
                      lora_projector=bool(lora_projector),
                      tower_targets=tower_targets(target_modules) if lora_vision else (), processor=processor)


def tower_checkpointed(checkpointing: Any) -> bool:
    """Whether the tower is recomputed in backward: when any language-model layer is (the
    trainer's rule, `maximus.memory.checkpointing.apply_tower_checkpointing`). `checkpointing`
    in any form `estimate_peak` takes (a policy name, a number of layers, per-layer modes)."""
    if isinstance(checkpointing, str):
        return checkpointing not in ("off", "none")
    if isinstance(checkpointing, int):
        return checkpointing > 0
    return any(m not in ("off", "none", False) for m in checkpointing)


def _kept_layers(checkpointing: Any, num_layers: int) -> int:
    """Language-model layers that keep their attention's inputs for backward (not fully recomputed)."""
    if isinstance(checkpointing, str):
        return 0 if checkpointing == "full" else num_layers
    if isinstance(checkpointing, int):
        return num_layers - max(0, min(num_layers, checkpointing))
    return sum(1 for m in checkpointing if m not in ("full", True))


def masked_attention_bytes(text: Any, rows: int, seq_len: int, kept_layers: int) -> tuple[int, int]:
    """(held through forward and backward, added while a recomputed layer runs its backward):
    what a padded micro-batch costs the language model's attention, in bytes. VLM rows are padded
    with an attention mask (never flattened: `maximus.data.vision.collate_vision`); when their
    lengths differ, Transformers builds one dense boolean rows x T x T mask and each layer's SDPA
    keeps a float32 copy of it and wider per-head statistics for backward: 4 T^2 + (56 + 38 x
    heads) T bytes per row and layer; a fully recomputed layer builds its own in backward.
    Measured with the CPU meter on LoRA Llama layers (2-4 layers, 2-4 rows, 170-340 tokens, 4-8
    heads, checkpointing off and full; docs/planner.md)."""
    per_row = 4 * seq_len * seq_len + (56 + 38 * text.num_heads) * seq_len
    held = rows * (kept_layers * per_row + seq_len * seq_len)
    return int(held), int(rows * per_row if kept_layers < text.num_layers else 0)


def pixel_bytes(shape: VisionShape, geometry: ImageGeometry) -> int:
    """Bytes of one image's float32 pixel values as the image processor returns them: 3 channels
    per pixel of every tower patch (Qwen2-VL repeats each frame over its temporal patch of 2)."""
    temporal = 2 if shape.model_type in ("qwen2_vl", "qwen2_5_vl") else 1
    return 4 * 3 * temporal * (geometry.patches - shape.extra_tokens) * shape.patch_size ** 2


def vision_terms(spec: VisionSpec, *, rows: int, seq_len: int, text: Any, method: str, dtype_bytes: int,
                 lora_r: int, checkpointing: Any = "none", grad_accum: int = 1) -> VisionTerms:
    """The bytes `spec`'s tower and projector add to a micro-batch of `rows` rows of `seq_len`
    tokens (see the module docstring), and the padded attention of the language model (`text`,
    its `ModelShape`). `checkpointing`: the language model's (`tower_checkpointed` says what the
    tower does)."""
    checkpointed = tower_checkpointed(checkpointing)
    s, g, b = spec.shape, spec.geometry, dtype_bytes
    images = rows * spec.images_per_row
    P = images * g.patches  # tower tokens in the micro-batch
    n_img = images * g.tokens  # image tokens (the projector's output rows)
    h, i = s.hidden_size, s.intermediate_size
    weights = (s.tower_params + s.projector_params) * b
    trainable = 0
    lin = s.layer_linear_shapes()
    tower_lora = spec.lora_vision and method != "full"
    if tower_lora:
        trainable += s.num_layers * sum(lora_r * (lin[t][0] + lin[t][1]) for t in spec.tower_targets)
    elif spec.lora_vision:  # method: full with lora.vision trains the whole tower
        trainable += s.tower_params
    if spec.lora_projector:
        trainable += s.projector_params
        if method != "full":  # PEFT's modules_to_save: a trainable float32 copy beside the frozen original
            weights += s.projector_params * 4
    tower_trains = spec.lora_vision
    saved = 0
    if tower_trains:
        ch, ci, cr, c0 = _TOWER_COEF[4 if b >= 4 else 2]
        per_patch = ch * h + ci * i + 4 * s.num_heads + c0 + (cr * lora_r * len(spec.tower_targets) if tower_lora else 0)
        saved = int(P * s.num_layers * (b * h if checkpointed else per_patch))
        if tower_lora and b < 4 and not checkpointed:  # autocast's 16-bit copies of the adapter weights
            saved += s.num_layers * sum(2 * lora_r * (lin[t][0] + lin[t][1]) for t in spec.tower_targets)
    if tower_trains or spec.lora_projector:
        # The projector's input (the selected hidden state, kept whole) and its hidden activations.
        saved += int(P * s.projector_in * b + 2 * n_img * s.text_hidden * b)
    # A frozen tower's forward: every hidden state it returns, and one layer's working set
    # (the queries, keys, values, attention output and MLP intermediate of all patches).
    states = P * h * b * s.returned_states
    layer_work = P * (6 * h + 2 * i) * b
    forward_peak = int(states + layer_work + (saved if tower_trains else 0))
    in_backward = 0
    if spec.padded and rows > 1:
        held, in_backward = masked_attention_bytes(text, rows, seq_len, _kept_layers(checkpointing, text.num_layers))
        saved += held
    adapters = trainable * 4
    # The trainer collates every micro-batch of a step before the first runs: their pixels stay.
    inputs = max(1, grad_accum) * images * pixel_bytes(s, g)
    return VisionTerms(weights=int(weights), adapters=int(adapters), trainable=int(trainable), saved=int(saved),
                       forward_peak=forward_peak, images=images, inputs=int(inputs), in_backward=in_backward)


def check_row_fits(spec: VisionSpec, seq_len: int) -> None:
    """A row must hold its image tokens: ConfigError naming both numbers otherwise."""
    need = spec.geometry.tokens * spec.images_per_row
    if seq_len < need:
        raise ConfigError(f"training.seq_len {seq_len} is below the {need} image tokens of a row "
                          f"({spec.images_per_row} x {spec.geometry.width}x{spec.geometry.height} images of "
                          f"{spec.geometry.tokens} tokens)", "raise training.seq_len or lower vision.max_pixels")
