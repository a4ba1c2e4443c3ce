"""One run per output directory: an advisory lock the kernel drops when the process dies."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from maximus.errors import CheckpointError

LOCK_NAME = ".maximus.lock"


def in_use(run_dir: Path, owner: str, error: type[CheckpointError] | type = CheckpointError):
    """The one line that refuses a second run on `run_dir`; `owner` says whose it is ("pid 123")."""
    return error(f"output_dir {run_dir} is in use by another run ({owner})",
                 "wait for it to finish, stop it, or choose another output_dir")


class RunLock:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise in_use(self.run_dir, f"pid {owner}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
