"""Training: ``/train`` (the run form), ``POST /api/check`` (check and plan a config, start
nothing), ``POST /api/runs`` (start or queue), ``POST /api/runs/<run>/stop``, ``/resume`` and
``/cancel``.

Every config is confined by the guard (`maximus.ui.guard.Guard.config`) before it is planned or
started; a resume confines the recorded config again, with this server's flags.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml
from flask import Blueprint, jsonify, render_template

from maximus.ui.guard import Refused, Run, json_body
from maximus.ui.jobs import Conflict
from maximus.ui.runs import run_detail, run_status
from maximus.ui.state import ui_state

__all__ = ["blueprint", "check_report"]

blueprint = Blueprint("train", __name__)


@blueprint.route("/train")
def page() -> str:
    from maximus.ui.form import config_sections

    return render_template("train.html", sections=config_sections())


@blueprint.route("/api/check", methods=["POST"])
def api_check():
    data, _ = ui_state().guard.config(json_body())
    return jsonify(check_report(data))


def check_report(data: dict) -> dict[str, Any]:
    """What "Check and plan" shows for a confined config: the run it would write, the config, the
    plan of ``maximus plan --config FILE --json`` (with its HTML table), and beside it the data
    check of ``maximus data check --config FILE --json`` (`data_check`, each check's rows cut to
    the first `DATA_ROWS_SHOWN`; `{"error": line}` when the data cannot be read) with its HTML."""
    from maximus.plan_command import plan_json

    with tempfile.TemporaryDirectory(prefix="maximus-ui-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
        report = plan_json(["--config", str(path)])
    data_check = _data_check(data)
    return {"run": ui_state().guard.run_name(data["output_dir"]), "config": data, "plan": report,
            "plan_html": render_template("_plan_report.html", report=report), "data_check": data_check,
            "data_html": render_template("_data_report.html", report=data_check)}


DATA_ROWS_SHOWN = 20  # per check, in the page and /api/check (maximus data check --json lists all)


def _data_check(data: dict) -> dict[str, Any]:
    from maximus.builtin import resolve
    from maximus.config import Config
    from maximus.data_command import data_report
    from maximus.errors import MaximusError

    try:
        report = data_report(resolve(Config.from_dict(data))).to_dict()
    except MaximusError as exc:  # the plan may stand without the data; the line the trainer would print
        return {"error": exc.one_line()}
    for check in report["checks"]:
        check["rows"] = check["rows"][:DATA_ROWS_SHOWN]
    return report


def started(name: str, position: int | None) -> dict[str, Any]:
    if position is None:
        return {"run": name, "status": "starting"}
    return {"run": name, "status": "queued", "queue_position": position}


@blueprint.route("/api/runs", methods=["POST"])
def api_start():
    state = ui_state()
    data, _ = state.guard.config(json_body())
    name = state.guard.run_name(data["output_dir"])
    path = Path(data["output_dir"])
    state.jobs.refuse_in_use(name, path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise Conflict(f"output_dir {path} already exists and is not empty",
                       f"resume it with POST /api/runs/{name}/resume, or choose another output_dir")
    return jsonify(started(name, state.jobs.submit(name, path, data))), 201


@blueprint.route("/api/runs/<path:run>/stop", methods=["POST"])
def api_stop(run: Run):
    ui_state().jobs.stop(run.name, run.path)
    return jsonify({"run": run.name, "status": "stopping"}), 202


@blueprint.route("/api/runs/<path:run>/resume", methods=["POST"])
def api_resume(run: Run):
    state = ui_state()
    name, path = run.name, run.path
    status = state.jobs.status(name, run_status(path) if path.is_dir() else "failed")
    if status == "queued":
        raise Conflict(f"run {name} is queued", "it starts when a slot frees; or cancel it")
    if status in ("running", "starting", "stopping"):
        raise Conflict(f"run {name} is {status}", "wait for it to stop first")
    if status == "finished":
        raise Conflict(f"run {name} is finished", "start a new run, or export this one")
    # The config this server started it with, else the one its trainer recorded; confined again either way.
    saved = state.jobs.config(name) or run_detail(state.runs_root, path).get("config")
    if not saved:
        raise Conflict(f"run {name} recorded no config to resume from", "re-run its maximus-train command")
    saved, _ = state.guard.recorded_config(saved)
    if Path(saved["output_dir"]) != path:
        raise Refused(f"run {name} recorded output_dir {saved['output_dir']}, not this directory",
                      "resume it with its own maximus-train command")
    return jsonify(started(name, state.jobs.submit(name, path, saved, resume=True))), 202


@blueprint.route("/api/runs/<path:run>/cancel", methods=["POST"])
def api_cancel(run: Run):
    ui_state().jobs.cancel(run.name)
    return jsonify({"run": run.name, "status": "cancelled"})
