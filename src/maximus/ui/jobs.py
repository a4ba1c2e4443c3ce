"""The child processes `maximus ui` starts: `maximus-train` runs and `maximus export`s.

A child runs in its own session (``start_new_session``), so closing the tab, Ctrl-C in the
server's terminal or a server restart does not stop it. What the server knows about a child lives
under ``<runs>/.maximus-ui/<run name>/`` (a dot directory: never listed as a run):

- ``config.yaml``: the confined config the run was started with (a resume starts from it again);
- ``train.log`` / ``export-<id>.log``: the child's stdout and stderr, appended to by a resume;
- ``train.json`` / ``export-<id>.json``: its argv, pid, start time and, once it ended, its exit code
  (75 = stopped by a signal after a checkpoint, as `maximus-train` exits).

One run per output directory: the server refuses a second start while its own child lives, and the
trainer's output-dir lock refuses any other process. Stop sends SIGTERM to the run's process (the
server's own child, or the pid in the trainer's lock file while the lock is held): the trainer
finishes the step, checkpoints and exits 75. Resume starts the same command again, which resumes
from the newest good checkpoint.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote

import yaml

from maximus.errors import MaximusError
from maximus.train.checkpoint import write_json
from maximus.train.lock import LOCK_NAME
from maximus.ui.runs import lock_is_held

__all__ = ["Jobs", "Conflict", "STATE_DIR"]

STATE_DIR = ".maximus-ui"
LOG_TAIL_BYTES = 4096


class Conflict(MaximusError):
    """The run is not in a state that allows this (already running, not running, finished)."""


class Jobs:
    """Start, watch and stop the children of one server. `train_argv` / `export_argv` are the
    commands (default: this Python's `maximus train` / `maximus export`)."""

    def __init__(self, runs_root: Path, *, train_argv: list[str] | None = None, export_argv: list[str] | None = None):
        self.root = Path(runs_root).resolve()
        self.train_argv = list(train_argv or [sys.executable, "-m", "maximus.cli", "train"])
        self.export_argv = list(export_argv or [sys.executable, "-m", "maximus.cli", "export"])
        self._procs: dict[tuple[str, str], subprocess.Popen] = {}
        self._stopping: set[str] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ state on disk
    def state_dir(self, name: str) -> Path:
        return self.root / STATE_DIR / quote(name, safe="")

    def launched(self) -> list[str]:
        """Names of the runs this server (or an earlier one on the same --runs) started."""
        base = self.root / STATE_DIR
        if not base.is_dir():
            return []
        from urllib.parse import unquote

        return sorted(unquote(p.name) for p in base.iterdir() if (p / "config.yaml").is_file())

    def config(self, name: str) -> dict | None:
        path = self.state_dir(name) / "config.yaml"
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            return None
        return data if isinstance(data, dict) else None

    def record(self, kind: str, name: str) -> dict | None:
        try:
            data = json.loads((self.state_dir(name) / f"{kind}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def log_tail(self, kind: str, name: str) -> str:
        path = self.state_dir(name) / f"{kind}.log"
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - LOG_TAIL_BYTES))
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    # ------------------------------------------------------------------ processes
    def alive(self, kind: str, name: str) -> bool:
        proc = self._procs.get((kind, name))
        if proc is not None:
            return proc.poll() is None
        rec = self.record(kind, name)  # a child of an earlier server on the same --runs
        return bool(rec and rec.get("exit_code") is None and rec.get("pid") and _pid_alive(rec["pid"])
                    and (kind != "train" or lock_is_held(self.root / name)))

    def start_train(self, name: str, run_dir: Path, config: dict | None) -> None:
        """Start `maximus-train` on `config` (written to the state directory), or with None on the
        config already there (resume)."""
        with self._lock:
            if self.alive("train", name) or lock_is_held(run_dir):
                raise Conflict(f"run {name} is running", "stop it first, or choose another output_dir")
            state = self.state_dir(name)
            state.mkdir(parents=True, exist_ok=True)
            if config is not None:
                tmp = state / ".config.yaml.tmp"
                tmp.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
                os.replace(tmp, state / "config.yaml")
            self._stopping.discard(name)
            self._spawn("train", name, self.train_argv + ["--config", str(state / "config.yaml")])

    def start_export(self, name: str, export_id: str, args: list[str]) -> None:
        kind = f"export-{export_id}"
        with self._lock:
            if self.alive(kind, name):
                raise Conflict(f"the {export_id} export of {name} is already running", "wait for it to finish")
            self.state_dir(name).mkdir(parents=True, exist_ok=True)
            self._spawn(kind, name, self.export_argv + args)

    def _spawn(self, kind: str, name: str, argv: list[str]) -> None:
        state = self.state_dir(name)
        with open(state / f"{kind}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        record = {"argv": argv, "pid": proc.pid, "started": time.time(), "exit_code": None}
        write_json(state / f"{kind}.json", record)
        self._procs[(kind, name)] = proc
        threading.Thread(target=self._reap, args=(state / f"{kind}.json", proc, record), daemon=True).start()

    @staticmethod
    def _reap(path: Path, proc: subprocess.Popen, record: dict) -> None:
        code = proc.wait()
        write_json(path, {**record, "exit_code": code, "ended": time.time()})

    def wait(self, kind: str, name: str, timeout: float | None = None) -> int | None:
        """The exit code of this server's child once its record says it ended (tests, shutdown)."""
        proc = self._procs.get((kind, name))
        if proc is None:
            return None
        code = proc.wait(timeout)
        deadline = time.time() + 10
        while (self.record(kind, name) or {}).get("exit_code") is None and time.time() < deadline:
            time.sleep(0.02)
        return code

    def stop(self, name: str, run_dir: Path) -> None:
        """SIGTERM to the run's trainer: it checkpoints after the step and exits 75."""
        proc = self._procs.get(("train", name))
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            self._stopping.add(name)
            return
        if lock_is_held(run_dir):
            try:
                pid = int((run_dir / LOCK_NAME).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                raise Conflict(f"run {name} is running, but its lock file names no process",
                               "stop it where it was started") from None
            os.kill(pid, signal.SIGTERM)
            self._stopping.add(name)
            return
        raise Conflict(f"run {name} is not running", "only a running run can be stopped")

    def status(self, name: str, from_files: str) -> str:
        """The run's status: the files' (`maximus.ui.runs.run_status`), or `starting` while this
        server's child loads before it takes the lock, `stopping` after a stop until it exits."""
        if self.alive("train", name):
            if name in self._stopping:
                return "stopping"
            return "running" if from_files == "running" else "starting"
        return from_files


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return True
