"""Atomic, verified checkpoints: nothing a crash, a kill or a full disk does can damage the last good one.

Layout: ``checkpoints/step-000010/`` with
- ``trainable.safetensors``: the trainable parameters (adapter or full weights), by parameter name;
- ``optimizer.safetensors`` + ``optimizer.json``: optimizer tensors and the rest of its state;
- ``state.json``: step, data position, scheduler, RNG, eval-before results, anything the loop needs;
- ``rng.safetensors``: torch CPU (and CUDA) RNG states;
- ``manifest.json`` (written last): size and sha256 of every file.

A checkpoint is written into a hidden temporary directory, every file fsynced, then renamed into
place (atomic on POSIX) and the parent directory fsynced. No pickle anywhere: loading a checkpoint
cannot execute code.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from maximus.errors import CheckpointError
from maximus.files import fsync_dir, write_json
from maximus.ownership import swap_in, unlisted_files

_STEP_DIR = re.compile(r"^step-(\d{6,})$")
MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))


def _optimizer_split(optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state_dict into tensors (safetensors) and plain JSON."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain_state: dict[str, dict] = {}
    for idx, st in sd["state"].items():
        plain_state[str(idx)] = {}
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value
            else:
                plain_state[str(idx)][key] = value
    return tensors, {"state": plain_state, "param_groups": sd["param_groups"]}


def _optimizer_join(tensors: dict[str, torch.Tensor], plain: dict) -> dict:
    state: dict[int, dict] = {int(i): dict(v) for i, v in plain["state"].items()}
    for name, t in tensors.items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = t
    return {"state": state, "param_groups": plain["param_groups"]}


def rng_state() -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = s
    return out


def set_rng_state(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["torch_cpu"])
    cuda = [states[k] for k in sorted(k for k in states if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@dataclass
class Checkpoint:
    path: Path
    step: int

    def load_state(self) -> dict:
        return json.loads((self.path / "state.json").read_text())

    def restore(self, model, optimizer=None) -> dict:
        """Load trainable params (and optimizer, RNG) in place; return the loop state."""
        params = load_file(str(self.path / "trainable.safetensors"))
        named = dict(model.named_parameters())
        missing = [n for n in params if n not in named]
        if missing:
            raise CheckpointError(f"checkpoint {self.path} does not match the model: unknown parameter {missing[0]}",
                                  "resume with the same model and adapter settings, or use a new output_dir")
        with torch.no_grad():
            for n, t in params.items():
                named[n].copy_(t.to(named[n].device, named[n].dtype))
        if optimizer is not None and (self.path / "optimizer.safetensors").exists():
            plain = json.loads((self.path / "optimizer.json").read_text())
            tensors = load_file(str(self.path / "optimizer.safetensors"))
            optimizer.load_state_dict(_optimizer_join(tensors, plain))
        set_rng_state(load_file(str(self.path / "rng.safetensors")))
        return self.load_state()


def save_checkpoint(root: Path, step: int, model, optimizer, state: dict, keep: int) -> Checkpoint:
    """Write checkpoint `step` atomically under `root` and prune to the newest `keep`.

    Any OSError (disk full, I/O error) leaves the earlier checkpoints untouched and is raised as a
    one-line CheckpointError."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    foreign = foreign_files(final)
    if foreign:  # re-saving a step (a resumed run's last) replaces only a checkpoint of ours
        raise CheckpointError(f"{final} holds files no checkpoint wrote (e.g. {foreign[0]!r})",
                              f"move them out of {final} and run again; nothing was removed")
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        _save_tensors(trainable_state(model), tmp / "trainable.safetensors")
        if optimizer is not None:
            tensors, plain = _optimizer_split(optimizer)
            _save_tensors(tensors, tmp / "optimizer.safetensors")
            write_json(tmp / "optimizer.json", plain)
        _save_tensors(rng_state(), tmp / "rng.safetensors")
        write_json(tmp / "state.json", {**state, "step": step})
        files = {}
        for f in sorted(tmp.iterdir()):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            files[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        write_json(tmp / MANIFEST, {"step": step, "files": files})
        fsync_dir(tmp)
        swap_in(tmp, final)
        fsync_dir(root)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {final}: {exc.strerror or exc}",
                              "free disk space; the previous checkpoint is intact and the run can resume from it") from None
    for old in list_checkpoints(root)[:-keep]:
        if not foreign_files(old.path):  # one a person added files to is kept
            shutil.rmtree(old.path, ignore_errors=True)
    return Checkpoint(final, step)


def foreign_files(step_dir: Path) -> list[str]:
    """The files under `step_dir` its manifest does not list (all of them without a readable
    manifest): what makes it not ours to remove (`maximus.ownership`)."""
    try:
        listed = set(json.loads((step_dir / MANIFEST).read_text())["files"]) | {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError):
        listed = set()
    return unlisted_files(step_dir, listed)


def list_checkpoints(root: Path) -> list[Checkpoint]:
    """Complete checkpoints (those with a manifest), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / MANIFEST).is_file():
            found.append(Checkpoint(d, int(m.group(1))))
    return sorted(found, key=lambda c: c.step)


def verify(ckpt: Checkpoint) -> str | None:
    """None when every file matches the manifest, else what is wrong."""
    try:
        manifest = json.loads((ckpt.path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    for name, meta in manifest.get("files", {}).items():
        f = ckpt.path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != meta["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, expected {meta['bytes']}"
        if _sha256(f) != meta["sha256"]:
            return f"{name} fails its checksum"
    return None


def latest_good_checkpoint(root: Path, warn=print) -> Checkpoint | None:
    """The newest checkpoint that verifies; corrupt newer ones are reported through `warn` and skipped."""
    for ckpt in reversed(list_checkpoints(root)):
        problem = verify(ckpt)
        if problem is None:
            return ckpt
        warn(f"warning: skipping corrupt checkpoint {ckpt.path.name}: {problem}; falling back to the previous one")
    return None
