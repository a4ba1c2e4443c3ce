"""The runs: ``/runs`` (every run and the queue), ``/runs/<run>`` (live charts, controls, chat,
export), ``/runs/<run>/loss.png``, and their reads ``GET /api/runs``, ``GET /api/runs/<run>``,
``GET /api/runs/<run>/metrics?since=N``.

Statuses come from the run directory's files (`maximus.ui.runs`) and from this server's children
(`maximus.ui.jobs.Jobs.status`); nothing here writes.
"""
from __future__ import annotations

import importlib.util
import json
from typing import Any

from flask import Blueprint, abort, jsonify, render_template, request, send_file

from maximus.ui.exports import EXPORT_FORMATS, QUANT_FORMATS, export_rows
from maximus.ui.guard import Run
from maximus.ui.runs import RunInfo, confined_run_dir, list_runs, read_metrics, run_detail
from maximus.ui.state import ui_state

__all__ = ["blueprint", "run_rows", "launched_info", "detail_of"]

blueprint = Blueprint("runs", __name__)


@blueprint.route("/runs")
def page() -> str:
    jobs = ui_state().jobs
    return render_template("runs.html", runs=run_rows(), root=str(ui_state().runs_root), slots=jobs.slots,
                           running=len(jobs.running()), queued=len(jobs.queued()))


@blueprint.route("/api/runs", methods=["GET"])
def api_runs():
    return jsonify(run_rows())


@blueprint.route("/runs/<path:run>")
def run_page(run: Run) -> str:
    from maximus.export.to_gguf import K_QUANTS, QUANTS

    detail = detail_of(run)
    quants = list(QUANTS) + (list(K_QUANTS) if importlib.util.find_spec("llama_cpp") is not None else [])
    recorded = detail["config"] or {}
    return render_template("run.html", name=run.name, detail=detail, export_formats=EXPORT_FORMATS, quant_formats=QUANT_FORMATS, quants=quants,
                           qat_target=(recorded.get("training") or {}).get("qat", "off"),
                           has_run_json=(run.path / "run.json").is_file(),
                           config_text=json.dumps(detail["config"], indent=2) if detail["config"] else "")


@blueprint.route("/runs/<path:run>/loss.png")
def loss_png(run: Run):
    path = run.path / "loss.png"
    if not path.is_file() or path.is_symlink():
        abort(404)
    return send_file(path, mimetype="image/png")


@blueprint.route("/api/runs/<path:run>", methods=["GET"])
def api_run(run: Run):
    return jsonify(detail_of(run))


@blueprint.route("/api/runs/<path:run>/metrics")
def api_metrics(run: Run):
    since = request.args.get("since", "0")
    if not since.isdigit():
        abort(400)
    rows = read_metrics(run.path, int(since))
    return jsonify({"since": int(since), "rows": rows, "info": detail_of(run)["info"]})


def run_rows() -> list[dict]:
    """The runs page's rows: every run directory under --runs and every run this server started or queued."""
    state = ui_state()
    jobs = state.jobs
    rows = {r.name: r.to_dict() for r in list_runs(state.runs_root)}
    for name in jobs.launched() + jobs.queued():  # started here or waiting: maybe no run files yet
        if name not in rows and _confined(name):
            rows[name] = launched_info(name)
    for name, row in rows.items():
        row["status"] = jobs.status(name, row["status"])
        row["queue_position"] = jobs.position(name)
        row["exit_code"] = (jobs.record("train", name) or {}).get("exit_code")
    return list(rows.values())


def _confined(name: str) -> bool:
    from maximus.errors import MaximusError

    try:
        ui_state().guard.run(name)
    except MaximusError:
        return False
    return True


def launched_info(name: str) -> dict[str, Any]:
    """The runs-page row of a run this server started that has written no run files yet."""
    jobs = ui_state().jobs
    cfg = jobs.queued_config(name) or jobs.config(name) or {}
    return RunInfo(name=name, status="failed", model=cfg.get("model"), method=cfg.get("method"), steps_done=0,
                   steps_total=None, best_eval_loss=None, peak_bytes=None, budget_bytes=None,
                   predicted_peak_bytes=None).to_dict()


def detail_of(run: Run) -> dict[str, Any]:
    """Everything the run page and ``GET /api/runs/<run>`` show."""
    state = ui_state()
    jobs, name, path = state.jobs, run.name, run.path
    detail = run_detail(state.runs_root, path) if path.is_dir() and confined_run_dir(state.runs_root, name) else {
        "info": launched_info(name), "config": jobs.queued_config(name) or jobs.config(name), "plan": None,
        "eval_before": {}, "eval_after": {}, "memory": None, "replans": None, "has_loss_png": False}
    detail["info"]["status"] = jobs.status(name, detail["info"]["status"] if path.is_dir() else "failed")
    detail["info"]["queue_position"] = jobs.position(name)
    record = jobs.record("train", name)
    detail["job"] = None if record is None else {
        "exit_code": record.get("exit_code"), "started": record.get("started"), "ended": record.get("ended"),
        "log_tail": jobs.log_tail("train", name)}
    detail["exports"] = export_rows(jobs, name, path)
    return detail
