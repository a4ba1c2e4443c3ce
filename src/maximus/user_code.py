"""Functions a config names as `module:function`: GRPO rewards (`grpo.rewards`) and task metrics
(`eval.metrics`). `module` is an importable module or a `.py` file path (relative to the working
directory); import failures become one-line ConfigErrors naming the config key."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable

from maximus.errors import ConfigError


def import_module(module_name: str, spec: str, key: str, noun: str = "module"):
    """The module of `spec` (`module_name` is its part before the colon), for config key `key`;
    `noun` names the file in errors (``reward file not found``)."""
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"{key}: {noun} file not found: {path} (from {spec!r})",
                                  "paths are relative to the working directory")
            name = f"maximus_user_{abs(hash(str(path.resolve())))}"
            found = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(found)
            sys.modules[name] = module
            found.loader.exec_module(module)
            return module
        return importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as exc:  # the user's module failed to import: say which and why, in one line
        raise ConfigError(f"{key}: cannot import {module_name!r}: {type(exc).__name__}: {exc}",
                          "check the module path (it must be importable, or a .py file path)") from None


def load_function(spec: str, key: str, signature: str, noun: str = "module") -> tuple[str, Callable]:
    """(function name, function) for `module:function`; `signature` goes into the hint when the
    module has no such function."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: {spec!r} is not module:function",
                          "use package.module:function or path/file.py:function")
    fn = getattr(import_module(module_name, spec, key, noun), attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}: {module_name} has no function {attr!r}",
                          f"define {attr}({signature}) there, or fix the name")
    return attr, fn
