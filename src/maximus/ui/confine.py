"""What a config sent from the browser may ask for: paths inside the roots, and no code.

`maximus ui` starts processes, so a config posted to it is read as untrusted input:

- every path is confined: the model, tokenizer and `init_adapter` to ``--models-root`` (an adapter
  may also come from ``--runs``), each dataset (and `eval.dataset`) and the images of `eval.prompts`
  to ``--data-root``, `output_dir` to ``--runs``. The images data rows name are read by the child,
  so the config it gets carries `vision.image_root` (``--data-root``, or a folder under it), which
  the trainer enforces on every image it opens.
  A relative path is taken from the server's working directory, as `maximus-train` takes it; the
  path is resolved (``..`` and symlinks followed) before it is checked, and the config handed to
  the child carries the resolved path, so the child opens what was checked;
- a value that is not an existing path and reads as a hub id (``org/name``) stays a hub id;
- code is refused unless the server was started with ``--allow-code``: `trust_remote_code`,
  `allow_pickle` (unpickling runs code), GRPO rewards other than the built-ins, custom metrics
  (``module:function``) and an MLflow tracking URI (it names a place to write or a host to call).

`confine_config(text, roots, allow_code=...)` parses the YAML with ``yaml.safe_load``, validates
it with the CLI's own `Config.from_dict`, and returns the config to run; it raises `ConfigError`
(the CLI's one line, 400) or `Refused` (the rule broken, 403). `Confinement` holds one server's
roots and ``--allow-code``; the routes reach it through `maximus.ui.guard.Guard` only.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maximus.builtin import is_builtin
from maximus.config import Config, parse_yaml
from maximus.config import _apply_override as apply_override  # the CLI's key.sub=value parser
from maximus.errors import ConfigError, MaximusError

__all__ = ["Confinement", "Refused", "Roots", "confine_config", "parse_config_text", "MAX_CONFIG_BYTES"]

MAX_CONFIG_BYTES = 256 * 1024
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class Refused(MaximusError):
    """A request the server does not serve: a path outside the roots, code without --allow-code,
    a missing token or a foreign origin."""


@dataclass(frozen=True)
class Roots:
    """The directories a browser's config may name (resolved at start)."""

    data: Path
    models: Path
    runs: Path

    @classmethod
    def of(cls, data: str | Path, models: str | Path, runs: str | Path) -> "Roots":
        return cls(Path(data).resolve(), Path(models).resolve(), Path(runs).resolve())


def parse_config_text(text: Any) -> dict:
    """The YAML a browser sent, as a mapping (``yaml.safe_load``: no tags, no objects)."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("the request has no config", 'send {"config": "<the YAML of a maximus-train config>"}')
    if len(text.encode("utf-8")) > MAX_CONFIG_BYTES:
        raise ConfigError(f"the config is larger than {MAX_CONFIG_BYTES // 1024} KiB", "send the YAML only, not the data")
    data = parse_yaml(text, "config")
    if not isinstance(data, dict):
        raise ConfigError("config: expected a mapping of keys at the top level", "start with e.g. `model: ...`")
    return data


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def _is_path(value: str) -> bool:
    """A local path (to be confined) rather than a hub id."""
    return (value.startswith(("/", ".", "~")) or "\\" in value or ".." in Path(value).parts
            or Path(value).exists() or not _HUB_ID.match(value))


def confine_path(key: str, value: str, roots: list[tuple[str, Path]], *, hub_ok: bool) -> str:
    """`value` resolved, if it lies under one of `roots` (flag name, directory); else `Refused`."""
    if hub_ok and (is_builtin(value) or not _is_path(value)):  # a hub id, or an embedded default (builtin:)
        return value
    resolved = Path(os.path.abspath(value)).resolve()
    for _, root in roots:
        if _inside(resolved, root):
            return str(resolved)
    where = " or ".join(f"{flag} {root}" for flag, root in roots)
    raise Refused(f"{key} {value} is outside {where}",
                  f"put it under {roots[0][1]}, or start maximus ui with {roots[0][0]} pointing at its folder")


def _refuse_code(key: str, what: str) -> Refused:
    return Refused(f"{key}: {what} is code, and this server does not run code from the browser",
                   "start maximus ui with --allow-code if you trust every page that can reach it, "
                   "or run this config with maximus-train")


def confine_config(text: Any, roots: Roots, *, allow_code: bool = False,
                   overrides: list[str] | None = None) -> tuple[dict, Config]:
    """(the config mapping to hand to `maximus-train`, its validated `Config`): the YAML `text`
    with the CLI's ``key.sub=value`` `overrides` applied (the run form sends its fields so). See
    the module doc."""
    data = {} if overrides and isinstance(text, (str, type(None))) and not (text or "").strip() else parse_config_text(text)
    if overrides is not None:
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise ConfigError("overrides must be a list of key.sub=value strings", 'e.g. ["training.max_steps=10"]')
        for item in overrides:
            apply_override(data, item)
    Config.from_dict(data, source="config")  # the CLI's validation and its one-line errors, first
    out = dict(data)
    models = [("--models-root", roots.models)]
    if isinstance(out.get("model"), str):
        out["model"] = confine_path("model", out["model"], models, hub_ok=True)
    if isinstance(out.get("tokenizer"), str):
        out["tokenizer"] = confine_path("tokenizer", out["tokenizer"], models, hub_ok=True)
    if isinstance(out.get("init_adapter"), str):
        out["init_adapter"] = confine_path("init_adapter", out["init_adapter"],
                                           models + [("--runs", roots.runs)], hub_ok=False)
    out["dataset"] = _confine_datasets(out["dataset"], roots)
    if isinstance(out.get("eval"), dict) and out["eval"].get("dataset") is not None:
        out["eval"] = {**out["eval"], "dataset": _confine_datasets(out["eval"]["dataset"], roots, "eval.dataset")}
    if isinstance(out.get("eval"), dict) and isinstance(out["eval"].get("prompts"), list):
        out["eval"] = {**out["eval"], "prompts": [_confine_image_prompt(p, roots) for p in out["eval"]["prompts"]]}
    # Images named inside data rows are read by the child: the trainer confines them (vision.image_root).
    vision = dict(out.get("vision") or {})
    root = vision.get("image_root")
    vision["image_root"] = (confine_path("vision.image_root", root, [("--data-root", roots.data)], hub_ok=False)
                            if isinstance(root, str) else str(roots.data))
    out["vision"] = vision
    if out.get("output_dir") is None:
        out["output_dir"] = str(roots.runs / (Path(str(out["model"]).rstrip("/")).name or "model"))
    out["output_dir"] = confine_path("output_dir", str(out["output_dir"]), [("--runs", roots.runs)], hub_ok=False)
    if Path(out["output_dir"]) == roots.runs:
        raise Refused(f"output_dir {out['output_dir']} is --runs itself", "name a run directory under it")
    cfg = Config.from_dict(out, source="config")
    if not allow_code:
        _refuse_code_keys(cfg)
    return out, cfg


def _confine_datasets(value: Any, roots: Roots, key: str = "dataset") -> Any:
    data_root = [("--data-root", roots.data)]
    if isinstance(value, list):
        return [_confine_datasets(v, roots, key) for v in value]
    if isinstance(value, str):
        return confine_path(key, value, data_root, hub_ok=True)
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        return {**value, "path": confine_path(f"{key}.path", value["path"], data_root, hub_ok=True)}
    return value


def _confine_image_prompt(prompt: Any, roots: Roots) -> Any:
    """An eval.prompts entry with its image file(s) confined to --data-root (a text prompt as it is)."""
    if not isinstance(prompt, dict) or prompt.get("image") is None:
        return prompt
    data_root = [("--data-root", roots.data)]
    image = prompt["image"]
    files = [image] if isinstance(image, str) else list(image)
    confined = [confine_path("eval.prompts image", f, data_root, hub_ok=False) for f in files]
    return {**prompt, "image": confined[0] if isinstance(image, str) else confined}


def _refuse_code_keys(cfg: Config) -> None:
    from maximus.train.rewards import BUILTINS

    if cfg.trust_remote_code:
        raise _refuse_code("trust_remote_code", "model code from the hub")
    if cfg.allow_pickle:
        raise _refuse_code("allow_pickle", "unpickling .bin / .pt weights")
    for spec in cfg.grpo.rewards:
        if spec not in BUILTINS:
            raise _refuse_code("grpo.rewards", f"the reward {spec!r}")
    metrics = getattr(cfg.eval, "metrics", None) or []
    for spec in metrics if isinstance(metrics, (list, tuple)) else [metrics]:
        if isinstance(spec, str) and ":" in spec:
            raise _refuse_code("eval.metrics", f"the custom metric {spec!r}")
    if cfg.logging.mlflow_uri is not None:
        raise Refused("logging.mlflow_uri is not accepted from the browser (it names a place to write or a host to call)",
                      "leave it out (the default store lies in the run directory), or run this config with maximus-train")


@dataclass(frozen=True)
class Confinement:
    """One server's rules for what a config may name: its `roots` and whether code runs (``--allow-code``)."""

    roots: Roots
    allow_code: bool = False

    def config(self, text: Any, overrides: list[str] | None = None) -> tuple[dict, Config]:
        """A config from the browser, confined (`confine_config`)."""
        return confine_config(text, self.roots, allow_code=self.allow_code, overrides=overrides)

    def saved_run(self, name: str, run_dir: Path, config: dict) -> dict:
        """The config a saved queue entry (`name`, `run_dir`, `config`) may run: confined as a
        posted config is, with these flags, and writing to `run_dir` under the name `name`."""
        import yaml

        data, _ = self.config(yaml.safe_dump(config))
        if Path(data["output_dir"]) != Path(run_dir) or self.run_name(data["output_dir"]) != name:
            raise Refused(f"queued run {name} waits for {run_dir}, but its config writes output_dir {data['output_dir']}",
                          "start it again from the run form")
        return data

    def model(self, key: str, value: str) -> str:
        """A model a form names (`key`: its field): a hub id or builtin: name as it is, a path only
        under ``--models-root`` (resolved)."""
        return confine_path(key, value, [("--models-root", self.roots.models)], hub_ok=True)

    def loadable(self, cfg: Config, name: str) -> None:
        """Refuse to load run `name`'s model (chat, export) when its recorded config runs code and
        this server was started without ``--allow-code``: the server's flag decides, not run.json."""
        if self.allow_code:
            return
        for key, on, what in (("trust_remote_code", cfg.trust_remote_code, "its model's code from the hub"),
                              ("allow_pickle", cfg.allow_pickle, "unpickling its .bin / .pt weights")):
            if on:
                raise Refused(f"run {name} records {key}: true, and loading it runs code ({what}), which this server "
                              "does not run", "start maximus ui with --allow-code if you trust that code, or use "
                              "maximus generate / maximus export")

    def run_name(self, output_dir: str) -> str:
        """The run name of a confined `output_dir`: its path under ``--runs``."""
        return Path(output_dir).relative_to(self.roots.runs).as_posix()
