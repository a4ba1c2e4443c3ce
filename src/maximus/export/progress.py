"""Where a running export is, for whoever watches it: `maximus export --progress FILE` writes it,
`maximus ui`'s export table shows it.

An export goes through these stages (a format skips the ones it has no use for):

- ``loading``: the base model and the adapter (or the fully fine-tuned model), in full precision;
- ``merging``: the adapter merged into the base weights;
- ``tensors``: GGUF only, each tensor converted (and quantized) into the file, ``done`` of ``total``;
- ``writing``: the files written into a temporary sibling of the target;
- ``quantizing``: a K-quant GGUF, by llama.cpp's own quantiser from the f16 file;
- ``calibrating``: gguf-lora with `--correction-rank`, the correction of the base's rounding measured
  on the run's first training rows;
- ``checking``: the result read back (a GGUF: its tensor count and marker) and the target checked
  again before the result is renamed into place;
- ``done``.

The file is JSON, replaced atomically on every change (`maximus.files.write_json`), so a
reader never sees half of it: ``{"stage", "done", "total", "text"}``.
"""
from __future__ import annotations

import time
from pathlib import Path

from maximus.files import write_json

__all__ = ["ExportProgress", "STAGES", "progress_text"]

STAGES = ("loading", "merging", "tensors", "writing", "quantizing", "calibrating", "checking", "done")
_TEXT = {"loading": "loading the model", "merging": "merging the adapter", "tensors": "writing tensors",
         "writing": "writing the files", "quantizing": "quantizing with llama.cpp",
         "calibrating": "calibrating the correction of the base's rounding", "checking": "checking the result",
         "done": "done"}
MIN_INTERVAL_SECONDS = 0.1  # tensor counts are written at most this often (and always the last one)


def progress_text(stage: str, done: int | None = None, total: int | None = None) -> str:
    """One line for a stage: "writing tensors 12/291"."""
    text = _TEXT[stage]
    return f"{text} {done}/{total}" if total is not None else text


class ExportProgress:
    """Called as ``progress(stage)`` or ``progress("tensors", done, total)``; writes the JSON file
    `path` (None: writes nothing, the default for a library call)."""

    def __init__(self, path: str | Path | None = None):
        self.path = None if path is None else Path(path)
        self._last: float | None = None  # time.monotonic() of the last write

    def __call__(self, stage: str, done: int | None = None, total: int | None = None) -> None:
        if stage not in _TEXT:
            raise ValueError(f"unknown export stage {stage!r}")
        if self.path is None:
            return
        now = time.monotonic()
        if done is not None and done != total and self._last is not None and now - self._last < MIN_INTERVAL_SECONDS:
            return
        self._last = now
        write_json(self.path, {"stage": stage, "done": done, "total": total, "text": progress_text(stage, done, total)})
