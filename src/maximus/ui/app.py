"""The `maximus ui` web app (Flask): the planner and the runs under ``--runs``, read-only.

Pages: ``/`` (planner), ``/runs`` (every run and its status), ``/runs/<name>`` (live charts, plan,
before/after, generations, config). JSON: ``/api/plan``, ``/api/runs``, ``/api/runs/<name>``,
``/api/runs/<name>/metrics?since=N`` (the page polls it), ``/runs/<name>/loss.png``.

Every planner number comes from `maximus.memory.plan_command.plan_json`, the function behind
``maximus plan --json``, so the page and the CLI cannot disagree. Safety:

- read-only: no route writes anywhere, least of all into a run directory;
- a token, when the app was started with one (required off loopback), is checked on every
  request: ``?token=`` (which also sets a cookie for the pages' own requests), the cookie, or an
  ``Authorization: Bearer`` header; a wrong or missing token gets 403;
- run names are confined to ``--runs`` (`maximus.ui.runs.confined_run_dir`): 404 otherwise;
- an uploaded config.json is capped at `MAX_UPLOAD_BYTES` and parsed as JSON, nothing else;
- a planner mistake (unknown model, a budget that is not a size) shows the planner's one-line
  message; any other failure shows one generic line, never a traceback.
"""
from __future__ import annotations

import hmac
import json
import tempfile
from pathlib import Path
from typing import Any

from flask import Flask, Response, abort, jsonify, render_template, request, send_file

from maximus.config import format_bytes
from maximus.errors import MaximusError
from maximus.ui.runs import confined_run_dir, list_runs, read_metrics, run_detail

MAX_UPLOAD_BYTES = 256 * 1024
TOKEN_COOKIE = "maximus_ui_token"
METHODS = ("qlora", "lora", "full", "auto")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit")
DTYPES = ("bf16", "fp16", "fp32")
INT_FIELDS = {"seq": "sequence length", "batch": "batch", "lora_r": "LoRA rank"}


class FormError(MaximusError):
    """A planner form field is not what the planner needs."""


def create_app(runs_dir: str | Path, token: str | None = None) -> Flask:
    app = Flask(__name__)
    app.url_map.merge_slashes = False  # '/runs//etc' must reach the confinement check, not be redirected
    app.jinja_env.filters.update(gib=format_bytes, plan_text=plan_text)
    app.config["MAX_CONTENT_LENGTH"] = MAX_UPLOAD_BYTES + 16 * 1024  # the form fields around the file
    root = Path(runs_dir)

    @app.before_request
    def check_token() -> None:
        if token is None:
            return
        given = (request.args.get("token") or request.cookies.get(TOKEN_COOKIE)
                 or request.headers.get("Authorization", "").removeprefix("Bearer ").strip())
        if not given or not hmac.compare_digest(given.encode(), token.encode()):
            abort(403)

    @app.after_request
    def remember_token(resp: Response) -> Response:
        if token is not None and request.args.get("token"):
            resp.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="Strict")
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Cache-Control"] = "no-store"
        return resp

    @app.errorhandler(413)
    def too_large(_exc) -> tuple[str, int]:
        return render_template("planner.html", **_planner_context(
            error=f"config.json is larger than {MAX_UPLOAD_BYTES // 1024} KiB (hint: upload only the model's config.json)",
            form={})), 413

    # ------------------------------------------------------------------ planner
    @app.route("/", methods=["GET", "POST"])
    def planner() -> str:
        form = request.form if request.method == "POST" else request.args
        if not form.get("model") and "config_file" not in request.files:
            return render_template("planner.html", **_planner_context(form=form))
        try:
            report = _plan_from_form(form, request.files.get("config_file"))
        except MaximusError as exc:
            return render_template("planner.html", **_planner_context(form=form, error=exc.one_line()))
        except Exception:  # a bug: one line on the page, the traceback stays in the server log
            app.logger.exception("planner failed")
            return render_template("planner.html", **_planner_context(
                form=form, error="the planner failed on this input (hint: see the server log)"))
        return render_template("planner.html", **_planner_context(form=form, report=report,
                                                                  yaml_text=plan_yaml(report, form)))

    @app.route("/api/plan", methods=["GET", "POST"])
    def api_plan():
        form = request.form if request.method == "POST" else request.args
        try:
            report = _plan_from_form(form, request.files.get("config_file"))
        except MaximusError as exc:
            return jsonify({"error": exc.one_line()}), 400
        return jsonify(report)

    # ------------------------------------------------------------------ runs
    @app.route("/runs")
    def runs() -> str:
        return render_template("runs.html", runs=[r.to_dict() for r in list_runs(root)], root=str(root))

    @app.route("/api/runs")
    def api_runs():
        return jsonify([r.to_dict() for r in list_runs(root)])

    def _run_dir(name: str) -> Path:
        path = confined_run_dir(root, name)
        if path is None:
            abort(404)
        return path

    @app.route("/runs/<path:name>/loss.png")
    def loss_png(name: str):
        path = _run_dir(name) / "loss.png"
        if not path.is_file() or path.is_symlink():
            abort(404)
        return send_file(path, mimetype="image/png")

    @app.route("/runs/<path:name>")
    def run_page(name: str) -> str:
        detail = run_detail(root, _run_dir(name))
        return render_template("run.html", name=name, detail=detail,
                               config_text=json.dumps(detail["config"], indent=2) if detail["config"] else "")

    @app.route("/api/runs/<path:name>/metrics")
    def api_metrics(name: str):
        since = request.args.get("since", "0")
        if not since.isdigit():
            abort(400)
        path = _run_dir(name)
        rows = read_metrics(path, int(since))
        return jsonify({"since": int(since), "rows": rows, "info": run_detail(root, path)["info"]})

    @app.route("/api/runs/<path:name>")
    def api_run(name: str):
        return jsonify(run_detail(root, _run_dir(name)))

    return app


def plan_text(p: dict[str, Any]) -> str:
    """One line for a plan, as the CLI's per-card table says it."""
    label = p.get("checkpointing_label")
    if label is None:
        modes = p.get("recompute", p.get("gradient_checkpointing"))
        if isinstance(modes, (list, tuple)):
            on = sum(1 for m in modes if m not in (False, "none", "off"))
            label = f"{on}/{len(modes)} layers"
        else:
            label = str(modes)
    offload = "+".join(n for n, k in (("act", "offload_activations"), ("opt", "offload_optimizer"),
                                      ("params", "offload_params")) if p.get(k))
    return (f"{p.get('method')} mb {p.get('micro_batch_size')} x acc {p.get('grad_accum')}, ckpt {label}"
            + (f", offload {offload}" if offload else ""))


def _planner_context(**extra: Any) -> dict[str, Any]:
    from maximus.config import GPU_CARDS
    from maximus.memory.estimate import KNOWN_SHAPES

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


def _plan_from_form(form, upload) -> dict[str, Any]:
    from maximus.memory.plan_command import plan_json

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
    return plan_json(planner_argv(form))


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
