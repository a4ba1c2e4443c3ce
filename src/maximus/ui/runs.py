"""What `maximus ui` knows about run directories, read without ever writing into one.

A run directory is any directory under ``--runs`` that holds ``metrics.jsonl``, ``run.json`` or the
output-dir lock. Its status comes from the files the trainer leaves:

- ``running``: the output-dir lock (``.maximus.lock``) is held by a live process. The lock is an
  ``flock`` the kernel drops when its process dies, so a shared, non-blocking probe answers
  exactly; the probe opens the file read-only and never creates it.
- ``finished``: ``run.json`` exists (the trainer writes it only after the last step and eval).
- ``interrupted``: no ``run.json``, but a checkpoint exists: a signal, a kill or a crash stopped it
  after a save, and the same command resumes it.
- ``failed``: no ``run.json`` and no checkpoint: it stopped before its first save.

Paths are confined to the root: a name that resolves outside it (``..``, an absolute path, a
symlink pointing out) is not a run (`confined_run_dir` returns None and the app answers 404).
"""
from __future__ import annotations

import fcntl
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maximus.train.lock import LOCK_NAME

RUN_MARKERS = ("metrics.jsonl", "run.json", LOCK_NAME)


def confined_run_dir(root: Path, name: str) -> Path | None:
    """The run directory `name` under `root`, or None when it is not one or lies outside `root`."""
    if not name or "\x00" in name or name.startswith(("/", "\\")):
        return None
    root = root.resolve()
    path = (root / name).resolve()  # follows symlinks: a link out of root resolves outside it
    if path == root or not path.is_relative_to(root) or not path.is_dir():
        return None
    if not any((path / m).exists() for m in RUN_MARKERS):
        return None
    return path


def lock_is_held(run_dir: Path) -> bool:
    """True while a trainer holds the run's output-dir lock. Read-only: never creates the file."""
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def read_json(path: Path) -> dict | None:
    """A JSON file the trainer writes atomically; None when absent or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_metrics(run_dir: Path, since: int = 0) -> list[dict]:
    """Rows of metrics.jsonl from line `since` on. A last line still being written is left for the
    next poll (it is only returned once it ends with a newline)."""
    path = run_dir / "metrics.jsonl"
    try:
        data = path.read_bytes()
    except OSError:
        return []
    lines = data.split(b"\n")[:-1]  # the part after the last newline is incomplete
    rows = []
    for line in lines[since:]:
        try:
            row = json.loads(line)
        except ValueError:
            row = {}  # a line cut by a kill: keep the line count aligned with the file
        rows.append(_finite(row) if isinstance(row, dict) else {})
    return rows


def _finite(row: dict) -> dict:
    # JSON from Python may hold NaN / Infinity (a skipped step); the browser's JSON.parse rejects them.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


@dataclass(frozen=True)
class RunInfo:
    """One row of the runs page."""

    name: str
    status: str
    model: str | None
    method: str | None
    steps_done: int
    steps_total: int | None
    best_eval_loss: float | None
    peak_bytes: int | None
    budget_bytes: int | None
    predicted_peak_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def run_status(run_dir: Path, summary: dict | None = None) -> str:
    if lock_is_held(run_dir):
        return "running"
    if summary is None:
        summary = read_json(run_dir / "run.json")
    if summary is not None:
        return "finished"
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir() and any(p.name.startswith("step-") for p in ckpts.iterdir()):
        return "interrupted"
    return "failed"


def run_info(root: Path, run_dir: Path) -> RunInfo:
    summary = read_json(run_dir / "run.json")
    live = read_json(run_dir / "plan.json") or {}
    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows if "loss" in r and isinstance(r.get("step"), int)]
    evals = [r["eval_loss"] for r in rows if isinstance(r.get("eval_loss"), (int, float))]
    peaks = [r["peak_memory_bytes"] for r in rows if isinstance(r.get("peak_memory_bytes"), int)]
    status = run_status(run_dir, summary)
    # A run started again in the same output_dir: run.json is still the previous run's until it ends.
    source = live if (status == "running" and live) else (summary or live)
    config = source.get("config") or {}
    plan = source.get("plan") or {}
    memory = (summary or {}).get("memory") or {}
    after = ((summary or {}).get("eval") or {}).get("after") or {}
    if isinstance(after.get("loss"), (int, float)):
        evals.append(after["loss"])
    return RunInfo(
        name=run_dir.relative_to(root.resolve()).as_posix(),
        status=status,
        model=config.get("model"),
        method=source.get("method") or config.get("method"),
        steps_done=max(steps, default=0),
        steps_total=(summary or {}).get("steps") or live.get("steps"),
        best_eval_loss=min(evals) if evals else None,
        peak_bytes=memory.get("peak_bytes") or (max(peaks) if peaks else None),
        budget_bytes=memory.get("budget_bytes") or plan.get("budget_bytes"),
        predicted_peak_bytes=plan.get("peak_bytes"),
    )


def list_runs(root: Path, max_depth: int = 3) -> list[RunInfo]:
    """Every run directory under `root` (down to `max_depth` levels), newest first. Symlinked
    directories are not followed, so a link out of `root` is never listed."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: list[tuple[float, Path]] = []
    base = len(root.resolve().parts)
    for dirpath, dirnames, filenames in os.walk(root.resolve()):
        here = Path(dirpath)
        depth = len(here.parts) - base
        if depth > 0 and any(m in filenames for m in RUN_MARKERS):
            found.append((max((here / m).stat().st_mtime for m in RUN_MARKERS if (here / m).exists()), here))
            dirnames[:] = []  # a run's own subdirectories (checkpoints/, adapter/) are not runs
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not (here / d).is_symlink()) \
            if depth < max_depth else []
    found.sort(key=lambda t: -t[0])
    return [run_info(root, path) for _, path in found]


def run_detail(root: Path, run_dir: Path) -> dict[str, Any]:
    """Everything the run page shows, except the metric rows (polled separately)."""
    summary = read_json(run_dir / "run.json") or {}
    live = read_json(run_dir / "plan.json") or {}
    info = run_info(root, run_dir)
    ev = summary.get("eval") or {}
    return {
        "info": info.to_dict(),
        "config": summary.get("config") or live.get("config"),
        "plan": summary.get("plan") or live.get("plan"),
        "eval_before": ev.get("before") or {},
        "eval_after": ev.get("after") or {},
        "eval_prompted": ev.get("prompted") or {},
        "verdict": (ev.get("verdict") or {}).get("text"),
        "memory": summary.get("memory"),
        "replans": summary.get("replans"),
        "has_loss_png": (run_dir / "loss.png").is_file(),
    }
