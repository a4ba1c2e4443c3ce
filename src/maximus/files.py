"""Files Maximus writes: through a temporary file and a rename, so that no reader ever sees half
of one (`write_json`, `fsync_dir`), and where it keeps what it builds once (`cache_root`). The
base floor: imports nothing of Maximus."""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["cache_root", "fsync_dir", "write_json"]


def cache_root() -> Path:
    """Where built models and streamed weights are kept: ``$MAXIMUS_CACHE``, else ~/.cache/maximus."""
    return Path(os.environ.get("MAXIMUS_CACHE", Path.home() / ".cache" / "maximus"))


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that a rename inside it survives a crash (a no-op where unsupported)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_json(path: Path, data) -> None:
    """Write JSON through a temporary file and rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
