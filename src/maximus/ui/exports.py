"""The exports of a run that `maximus ui` started: where each lands and what state it is in.

An export is `maximus export` run as a child (`maximus.ui.jobs.Jobs.start_export`) into
``<run>/exports/<format>[-<quant>]`` (a ``.gguf`` file for GGUF); its record, log and progress
lie in the run's state directory under ``<runs>/.maximus-ui/``.
"""
from __future__ import annotations

import re
from pathlib import Path

from maximus.ui.jobs import Jobs

__all__ = ["EXPORT_FORMATS", "QUANT_FORMATS", "export_target", "export_rows", "format_of"]

EXPORT_FORMATS = ("merged", "adapter", "gguf", "gguf-lora", "ollama")
#: The formats that take a quantization (`--quant`).
QUANT_FORMATS = ("gguf", "gguf-lora", "ollama")


def _id_prefix(fmt: str) -> str:
    """The export id's first part: the format without its hyphen (``gguflora``), so that the id
    splits into format and quantization at its first hyphen."""
    return fmt.replace("-", "")


def format_of(export_id: str) -> tuple[str | None, str | None, int]:
    """(format, quantization or None, correction rank or 0) of an export id; (None, None, 0) for an
    id of no format."""
    prefix, _, rest = export_id.partition("-")
    quant, _, extra = rest.partition("-")
    fmt = {_id_prefix(f): f for f in EXPORT_FORMATS}.get(prefix)
    rank = re.fullmatch(r"corr([1-9][0-9]*)", extra)
    if fmt is None or (extra and (rank is None or fmt != "gguf-lora")):
        return None, None, 0
    return fmt, quant or None, int(rank.group(1)) if rank else 0


def export_target(run_dir: Path, fmt: str, quant: str | None, correction_rank: int = 0) -> tuple[str, Path]:
    """(export id, the path `maximus export` writes) of one format and quantization (gguf-lora:
    and `--correction-rank`, as ``gguflora-<quant>-corr<N>``)."""
    export_id = _id_prefix(fmt) if quant is None else f"{_id_prefix(fmt)}-{quant}"
    if correction_rank:
        export_id += f"-corr{correction_rank}"
    return export_id, run_dir / "exports" / (f"{export_id}.gguf" if fmt == "gguf" else export_id)


def export_rows(jobs: Jobs, name: str, run_dir: Path) -> list[dict]:
    """The run page's export table: one row per export this server started for run `name`."""
    rows = []
    records = sorted((p for p in jobs.state_dir(name).glob("export-*.json") if not p.name.endswith(".progress.json")),
                     key=lambda p: (EXPORT_FORMATS.index(format_of(p.stem[len("export-"):])[0] or "merged"), p.name))
    for rec_path in records:
        export_id = rec_path.stem[len("export-"):]
        fmt, quant, rank = format_of(export_id)
        if fmt is None:
            continue
        rec = jobs.record(f"export-{export_id}", name) or {}
        code = rec.get("exit_code")
        _, out = export_target(run_dir, fmt, quant, rank)
        tail = jobs.log_tail(f"export-{export_id}", name).strip().splitlines()
        rows.append({"id": export_id, "format": fmt, "quant": quant, "correction_rank": rank or None, "path": str(out),
                     "status": "running" if code is None and jobs.alive(f"export-{export_id}", name)
                     else "done" if code == 0 and out.exists() else "failed",
                     "exit_code": code, "last_line": tail[-1] if tail else "",
                     "progress": jobs.export_progress(name, export_id),
                     "download": f"/runs/{name}/exports/{export_id}" if code == 0 and out.exists() else None})
    return rows
