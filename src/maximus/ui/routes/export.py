"""Export: ``POST /api/runs/<run>/export`` starts `maximus export` as a child (the export rules of
docs/export.md hold); ``GET /runs/<run>/exports/<export_id>`` downloads the result (a directory
as a zip)."""
from __future__ import annotations

import re
import tempfile
import zipfile
from pathlib import Path

from flask import Blueprint, abort, jsonify, send_file

from maximus.errors import ConfigError
from maximus.ui.exports import EXPORT_FORMATS, QUANT_FORMATS, export_target, format_of
from maximus.ui.guard import Run, json_body
from maximus.ui.jobs import Conflict
from maximus.ui.state import ui_state

__all__ = ["blueprint"]

blueprint = Blueprint("export", __name__)


@blueprint.route("/api/runs/<path:run>/export", methods=["POST"])
def api_export(run: Run):
    """Starts `maximus export`. Without a quant, a GGUF / gguf-lora / Ollama export writes the run's
    `training.qat` target (else f16 / q8_0), as the CLI does (`maximus.export.local.quant_for_run`);
    the answer's ``warnings`` are the CLI's, e.g. for a quant other than the one the run trained for.
    gguf-lora takes a ``correction_rank`` (`--correction-rank`), checked as the CLI checks it."""
    from maximus.export.local import check_correction_rank, quant_for_run
    from maximus.export.to_gguf import check_quant

    data = json_body()
    name, path = run.name, run.path
    fmt, quant = data.get("format"), data.get("quant")
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"format must be one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}", 'e.g. "format": "gguf"')
    if quant is not None and fmt not in QUANT_FORMATS:
        raise ConfigError(f"quant applies to format {', '.join(QUANT_FORMATS[:-1])} or {QUANT_FORMATS[-1]}, not {fmt}",
                          "drop quant or change format")
    if quant is not None:
        if not isinstance(quant, str):
            raise ConfigError(f"quant must be a string, got {quant!r}", 'e.g. "quant": "q8_0"')
        check_quant(quant)
    rank = data.get("correction_rank")
    if rank is not None:
        if fmt != "gguf-lora":
            raise ConfigError(f"correction_rank applies to format gguf-lora (the adapter file beside the base), not {fmt}",
                              "drop correction_rank or use format gguf-lora")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ConfigError(f"correction_rank must be a whole number of 1 or more, got {rank!r}",
                              'e.g. "correction_rank": 64')
    if not (path / "run.json").is_file():
        raise Conflict(f"run {name} is not finished", "export a finished run")
    ui_state().guard.finished_config(run)  # the export child loads the model: no code without --allow-code
    warnings: list[str] = []
    if fmt in QUANT_FORMATS:
        quant, warnings = quant_for_run(path, quant or None, fmt)
        check_quant(quant)
    if rank:
        check_correction_rank(path, quant, rank)
    export_id, out = export_target(path, fmt, quant, rank or 0)
    args = [str(path), "--out", str(out), "--format", fmt] + (["--quant", quant] if quant else []) \
        + (["--correction-rank", str(rank)] if rank else [])
    if out.exists():
        args.append("--overwrite")  # replaces only a previous export of ours (maximus.export.target)
    out.parent.mkdir(exist_ok=True)
    ui_state().jobs.start_export(name, export_id, args)
    return jsonify({"run": name, "export": export_id, "path": str(out), "warnings": warnings}), 202


@blueprint.route("/runs/<path:run>/exports/<export_id>")
def download(run: Run, export_id: str):
    fmt, quant, rank = format_of(export_id)
    if fmt is None or not re.fullmatch(r"[a-z0-9_]*", quant or ""):
        abort(404)
    _, out = export_target(run.path, fmt, quant, rank)
    if out.is_symlink() or not out.exists() or not out.resolve().is_relative_to(run.path):
        abort(404)
    if out.is_file():
        return send_file(out, as_attachment=True, download_name=out.name)
    buf = tempfile.SpooledTemporaryFile(max_size=64 * 2**20)
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for f in sorted(out.rglob("*")):
            if f.is_file() and not f.is_symlink():
                zf.write(f, f.relative_to(out).as_posix())
    buf.seek(0)
    return send_file(buf, as_attachment=True, download_name=f"{Path(run.name).name}-{export_id}.zip",
                     mimetype="application/zip")
