"""Whose `output_dir` is it: a run directory is recognisably ours, and a run writes nowhere else.

A run marks its directory at its start with `MARKER` (``.maximus-run.json``: who wrote it, when,
and the files of the final weights it wrote). Before anything is loaded, `check_output_dir`
accepts an `output_dir` that does not exist, is empty, or is a run of ours (it holds `MARKER`,
or only the run lock a run takes before it marks: `maximus.train.lock.LOCK_NAME`); a run of ours
resumes. Anything else (`output_dir: .` in a project, a home directory, a base model's folder)
is refused in one line and nothing is touched.

The final weights (`adapter/` or `model/`) replace the previous ones only while these hold no
file the marker does not list (`maximus.ownership`, the rule `maximus export --out` follows):
a file a person put there is named in the error and kept.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from maximus.errors import CheckpointError, ConfigError
from maximus.ownership import files_under, swap_in, unlisted_files
from maximus.files import fsync_dir, write_json
from maximus.train.lock import LOCK_NAME

__all__ = ["MARKER", "check_output_dir", "mark_run_directory", "replace_final_weights"]

MARKER = ".maximus-run.json"


def check_output_dir(run_dir: Path) -> None:
    """Raise ConfigError (one line, exit 2) unless `run_dir` may hold this run. Reads only."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise ConfigError(f"output_dir {run_dir} exists and is not a directory",
                          "choose a new or empty directory; nothing was changed")
    entries = sorted(p.name for p in run_dir.iterdir())
    if not entries or MARKER in entries or entries == [LOCK_NAME]:
        return
    raise ConfigError(f"output_dir {run_dir} already exists and holds files no Maximus run wrote (e.g. {entries[0]!r})",
                      "choose a new or empty directory; nothing was changed")


def _read_marker(run_dir: Path) -> dict:
    try:
        data = json.loads((run_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def mark_run_directory(run_dir: Path) -> None:
    """Write `MARKER` into `run_dir` (which exists: the run holds its lock) unless it is there."""
    import importlib.metadata as md

    run_dir = Path(run_dir)
    if (run_dir / MARKER).is_file():
        return
    try:
        version = md.version("maximusllm")
    except md.PackageNotFoundError:
        version = None
    write_json(run_dir / MARKER, {"written_by": "maximus-train", "maximus_version": version,
                                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "final_weights": {}})
    fsync_dir(run_dir)


def replace_final_weights(run_dir: Path, name: str, save: Callable[[Path], None]) -> Path:
    """`save(tmp)` writes the final weights into a fresh temporary sibling, which then replaces
    `run_dir/name` (``adapter`` or ``model``). Raises CheckpointError, before anything is
    replaced, when `run_dir/name` holds a file the marker does not list."""
    run_dir = Path(run_dir)
    final = run_dir / name
    marker = _read_marker(run_dir)
    recorded = marker.setdefault("final_weights", {})
    listed = recorded.get(name, [])
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=run_dir))
    try:
        extra = unlisted_files(final, listed)
        if extra:
            raise CheckpointError(f"{final} holds files this run did not write (e.g. {extra[0]!r}); the final weights "
                                  "were not saved", f"move them out of {final} and run again: the run resumes from its "
                                  "last checkpoint and saves them")
        save(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the weights are meant to be shared like any directory
        written = files_under(tmp)
        # Both lists while the swap is under way: a crash in between leaves a directory we still own.
        recorded[name] = sorted(set(listed) | set(written))
        write_json(run_dir / MARKER, marker)
        swap_in(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    recorded[name] = written
    write_json(run_dir / MARKER, marker)
    fsync_dir(run_dir)
    return final
