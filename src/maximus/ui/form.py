"""The run form of `maximus ui`, built from the config schema (`maximus.config.Config`).

One field per scalar key, with the key, type, default and description that docs/config.md shows
(both come from the same pydantic fields; a test compares them). The page sends only the fields
the user changed, as the CLI's ``key.sub=value`` overrides on top of the pasted YAML, so the form,
the YAML and `maximus-train` overrides are validated by the same code (`Config.from_dict`).
"""
from __future__ import annotations

import functools
import typing
from dataclasses import dataclass

from pydantic import BaseModel

from maximus.config import Config
from maximus.config import _model_of as sub_model  # the rule docs/config.md uses for sections

__all__ = ["FormField", "config_keys", "config_sections"]


@dataclass(frozen=True)
class FormField:
    key: str              # dotted, as in docs/config.md and overrides
    kind: str             # choice | bool | text
    default: str          # the default as the CLI's override would write it ("" = required / null)
    required: bool
    choices: tuple[str, ...]
    doc: str


def _literal_choices(annotation) -> tuple[str, ...] | None:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(a) for a in args)
    literals = [a for a in args if typing.get_origin(a) is typing.Literal]
    if len(literals) == 1 and all(a is type(None) or a is literals[0] for a in args):
        return tuple(str(a) for a in typing.get_args(literals[0]))
    return None


def _default_text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


@functools.lru_cache(maxsize=1)
def config_sections() -> list[tuple[str, str, list[FormField]]]:
    """(section key, section doc, fields) for the top level and each section, in schema order."""
    out: list[tuple[str, str, list[FormField]]] = []

    def walk(model: type[BaseModel], prefix: str, title: str, doc: str) -> None:
        fields: list[FormField] = []
        subs = []
        for name, field in model.model_fields.items():
            sub = sub_model(field.annotation)
            if sub is not None:
                subs.append((sub, f"{prefix}{name}.", f"{prefix}{name}", field.description or ""))
                if field.default_factory:  # a section only; otherwise also a value of its own (a path, true)
                    continue
            default = None if field.is_required() else (field.default_factory() if field.default_factory
                                                        else field.default)
            choices = _literal_choices(field.annotation)
            kind = "bool" if field.annotation is bool else "choice" if choices else "text"
            fields.append(FormField(f"{prefix}{name}", kind, _default_text(default), field.is_required(),
                                    choices or (), field.description or ""))
        out.append((title, doc, fields))
        for sub, p, t, d in subs:
            walk(sub, p, t, d)

    walk(Config, "", "", (Config.__doc__ or "").strip())
    return out


@functools.lru_cache(maxsize=1)
def config_keys() -> set[str]:
    """Every dotted key of the form (plus `dataset.path`, which a dataset mapping holds)."""
    return {f.key for _, _, fields in config_sections() for f in fields} | {"dataset.path"}
