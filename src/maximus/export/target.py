"""Where an export may write, and how it lands there without losing anything.

`maximus export --out PATH` accepts a path that does not exist, an empty directory, or (with
`--overwrite`) a previous export of ours. Anything else is refused before any work starts, and the
target is left exactly as it was: `--out ~` or `--out .` must never cost a user their files.

A previous export is recognised by what it carries (the rule of `maximus.ownership`, which a
run's `adapter/` / `model/` and checkpoints follow too):
- a directory (merged, adapter, ollama) holds `MARKER`, a JSON file listing every file the export
  wrote. `--overwrite` replaces it only while it holds nothing else: a file the user added since
  is named in the error, and nothing is touched;
- a single GGUF file carries `GGUF_MARKER_KEY` in its metadata.

Every export is written into a fresh temporary sibling of the target and renamed into place, so a
crash or an error halfway leaves the old target untouched and only our temporary to clean.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from maximus.errors import ExportError
from maximus.ownership import files_under, swap_in, unlisted_files

MARKER = ".maximus-export.json"
GGUF_MARKER_KEY = "maximus.export"


def _refuse_foreign(out: Path, example: str) -> ExportError:
    return ExportError(f"--out {out} already exists and holds files no Maximus export wrote (e.g. {example!r})",
                       "choose a new or empty directory; nothing was changed")


def check_directory_target(out: Path, *, overwrite: bool) -> None:
    """Raise ExportError unless `out` may receive a directory export. Reads only."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        raise ExportError(f"--out {out} exists and is not a directory", "choose a new or empty directory; nothing was changed")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    marker = out / MARKER
    if not marker.is_file():  # refuse on the first look: never walk a home directory
        raise _refuse_foreign(out, entries[0])
    try:
        written = set(json.loads(marker.read_text())["files"])
    except (ValueError, KeyError, TypeError):
        raise ExportError(f"--out {out} has an unreadable {MARKER}", "choose a new or empty directory; nothing was changed")
    extra = unlisted_files(out, written | {MARKER})
    if extra:
        raise ExportError(f"--out {out} holds a previous export plus files it did not write (e.g. {extra[0]!r})",
                          "move them away or choose another directory; nothing was changed")
    if not overwrite:
        raise ExportError(f"--out {out} holds a previous export", "pass --overwrite to replace it")


def write_directory(out: Path, fill: Callable[[Path], None], *, overwrite: bool, meta: dict) -> Path:
    """Check `out`, let `fill(tmp)` write the export into a temporary sibling, add the marker, and
    swap it into place. Returns `out`."""
    out = Path(out).absolute()
    check_directory_target(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        fill(tmp)
        files = files_under(tmp)
        (tmp / MARKER).write_text(json.dumps({**meta, "files": files}, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; an export is meant to be shared like any directory
        check_directory_target(out, overwrite=overwrite)  # again: the user may have added files meanwhile
        swap_in(tmp, out)  # onto nothing, an empty directory or a verified previous export of ours
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_file_target(out: Path, *, overwrite: bool, is_ours: Callable[[Path], bool]) -> None:
    """Raise ExportError unless `out` may receive a single-file export. Reads only."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() or out.is_symlink() or not out.is_file():
        raise ExportError(f"--out {out} exists and is not a regular file", "give a new file path; nothing was changed")
    if not is_ours(out):
        raise ExportError(f"--out {out} already exists and was not written by a Maximus export",
                          "give a new file path; nothing was changed")
    if not overwrite:
        raise ExportError(f"--out {out} holds a previous export", "pass --overwrite to replace it")


def write_file(out: Path, fill: Callable[[Path], None], *, overwrite: bool, is_ours: Callable[[Path], bool]) -> Path:
    """Check `out`, let `fill(tmp)` write the file as a temporary sibling, and rename it into place."""
    out = Path(out).absolute()
    check_file_target(out, overwrite=overwrite, is_ours=is_ours)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        fill(tmp)
        os.chmod(tmp, 0o644)
        check_file_target(out, overwrite=overwrite, is_ours=is_ours)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
