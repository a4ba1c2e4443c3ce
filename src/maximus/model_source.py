"""Where a run's base model comes from, resolved once into one frozen value.

`resolve_source(cfg)` answers every question about `model:` before anything loads, in one pass:

- the name: a `builtin:` model is materialised (`maximus.builtin.materialize`, the resolution
  `maximus.builtin.resolve` applies to a whole config);
- the kind: a GGUF file (by its suffix, as every GGUF tool decides), a local directory written
  by `save_pretrained`, or a Hugging Face hub id;
- the files: a GGUF file Transformers can read and dequantize (`maximus.gguf_base.check_gguf`);
  a directory with a config.json and safetensors weights (pickle-only weights only with
  `allow_pickle`);
- the Transformers config (from config.json, the hub cache or the GGUF metadata), with
  `trust_remote_code` only when the config says so;
- vision or not (`maximus.vision.is_vision_config`), and for a text model that it is a causal LM
  (`maximus.families.check_causal_lm`);
- the tested family it belongs to, if any;
- what quantization applies: the GGUF file's own types are dequantized (to the training dtype),
  QLoRA's NF4 skips a VLM's tower, projector and head, and a local safetensors directory can be
  quantized one layer at a time (`maximus.layerwise_load`).

Loading (`maximus.models`, `maximus.layerwise_load`), the data pipeline, export, chat, generate
and eval take the `ModelSource`; none of them asks these questions again.

Raises ModelError (one line): a missing model, a directory without config.json, pickle-only
weights, a GGUF file Transformers cannot load, a config that cannot be read, a model that is not
a causal LM.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from maximus.errors import ModelError
from maximus.gguf_base import gguf_config, gguf_location, is_gguf

if TYPE_CHECKING:
    from maximus.config import Config

__all__ = ["ModelSource", "SourceKind", "resolve_source", "safetensors_weight_map"]

SourceKind = Literal["gguf", "directory", "hub"]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class ModelSource:
    """A base model's source, resolved once (`resolve_source`).

    Fields:
        name: the model as `from_pretrained` takes it (a `builtin:` name materialised): a path or
            a hub id; for a GGUF file, its path.
        kind: ``gguf`` (a .gguf file), ``directory`` (a local `save_pretrained` directory) or
            ``hub`` (a Hugging Face hub id).
        config: the model's Transformers config. Shared: read it, never change it
            (`fresh_config` for a loader that does).
        vision: a vision-language model (loads through AutoModelForImageTextToText, `maximus.vision`).
        family: the tested family's name (`maximus.families.FAMILIES`, `maximus.vision.VISION_FAMILIES`),
            None outside them.
        trust_remote_code: the config's `trust_remote_code` (Transformers may run the model's code).
        allow_pickle: the config's `allow_pickle` (.bin / .pt weights may load).
        nf4_skip_modules: modules QLoRA's NF4 leaves unquantized (a VLM's tower, projector and
            head); None for a text model.
        layerwise_directory: the local directory of safetensors files a QLoRA base can be read from
            one decoder layer at a time (`maximus.layerwise_load`); None for a hub id, a GGUF file,
            pickle weights.
    """

    name: str
    kind: SourceKind
    config: Any
    vision: bool
    family: str | None
    trust_remote_code: bool = False
    allow_pickle: bool = False
    nf4_skip_modules: tuple[str, ...] | None = None
    layerwise_directory: Path | None = None

    @property
    def gguf_file(self) -> tuple[str, str] | None:
        """(directory, file name) of a GGUF source, as `from_pretrained(directory, gguf_file=name)`
        takes it; None for any other kind."""
        return gguf_location(self.name) if self.kind == "gguf" else None

    def pretrained_args(self) -> tuple[str, dict]:
        """(what, keywords) for Transformers' `from_pretrained`: a GGUF file by its directory and
        `gguf_file`, anything else by name with safetensors only unless pickles are allowed."""
        kwargs: dict = {"trust_remote_code": self.trust_remote_code}
        if self.kind == "gguf":
            directory, kwargs["gguf_file"] = gguf_location(self.name)
            return directory, kwargs
        kwargs["use_safetensors"] = None if self.allow_pickle else True
        return self.name, kwargs

    def fresh_config(self):
        """A copy of `config` that a loader may change (Transformers writes its choices into it)."""
        return copy.deepcopy(self.config)


def resolve_source(cfg: Config) -> ModelSource:
    """`cfg.model` resolved (see the module docstring): the one place its files and config are read.

    Raises:
        ModelError: the model or its config cannot be read, or is not a causal LM / VLM.
    """
    from maximus.builtin import materialize

    name = materialize(cfg.model)
    kind = _kind(name)
    if kind == "gguf":
        config = gguf_config(name, cfg.trust_remote_code)  # checks the file first (`check_gguf`)
    else:
        if kind == "directory":
            _check_directory(name, cfg.allow_pickle)
        config = _read_config(name, cfg.trust_remote_code)
    return _described(name, kind, config, trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)


def _kind(name: str) -> SourceKind:
    """What `name` is: a GGUF file by its suffix; a local directory when it exists or is written
    as a path (a hub id is `owner/name`); else a hub id."""
    if is_gguf(name):
        return "gguf"
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        return "directory"
    return "hub"


def _check_directory(name: str, allow_pickle: bool) -> None:
    """Fail fast, with one line, on a missing directory, one without config.json, or pickle-only weights."""
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ModelError(f"model not found: {name}", "give a local model directory (with config.json) or a Hugging Face hub id")
    if not (path / "config.json").is_file():
        raise ModelError(f"model directory {name} has no config.json", "point `model:` at a directory written by save_pretrained")
    has_safe = any(p.suffix == ".safetensors" for p in path.iterdir())
    has_pickle = any(p.suffix in _PICKLE_SUFFIXES for p in path.iterdir())
    if not has_safe and has_pickle and not allow_pickle:
        raise ModelError(f"model directory {name} holds only pickle weights (.bin/.pt), which can run code when loaded",
                         "convert them to safetensors, or set allow_pickle: true if you trust the files")


def _read_config(name: str, trust_remote_code: bool):
    """The Transformers config of a directory or hub id, a one-line ModelError when it cannot be read."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise ModelError(f"cannot load model {name}: {str(exc).splitlines()[0]}",
                         "check the id or path; hub models need network access (or a local copy)") from None
    except ValueError as exc:
        first = str(exc).splitlines()[0]
        hint = ("set trust_remote_code: true only if you trust its code" if "trust_remote_code" in str(exc)
                else "the model's config.json does not load with this Transformers version")
        raise ModelError(f"cannot load model {name}: {first}", hint) from None


def _described(name: str, kind: SourceKind, config, *, trust_remote_code: bool, allow_pickle: bool) -> ModelSource:
    """The `ModelSource` of a read config: vision or a checked causal LM, family, quantization."""
    from maximus.families import FAMILIES, check_causal_lm
    from maximus.vision import VISION_FAMILIES, is_vision_config, quantization_skip_modules

    vision = is_vision_config(config)
    if not vision:  # a VLM loads through AutoModelForImageTextToText (maximus.vision)
        check_causal_lm(config, name)
    model_type = str(getattr(config, "model_type", "") or "")
    family = FAMILIES[model_type].name if model_type in FAMILIES else VISION_FAMILIES.get(model_type)
    directory = Path(name)
    layerwise = directory if kind == "directory" and safetensors_weight_map(directory) is not None else None
    return ModelSource(name=name, kind=kind, config=config, vision=vision, family=family,
                       trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                       nf4_skip_modules=tuple(quantization_skip_modules(config)) if vision else None,
                       layerwise_directory=layerwise)


def safetensors_weight_map(directory: Path) -> dict[str, str] | None:
    """Tensor name -> safetensors file of a local model directory (its index, or the names in its
    one model.safetensors); None when it holds no safetensors weights."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = directory / "model.safetensors"
    if single.exists():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: "model.safetensors" for k in f.keys()}
    return None
