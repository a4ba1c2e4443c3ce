"""The planner: ``/`` (the page) and ``/api/plan`` (its `maximus plan --json` object).

Every number comes from `maximus.plan_command.plan_json`, the function behind ``maximus
plan --json``; the form's fields become the CLI's flags (`planner_argv`). Planning starts and
writes nothing, so it needs no token (`maximus.ui.guard.UNGUARDED_POSTS`); the model it reads is
confined to ``--models-root`` all the same (`form_model`).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from flask import Blueprint, current_app, jsonify, render_template, request

from maximus.errors import MaximusError
from maximus.memory.optimizer_state import OPTIMIZERS as OPTIMIZER_TABLE
from maximus.ui.state import ui_state

__all__ = ["blueprint", "FormError", "planner_argv", "planner_context", "plan_yaml", "MAX_UPLOAD_BYTES"]

blueprint = Blueprint("planner", __name__)

MAX_UPLOAD_BYTES = 256 * 1024
METHODS = ("qlora", "lora", "full", "auto")
OPTIMIZERS = tuple(OPTIMIZER_TABLE)  # every training.optimizer (maximus.memory.optimizer_state)
DTYPES = ("bf16", "fp16", "fp32")
INT_FIELDS = {"seq": "sequence length", "batch": "batch", "lora_r": "LoRA rank"}


class FormError(MaximusError):
    """A planner form field is not what the planner needs."""


@blueprint.route("/", methods=["GET", "POST"])
def page() -> str:
    form = request.form if request.method == "POST" else request.args
    if not form.get("model") and "config_file" not in request.files:
        return render_template("planner.html", **planner_context(form=form))
    try:
        report = plan_from_form(form, request.files.get("config_file"))
    except MaximusError as exc:
        return render_template("planner.html", **planner_context(form=form, error=exc.one_line()))
    except Exception:  # a bug: one line on the page, the traceback stays in the server log
        current_app.logger.exception("planner failed")
        return render_template("planner.html", **planner_context(
            form=form, error="the planner failed on this input (hint: see the server log)"))
    return render_template("planner.html", **planner_context(form=form, report=report,
                                                             yaml_text=plan_yaml(report, form)))


@blueprint.route("/api/plan", methods=["GET", "POST"])
def api_plan():
    form = request.form if request.method == "POST" else request.args
    return jsonify(plan_from_form(form, request.files.get("config_file")))


@blueprint.app_template_filter("plan_text")
def plan_text(p: dict[str, Any]) -> str:
    """One line for a plan, as the CLI's per-card table says it (`maximus.memory.plan.plan_summary`)."""
    from maximus.memory.plan import plan_summary

    return plan_summary(p)


def planner_context(**extra: Any) -> dict[str, Any]:
    from maximus.config import GPU_CARDS
    from maximus.memory.shape import KNOWN_SHAPES

    known = sorted(k for k in KNOWN_SHAPES if "/" in k)
    return dict(known_models=known, cards=list(GPU_CARDS), methods=METHODS, optimizers=OPTIMIZERS, dtypes=DTYPES,
                report=None, error=None, yaml_text=None) | extra


def planner_argv(form, model_path: str | None = None) -> list[str]:
    """The `maximus plan` flags for a planner form (the same flags the CLI takes)."""
    model = model_path or (form.get("model_dir") or "").strip() or (form.get("model") or "").strip()
    if not model:
        raise FormError("no model given", "pick a known model, type a local model directory, or upload a config.json")
    argv = ["--model", model]
    for field, what in INT_FIELDS.items():
        value = (form.get(field) or "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise FormError(f"{what} must be a positive whole number, got {value!r}", f"e.g. {field}=2048")
            argv += ["--" + field.replace("_", "-"), value]
    for field, allowed in (("method", METHODS), ("optimizer", OPTIMIZERS), ("dtype", DTYPES)):
        value = (form.get(field) or "").strip()
        if value:
            if value not in allowed:
                raise FormError(f"{field} must be one of {', '.join(allowed)}, got {value!r}", f"choose {allowed[0]}")
            argv += ["--" + field, value]
    budget = (form.get("budget") or "").strip() or (form.get("card") or "").strip()
    if budget:
        argv += ["--budget", budget]
    return argv


def plan_from_form(form, upload) -> dict[str, Any]:
    from maximus.plan_command import plan_json

    if upload is not None and upload.filename:
        raw = upload.read(MAX_UPLOAD_BYTES + 1)
        if len(raw) > MAX_UPLOAD_BYTES:
            raise FormError(f"config.json is larger than {MAX_UPLOAD_BYTES // 1024} KiB",
                            "upload only the model's config.json")
        try:
            config = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise FormError(f"uploaded {upload.filename!r} is not valid JSON: {exc}", "upload a model's config.json") from None
        if not isinstance(config, dict):
            raise FormError(f"uploaded {upload.filename!r} is not a JSON object", "upload a model's config.json")
        with tempfile.TemporaryDirectory(prefix="maximus-ui-") as tmp:
            path = Path(tmp) / "config.json"
            path.write_text(json.dumps(config), encoding="utf-8")
            report = plan_json(planner_argv(form, model_path=str(path)))
        report["model"] = f"uploaded {upload.filename}"
        return report
    return plan_json(planner_argv(form, model_path=form_model(form)))


def form_model(form) -> str | None:
    """The model the form names (a local directory, else a known id), confined by the guard."""
    for key in ("model_dir", "model"):
        value = (form.get(key) or "").strip()
        if value:
            return ui_state().guard.model(key, value)
    return None


def plan_yaml(report: dict[str, Any], form) -> str | None:
    """A maximus-train config for the plan on screen: the budget's plan, else the cheapest card's."""
    import yaml

    chosen, budget = None, None
    if report.get("budget", {}).get("fits"):
        chosen, budget = report["budget"]["plan"], (form.get("budget") or form.get("card") or "").strip()
    elif report.get("cheapest_card"):
        card = next(c for c in report["cards"] if c["card"] == report["cheapest_card"])
        chosen, budget = card["plan"], card["card"]
    if not chosen:
        return None
    s = report["settings"]
    model = report["model"] if not str(report["model"]).startswith("uploaded ") else "path/to/your/model"
    cfg: dict[str, Any] = {
        "model": model,
        "dataset": "path/to/your/data.jsonl",
        "method": chosen.get("method", s["method"]),
        "output_dir": "runs/my-run",
        "lora": {"r": s["lora_r"]},
        "optimization": {"target_vram": budget or None, "loss": s["loss_mode"]},
        "training": {"batch_size": s["batch_size"], "seq_len": s["seq_len"], "optimizer": s["optimizer"],
                     "dtype": s["dtype"]},
    }
    if isinstance(chosen.get("micro_batch_size"), int):
        cfg["training"]["micro_batch_size"] = chosen["micro_batch_size"]
    if chosen.get("method") == "full":
        del cfg["lora"]
    return ("# maximus-train --config this.yaml  (the planner re-checks the plan against target_vram at start)\n"
            + yaml.safe_dump(cfg, sort_keys=False))
