"""Child processes of the benchmarks: one row each, a failure of one row never the end of the run,
and the dry mode of the prepared GPU check (`benchmarks/gpu.sh --dry`).

    from _child import ChildFailed, Deadline, DryStop, guarded_main, run_child

    result = run_child(cmd, timeout_s=120, label="ours")   # the child's `RESULT {json}` line, parsed
    # ChildFailed (a RuntimeError): it timed out, exited non-zero or printed no result; the message
    # ends with the tail of its stderr. DryStop: a dry run reached its first CUDA use.

Dry mode (``MAXIMUS_GPU_DRY=1``, set by ``gpu.sh --dry`` together with ``CUDA_VISIBLE_DEVICES=``)
runs every script of the check on a machine without a GPU, through its real code, until its first
CUDA use: the error torch (or Maximus' device check) raises there is caught by `guarded_main`, which
prints ``DRY-STOP <file:line>`` and exits 0. A parent that gets a DRY-STOP from a child goes on to
its next child, so one dry run reaches every child of the check: a missing import, a wrong flag or a
broken call between the scripts fails in CI, not on the device.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import traceback
from pathlib import Path

DRY_ENV = "MAXIMUS_GPU_DRY"
DRY_MARK = "DRY-STOP "
RESULT_MARK = "RESULT "
REPO = Path(__file__).resolve().parent.parent
#: What a CUDA call raises where there is no GPU: a CPU-only torch build, a build that finds no
#: driver or none visible, torch's missing CUDA bindings, and Maximus' own `device: cuda` check.
_NO_CUDA = ("Torch not compiled with CUDA enabled", "No CUDA GPUs are available", "Found no NVIDIA driver",
            "has no attribute '_cuda_", "device: cuda was requested but no CUDA GPU is available")
#: Lines of a failed child's stderr shown with its row.
STDERR_TAIL_LINES = 25


def dry_run() -> bool:
    """Whether this process runs in the dry mode of the GPU check."""
    return os.environ.get(DRY_ENV) == "1"


def cuda_missing(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is the error of a CUDA use without a GPU."""
    while exc is not None:
        if any(text in str(exc) for text in _NO_CUDA):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _where(exc: BaseException) -> str:
    """`file:line (function)` of the innermost frame of this repository's code in `exc`'s traceback."""
    ours = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(str(REPO))]
    if not ours:
        return "outside this repository"
    frame = ours[-1]
    return f"{Path(frame.filename).relative_to(REPO)}:{frame.lineno} ({frame.name})"


def guarded_main(main) -> int:
    """Run `main()`; in dry mode, its first CUDA use ends it with ``DRY-STOP <where>`` and exit 0.
    Any other error propagates (a traceback, a non-zero exit), in dry mode too."""
    try:
        return main()
    except BaseException as exc:
        if not (dry_run() and cuda_missing(exc)):
            raise
        print(f"{DRY_MARK}{_where(exc)}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", flush=True)
        return 0


class ChildFailed(RuntimeError):
    """A child timed out, exited non-zero or printed no result; the message ends with its stderr tail."""


class DryStop(Exception):
    """A dry-mode child reached its first CUDA use (``where``: the line)."""

    def __init__(self, label: str, where: str):
        super().__init__(f"{label}: dry run stopped at the first CUDA use, {where}")
        self.where = where


def _text(stream) -> str:
    # TimeoutExpired carries bytes even when the child ran with text=True.
    if isinstance(stream, bytes):
        return stream.decode("utf-8", "replace")
    return stream or ""


def _tail(text: str) -> str:
    return "\n".join(text.strip().splitlines()[-STDERR_TAIL_LINES:]) or "(no output)"


def run_child(cmd: list[str], timeout_s: float, label: str, env: dict | None = None) -> dict:
    """Run `cmd` and return the JSON of its last ``RESULT `` line. Raises ChildFailed on a timeout
    (``timeout_s`` seconds), a non-zero exit or no result, and DryStop where a dry child stopped."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:
        raise ChildFailed(f"{label} timed out after {timeout_s:.0f} s; its stderr ended:\n"
                          f"{_tail(_text(exc.stderr) or _text(exc.stdout))}") from None
    out = proc.stdout.splitlines()
    results = [ln for ln in out if ln.startswith(RESULT_MARK)]
    if proc.returncode == 0 and results:
        return json.loads(results[-1][len(RESULT_MARK):])
    stops = [ln for ln in out if ln.startswith(DRY_MARK)]
    if proc.returncode == 0 and stops:
        raise DryStop(label, stops[-1][len(DRY_MARK):])
    raise ChildFailed(f"{label} failed (exit {proc.returncode}); its stderr ended:\n{_tail(proc.stderr or proc.stdout)}")


class Deadline:
    """A wall-clock budget shared by a run's children, so the children's timeouts never add up to
    more than the time the caller gave the whole run (``seconds``; None: no budget)."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left_s(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()

    def child_timeout(self, cap_s: float, keep_s: float = 0.0) -> float:
        """A child's timeout: ``cap_s``, or less where the budget minus ``keep_s`` (reserved for the
        children after it) is smaller. Raises ChildFailed when under 10 s would be left."""
        timeout = min(cap_s, self.left_s() - keep_s)
        if timeout < 10:
            raise ChildFailed(f"skipped: {max(0.0, self.left_s()):.0f} s of the run's time budget left")
        return timeout


def host_memory_line() -> str:
    """The host memory this machine has, in GiB (total and available now), for the printed header."""
    import psutil

    vm = psutil.virtual_memory()
    return f"host memory: {vm.total / 2**30:.1f} GiB total, {vm.available / 2**30:.1f} GiB available"
