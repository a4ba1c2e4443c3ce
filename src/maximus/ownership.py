"""What Maximus may replace or remove: only the files a record of ours says we wrote.

One rule for every command that writes a directory a user could also have written into
(`maximus export --out`, a run's `adapter/` or `model/`, a checkpoint's `step-N/`): a directory
is ours to replace only while every file in it is named by the record we wrote beside it (the
export's marker, the run marker's file list, the checkpoint's manifest). A file we did not list
means a person put it there: we refuse, and nothing is touched.

`swap_in` puts a freshly written temporary sibling in place of such a directory: rename the old
one aside, rename the new one in, then remove the old one (never half of either in place).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = ["files_under", "unlisted_files", "swap_in"]


def files_under(directory: Path) -> list[str]:
    """Every file under `directory` (symlinks count as files, never followed), as sorted
    posix paths relative to it."""
    directory = Path(directory)
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if not p.is_dir() or p.is_symlink())


def unlisted_files(directory: Path, listed: Iterable[str]) -> list[str]:
    """The files under `directory` that `listed` (relative posix paths) does not name: what a
    person added to a directory of ours. Empty when the directory is absent."""
    directory = Path(directory)
    if not directory.exists() and not directory.is_symlink():
        return []
    if directory.is_symlink() or not directory.is_dir():
        return [directory.name]
    names = set(listed)
    return [f for f in files_under(directory) if f not in names]


def swap_in(tmp: Path, final: Path) -> None:
    """Rename the directory `tmp` to `final`. An existing `final` (checked by the caller to be
    ours: `unlisted_files`) is renamed aside first and removed once the new one is in place, so a
    crash leaves the old or the new directory at `final`, never a mix."""
    tmp, final = Path(tmp), Path(final)
    if not final.exists():
        os.replace(tmp, final)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
    os.replace(final, old)  # onto the empty directory mkdtemp made: a unique name no one else holds
    os.replace(tmp, final)
    shutil.rmtree(old)
