"""The child processes `maximus ui` starts: `maximus-train` runs and `maximus export`s.

A child runs in its own session (``start_new_session``), so closing the tab, Ctrl-C in the
server's terminal or a server restart does not stop it. What the server knows about a child lives
under ``<runs>/.maximus-ui/<run name>/`` (a dot directory: never listed as a run):

- ``config.yaml``: the confined config the run was started with (a resume starts from it again);
- ``train.log`` / ``export-<id>.log``: the child's stdout and stderr, appended to by a resume;
- ``train.json`` / ``export-<id>.json``: its argv, pid, start time and, once it ended, its exit code
  (75 = stopped by a signal after a checkpoint, as `maximus-train` exits);
- ``export-<id>.progress.json``: the export's stage (`maximus export --progress`);

and ``<runs>/.maximus-ui/.queue.json``: the runs waiting for a slot, in order.

The queue: the server runs at most `slots` of its own runs at once (one per CUDA device, one on a
machine without; with several devices each child sees only its own, through
``CUDA_VISIBLE_DEVICES``). A start or resume beyond that waits as ``queued`` and starts when a run
of this server ends, whether it finished, stopped or failed; a queued run can be cancelled. The
queue is written to ``.queue.json`` on every change, so a server started again on the same
``--runs`` picks it up (`start_queue`), counting the runs an earlier server started whose
children still live. Every entry read from the file passes `admit` first (the server's guard,
with its current roots and ``--allow-code``: the file may come from a server started with other
flags, or from someone's editor): an entry it refuses leaves the queue, never starts, and shows
as ``refused`` with the guard's line in its log. Runs started elsewhere (the CLI) take no slot.
One server per ``--runs``: two would each move their own copy of the queue.

One run per output directory: the server refuses a second start while its own child lives or waits
in the queue, and the trainer's output-dir lock refuses any other process; both with the lock's
own line (`maximus.train.lock.in_use`). Stop sends SIGTERM to the run's process (the
server's own child, or the pid in the trainer's lock file while the lock is held): the trainer
finishes the step, checkpoints and exits 75. Resume starts the same command again, which resumes
from the newest good checkpoint.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import yaml

from maximus.errors import MaximusError
from maximus.files import write_json
from maximus.train.lock import LOCK_NAME, in_use
from maximus.ui.runs import lock_is_held, read_json

__all__ = ["Jobs", "Conflict", "STATE_DIR", "QUEUE_NAME", "cuda_devices"]

STATE_DIR = ".maximus-ui"
QUEUE_NAME = ".queue.json"
LOG_TAIL_BYTES = 4096
QUEUE_POLL_SECONDS = 1.0  # how often the queue looks for a slot freed by an earlier server's child


def cuda_devices() -> list[str]:
    """The CUDA device ids this process may use (``CUDA_VISIBLE_DEVICES`` order); [] without CUDA."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return (visible or [str(i) for i in range(count)])[:count]


class Conflict(MaximusError):
    """The run is not in a state that allows this (already running, not running, finished)."""


class Jobs:
    """Start, queue, watch and stop the children of one server. `admit(name, run_dir, config)`:
    the config a saved queue entry may run, checked as a posted one is (raises `MaximusError` to
    refuse it); `train_argv` / `export_argv` are the commands (default: this Python's `maximus
    train` / `maximus export`); `slots`: how many runs at once (default: one per CUDA device, one
    without). Reading the state starts nothing: the queue moves once `start_queue` is called (the
    app does)."""

    def __init__(self, runs_root: Path, *, admit: Callable[[str, Path, dict], dict],
                 train_argv: list[str] | None = None, export_argv: list[str] | None = None, slots: int | None = None):
        self.root = Path(runs_root).resolve()
        self.train_argv = list(train_argv or [sys.executable, "-m", "maximus.cli", "train"])
        self.export_argv = list(export_argv or [sys.executable, "-m", "maximus.cli", "export"])
        self.devices = cuda_devices()
        self.slots = slots or max(1, len(self.devices))
        self._procs: dict[tuple[str, str], subprocess.Popen] = {}
        self._stopping: set[str] = set()
        self._lock = threading.RLock()  # the reaper thread advances the queue while a request may too
        self._queue: list[dict] = self._read_queue(admit)
        self._watching = False

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
        return read_json(self.state_dir(name) / f"{kind}.json")

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
        if not (rec and rec.get("exit_code") is None and rec.get("pid") and _pid_alive(rec["pid"])):
            return False
        # A pid can be reused once its child is gone: a trainer is ours while it holds the run's lock,
        # or (still loading) while its command line names the config it was started with.
        return kind != "train" or lock_is_held(self.root / name) or str(self.state_dir(name) / "config.yaml") in _argv(rec["pid"])

    # ------------------------------------------------------------------ the queue
    def _queue_path(self) -> Path:
        return self.root / STATE_DIR / QUEUE_NAME

    def _read_queue(self, admit: Callable[[str, Path, dict], dict]) -> list[dict]:
        """The saved queue, each entry re-checked by `admit`; a refused one is marked and left out."""
        entries = (read_json(self._queue_path()) or {}).get("queue")
        queue, refused = [], False
        for e in entries or []:
            if not (isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("run_dir"), str)
                    and isinstance(e.get("config"), dict)):
                refused = True
                continue
            try:
                queue.append({**e, "config": admit(e["name"], Path(e["run_dir"]), e["config"])})
            except MaximusError as exc:
                refused = True
                self._refuse(e["name"], e["config"], exc.one_line())
        if refused:
            self._queue = queue
            self._write_queue()
        return queue

    def _write_queue(self) -> None:
        self._queue_path().parent.mkdir(parents=True, exist_ok=True)
        write_json(self._queue_path(), {"queue": self._queue})

    def queued(self) -> list[str]:
        """The names waiting, first to start first."""
        return [e["name"] for e in self._queue]

    def position(self, name: str) -> int | None:
        """1 for the next run to start, None when `name` is not queued."""
        return next((i + 1 for i, e in enumerate(self._queue) if e["name"] == name), None)

    def queued_config(self, name: str) -> dict | None:
        return next((e["config"] for e in self._queue if e["name"] == name), None)

    def running(self) -> list[str]:
        """The runs of this server (or an earlier one on the same --runs) whose child lives: each holds a slot."""
        return [n for n in self.launched() if self.alive("train", n)]

    def submit(self, name: str, run_dir: Path, config: dict, *, resume: bool = False) -> int | None:
        """Start `maximus-train` on `config` now if a slot is free and no run waits, else queue it.
        Returns the queue position, or None when it started. Raises `Conflict` (the lock's line)
        while the output dir is in use by a run or by a queued one."""
        with self._lock:
            self.refuse_in_use(name, Path(run_dir))
            if not self._queue and len(self.running()) < self.slots:
                self._start(name, Path(run_dir), config)
                return None
            self._queue.append({"name": name, "run_dir": str(run_dir), "config": config, "resume": resume,
                                "queued": time.time()})
            self._write_queue()
            return len(self._queue)

    def cancel(self, name: str) -> None:
        """Take `name` out of the queue (a queued resume leaves the run as it was)."""
        with self._lock:
            if self.position(name) is None:
                raise Conflict(f"run {name} is not queued", "only a queued run can be cancelled; stop a running one")
            self._queue = [e for e in self._queue if e["name"] != name]
            self._write_queue()

    def advance(self) -> None:
        """Start queued runs, in order, while slots are free. A run whose output dir is busy (a
        run started elsewhere holds its lock) keeps its place and lets the next one by."""
        with self._lock:
            free = self.slots - len(self.running())
            for entry in list(self._queue):
                if free <= 0:
                    break
                name, run_dir = entry["name"], Path(entry["run_dir"])
                if self.alive("train", name) or lock_is_held(run_dir):
                    continue
                self._queue.remove(entry)
                self._write_queue()  # before the child exists: a crash now loses this run, never starts it twice
                if not entry.get("resume") and run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
                    self._fail(name, entry["config"], f"output_dir {run_dir} was filled while this run waited "
                               "(hint: start it again with another output_dir)")
                    continue
                self._start(name, run_dir, entry["config"])
                free -= 1

    def start_queue(self) -> None:
        """Move the queue now and from now on: on every exit of a child of ours, and every
        `QUEUE_POLL_SECONDS` for the children of an earlier server (no reaper sees them end)."""
        self.advance()
        if not self._watching:
            self._watching = True
            threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(QUEUE_POLL_SECONDS)
            if self._queue:
                self.advance()

    def refuse_in_use(self, name: str, run_dir: Path) -> None:
        """Raise `Conflict` with the lock's line while `run_dir` is in use by a run or a queued one."""
        proc = self._procs.get(("train", name))
        if proc is not None and proc.poll() is None:
            raise in_use(run_dir, f"pid {proc.pid}", Conflict)
        if lock_is_held(run_dir) or self.alive("train", name):
            raise in_use(run_dir, f"pid {_lock_owner(run_dir) or (self.record('train', name) or {}).get('pid')}", Conflict)
        for i, entry in enumerate(self._queue):
            if Path(entry["run_dir"]) == run_dir:
                raise in_use(run_dir, f"run {entry['name']}, queued at position {i + 1}", Conflict)

    def _write_config(self, name: str, config: dict) -> Path:
        state = self.state_dir(name)
        state.mkdir(parents=True, exist_ok=True)
        tmp = state / ".config.yaml.tmp"
        tmp.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        os.replace(tmp, state / "config.yaml")
        return state / "config.yaml"

    def _start(self, name: str, run_dir: Path, config: dict) -> None:
        path = self._write_config(name, config)
        self._stopping.discard(name)
        env, device = {}, None
        if len(self.devices) > 1:  # one device per run; one device alone is left as it is
            used = {(self.record("train", n) or {}).get("device") for n in self.running()}
            device = next((d for d in self.devices if d not in used), self.devices[0])
            env = {"CUDA_VISIBLE_DEVICES": device}
        self._spawn("train", name, self.train_argv + ["--config", str(path)], env=env, extra={"device": device})

    def _fail(self, name: str, config: dict, line: str) -> None:
        """Record a queued run that could not start: failed, with the reason as its output."""
        self._write_config(name, config)
        state = self.state_dir(name)
        with open(state / "train.log", "a", encoding="utf-8") as log:
            log.write(f"error: {line}\n")
        now = time.time()
        write_json(state / "train.json", {"argv": [], "pid": None, "started": now, "exit_code": 2, "ended": now})

    def _refuse(self, name: str, config: dict, line: str) -> None:
        """Mark a saved queue entry the guard refused: status ``refused``, the line in its log. A
        name that is no run directory under --runs gets no mark (there is no safe place for one)."""
        if not self._is_run_name(name):
            print(f"maximus ui: refused queued run {name!r}: {line}", file=sys.stderr, flush=True)
            return
        self._write_config(name, config)
        state = self.state_dir(name)
        with open(state / "train.log", "a", encoding="utf-8") as log:
            log.write(f"refused: {line}\n")
        now = time.time()
        write_json(state / "train.json", {"argv": [], "pid": None, "started": now, "exit_code": None, "ended": now,
                                          "refused": line})

    def _is_run_name(self, name: str) -> bool:
        path = (self.root / name).resolve()
        return (bool(name) and not Path(name).is_absolute() and ".." not in Path(name).parts
                and path.is_relative_to(self.root) and path != self.root
                and not path.is_relative_to(self.root / STATE_DIR))

    def start_export(self, name: str, export_id: str, args: list[str]) -> None:
        """`maximus export ARGS --progress <state>/export-<id>.progress.json`."""
        kind = f"export-{export_id}"
        with self._lock:
            if self.alive(kind, name):
                raise Conflict(f"the {export_id} export of {name} is already running", "wait for it to finish")
            self.state_dir(name).mkdir(parents=True, exist_ok=True)
            progress = self.state_dir(name) / f"{kind}.progress.json"
            progress.unlink(missing_ok=True)  # the previous export's
            self._spawn(kind, name, self.export_argv + args + ["--progress", str(progress)])

    def export_progress(self, name: str, export_id: str) -> dict | None:
        """What `maximus export --progress` last wrote: stage, done, total, text."""
        return read_json(self.state_dir(name) / f"export-{export_id}.progress.json")

    def _spawn(self, kind: str, name: str, argv: list[str], env: dict | None = None, extra: dict | None = None) -> None:
        state = self.state_dir(name)
        with open(state / f"{kind}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        record = {"argv": argv, "pid": proc.pid, "started": time.time(), "exit_code": None, **(extra or {})}
        write_json(state / f"{kind}.json", record)
        self._procs[(kind, name)] = proc
        threading.Thread(target=self._reap, args=(kind, state / f"{kind}.json", proc, record), daemon=True).start()

    def _reap(self, kind: str, path: Path, proc: subprocess.Popen, record: dict) -> None:
        code = proc.wait()
        write_json(path, {**record, "exit_code": code, "ended": time.time()})
        if kind == "train" and self._watching:
            self.advance()  # its slot is free: the next queued run starts now

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
            pid = _lock_owner(run_dir)
            if pid is None:
                raise Conflict(f"run {name} is running, but its lock file names no process",
                               "stop it where it was started")
            os.kill(pid, signal.SIGTERM)
            self._stopping.add(name)
            return
        if self.position(name) is not None:
            raise Conflict(f"run {name} is queued, not running", f"cancel it: POST /api/runs/{name}/cancel")
        raise Conflict(f"run {name} is not running", "only a running run can be stopped")

    def status(self, name: str, from_files: str) -> str:
        """The run's status: the files' (`maximus.ui.runs.run_status`), or `queued` while it waits
        for a slot, `starting` while this server's child loads before it takes the lock, `stopping`
        after a stop until it exits, `refused` when the guard refused its saved queue entry and
        nothing ran since."""
        if self.position(name) is not None:
            return "queued"
        if self.alive("train", name):
            if name in self._stopping:
                return "stopping"
            return "running" if from_files == "running" else "starting"
        if from_files == "failed" and (self.record("train", name) or {}).get("refused"):
            return "refused"
        return from_files


def _lock_owner(run_dir: Path) -> int | None:
    """The pid the trainer wrote into its lock file."""
    try:
        return int((run_dir / LOCK_NAME).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _argv(pid: int) -> list[str]:
    """The command line of a process (Linux /proc); [] where it cannot be read."""
    try:
        return Path(f"/proc/{int(pid)}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (OSError, ValueError):
        return []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return True
