"""The `maximus ui` web app (Flask): plan, train, stop, resume, chat and export from the browser.

Pages: ``/`` (planner), ``/train`` (the run form: the config schema's keys, or a pasted YAML;
checked and planned before start), ``/runs`` (every run and its status), ``/runs/<name>`` (live
charts, stop / resume, chat base | tuned, export, plan, before/after, config).

JSON API (documented in docs/ui.md; the pages and the tests use it):

- reads: ``GET /api/runs``, ``GET /api/runs/<name>`` (status, step, plan, the child's exit code
  and log tail), ``/api/runs/<name>/metrics?since=N``, ``/api/plan`` (the planner form);
- mutating (POST): ``/api/check`` (validate and plan a config), ``/api/runs`` (start: 201
  ``{"run": NAME, "status": "starting" | "queued"}``), ``/api/runs/<name>/stop``,
  ``/api/runs/<name>/resume``, ``/api/runs/<name>/cancel`` (take a run out of the queue), ``/api/chat``
  (streams NDJSON rows), ``/api/runs/<name>/export``.

Every planner number comes from `maximus.memory.plan_command` (``maximus plan --json`` and
``maximus plan --config``), every config check from `Config.from_dict`, so the pages and the CLI
cannot disagree. Safety (a server that starts processes):

- a mutating request needs the token in an ``Authorization: Bearer`` header or in the
  SameSite=Strict HttpOnly cookie set from the printed ``?token=`` URL, also on loopback; a server
  started without a token refuses every mutating request;
- every POST must come from this server's own pages: an ``Origin`` (or ``Sec-Fetch-Site``) of
  another site is refused, and when bound to loopback a ``Host`` other than a loopback name is
  refused on every request (DNS rebinding);
- reads need the token too unless `open_reads` (loopback), as before;
- configs from the browser are confined by `maximus.ui.guard` (paths under the roots, no code
  unless `allow_code`); run names are confined to ``--runs`` (`maximus.ui.runs.confined_run_dir`);
- uploads and configs are capped (`MAX_UPLOAD_BYTES`, `guard.MAX_CONFIG_BYTES`), chats in tokens
  and to one generation per model (`maximus.ui.chat`);
- any failure is one line: a `MaximusError` its own, anything else a generic line (the traceback
  stays in the server log); the API answers ``{"error": "<one line>"}`` with a 4xx (5xx for a bug).
"""
from __future__ import annotations

import hmac
import json
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import yaml
from flask import Flask, Response, abort, jsonify, render_template, request, send_file
from werkzeug.exceptions import HTTPException

from maximus.config import format_bytes
from maximus.errors import ConfigError, MaximusError
from maximus.memory.optimizer_state import OPTIMIZERS as OPTIMIZER_TABLE
from maximus.ui.chat import Busy, ChatModels, chat_settings
from maximus.ui.guard import Refused, Roots, confine_config
from maximus.ui.jobs import Conflict, Jobs
from maximus.ui.runs import RunInfo, confined_run_dir, list_runs, read_metrics, run_detail, run_status

MAX_UPLOAD_BYTES = 256 * 1024
TOKEN_COOKIE = "maximus_ui_token"
METHODS = ("qlora", "lora", "full", "auto")
OPTIMIZERS = tuple(OPTIMIZER_TABLE)  # every training.optimizer (maximus.memory.optimizer_state)
DTYPES = ("bf16", "fp16", "fp32")
INT_FIELDS = {"seq": "sequence length", "batch": "batch", "lora_r": "LoRA rank"}
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
EXPORT_FORMATS = ("merged", "adapter", "gguf", "ollama")
STATUS_CODES = {Refused: 403, Conflict: 409, Busy: 429}


class FormError(MaximusError):
    """A planner form field is not what the planner needs."""


class NotFound(MaximusError):
    """No such run (or it lies outside --runs)."""


def error_key(message: str) -> str | None:
    """The config key a one-line error names (`Config.from_dict`'s and `guard`'s wording), if any."""
    from maximus.ui.form import config_keys

    m = re.search(r"(?:key|value for) '([^']+)'", message)
    if m:
        return m.group(1)
    m = re.match(r"(?:config: )?([a-z_]+(?:\.[a-z_]+)*)[ :]", message)
    return m.group(1) if m and m.group(1) in config_keys() else None


def create_app(runs_dir: str | Path, token: str | None = None, *, open_reads: bool = False,
               roots: Roots | None = None, allow_code: bool = False, allowed_hosts: frozenset[str] | None = None,
               train_argv: list[str] | None = None, export_argv: list[str] | None = None,
               slots: int | None = None) -> Flask:
    """The app over `runs_dir`. `token`: needed by every mutating request, and by reads unless
    `open_reads`; `roots`: where a browser's config may point (default: the working directory for
    data and models, `runs_dir` for runs); `allowed_hosts`: the Host names served (None: any);
    `train_argv` / `export_argv`: the child commands; `slots`: runs at once, the rest queue
    (`maximus.ui.jobs.Jobs`: one per CUDA device, one without)."""
    app = Flask(__name__)
    app.url_map.merge_slashes = False  # '/runs//etc' must reach the confinement check, not be redirected
    app.jinja_env.filters.update(gib=format_bytes, plan_text=plan_text)
    app.config["MAX_CONTENT_LENGTH"] = MAX_UPLOAD_BYTES + 16 * 1024  # the form fields around the file
    root = Path(runs_dir)
    roots = roots or Roots.of(Path.cwd(), Path.cwd(), root)
    jobs = Jobs(root, train_argv=train_argv, export_argv=export_argv, slots=slots)
    jobs.start_queue()  # the queue an earlier server left in <runs>/.maximus-ui/.queue.json moves on
    chats = ChatModels()
    app.extensions.update(maximus_jobs=jobs, maximus_chats=chats)

    def token_given(*, query: bool) -> str | None:
        auth = request.headers.get("Authorization", "")
        return ((request.args.get("token") if query else None) or request.cookies.get(TOKEN_COOKIE)
                or (auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else None))

    def token_ok(given: str | None) -> bool:
        return token is not None and bool(given) and hmac.compare_digest(given.encode(), token.encode())

    @app.before_request
    def check_request():
        if allowed_hosts is not None and request.host.rsplit(":", 1)[0] not in allowed_hosts:
            return _refuse(f"Host {request.host!r} is not this server", "open the URL maximus ui printed")
        if request.method == "POST":
            origin = request.headers.get("Origin")
            if origin is not None and origin != f"{request.scheme}://{request.host}":
                return _refuse(f"a request from {origin} is not from this server's pages",
                               "use the pages maximus ui serves, or send no Origin (curl, scripts)")
            site = request.headers.get("Sec-Fetch-Site")
            if site is not None and site not in ("same-origin", "none"):
                return _refuse(f"a {site} request is not from this server's pages", "use the pages maximus ui serves")
            if request.path.startswith("/api/") and request.path != "/api/plan":
                if token is None:
                    return _refuse("this server was started without a token, so it changes nothing",
                                   "start maximus ui again: it prints a URL with a token")
                if not token_ok(token_given(query=False)):
                    return _refuse("a mutating request needs the token",
                                   "send Authorization: Bearer TOKEN, or open the ?token= URL maximus ui printed")
                return None
        if token is not None and not open_reads and not token_ok(token_given(query=True)):
            abort(403)
        return None

    def _refuse(message: str, hint: str):
        line = Refused(message, hint).one_line()
        if request.path.startswith("/api/"):
            return jsonify({"error": line}), 403
        return Response(f"error: {line}\n", status=403, mimetype="text/plain")

    @app.after_request
    def remember_token(resp: Response) -> Response:
        if token is not None and request.args.get("token") and token_ok(request.args.get("token")):
            resp.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="Strict")
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["X-Frame-Options"] = "DENY"
        resp.headers["Cache-Control"] = "no-store"
        return resp

    @app.errorhandler(413)
    def too_large(_exc):
        if request.path.startswith("/api/"):
            return jsonify({"error": f"the request is larger than {MAX_UPLOAD_BYTES // 1024} KiB "
                                     "(hint: send the config only)"}), 413
        return render_template("planner.html", **_planner_context(
            error=f"config.json is larger than {MAX_UPLOAD_BYTES // 1024} KiB (hint: upload only the model's config.json)",
            form={})), 413

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        if request.path.startswith("/api/"):
            return jsonify({"error": f"{exc.code} {exc.name}: {exc.description}".split("\n")[0]}), exc.code
        return exc

    @app.errorhandler(MaximusError)
    def user_error(exc: MaximusError):
        status = next((code for cls, code in STATUS_CODES.items() if isinstance(exc, cls)),
                      404 if isinstance(exc, NotFound) else 400)
        body = {"error": exc.one_line()}
        if (key := error_key(exc.message)) is not None:
            body["key"] = key
        if request.path.startswith("/api/"):
            return jsonify(body), status
        return Response(f"error: {body['error']}\n", status=status, mimetype="text/plain")

    @app.errorhandler(Exception)
    def bug(exc: Exception):  # one line for the client; the traceback stays in the server log
        app.logger.exception("maximus ui failed on %s", request.path)
        line = f"the server failed on this request ({type(exc).__name__}) (hint: see the server log)"
        if request.path.startswith("/api/"):
            return jsonify({"error": line}), 500
        return Response(f"error: {line}\n", status=500, mimetype="text/plain")

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
        return jsonify(_plan_from_form(form, request.files.get("config_file")))

    # ------------------------------------------------------------------ runs
    def run_rows() -> list[dict]:
        rows = {r.name: r.to_dict() for r in list_runs(root)}
        for name in jobs.launched() + jobs.queued():  # started here or waiting: maybe no run files yet
            if name not in rows and confined(name) is not None:
                rows[name] = launched_info(name)
        for name, row in rows.items():
            row["status"] = jobs.status(name, row["status"])
            row["queue_position"] = jobs.position(name)
            row["exit_code"] = (jobs.record("train", name) or {}).get("exit_code")
        return list(rows.values())

    def launched_info(name: str) -> dict[str, Any]:
        """The runs-page row of a run this server started that has written no run files yet."""
        cfg = jobs.queued_config(name) or jobs.config(name) or {}
        return RunInfo(name=name, status="failed", model=cfg.get("model"), method=cfg.get("method"), steps_done=0,
                       steps_total=None, best_eval_loss=None, peak_bytes=None, budget_bytes=None,
                       predicted_peak_bytes=None).to_dict()

    def confined(name: str) -> Path | None:
        """A run directory under --runs: one with run files, or one this server launched or queued."""
        path = confined_run_dir(root, name)
        if path is None and (name in jobs.launched() or jobs.position(name) is not None):
            candidate = (root / name).resolve()
            if candidate.is_relative_to(root.resolve()) and candidate != root.resolve():
                path = candidate
        return path

    def run_dir_of(name: str) -> Path:
        path = confined(name)
        if path is None:
            raise NotFound(f"no run {name!r} under --runs {root}", "GET /api/runs lists the runs")
        return path

    @app.route("/runs")
    def runs() -> str:
        return render_template("runs.html", runs=run_rows(), root=str(root), slots=jobs.slots,
                               running=len(jobs.running()), queued=len(jobs.queued()))

    @app.route("/api/runs", methods=["GET"])
    def api_runs():
        return jsonify(run_rows())

    @app.route("/runs/<path:name>/loss.png")
    def loss_png(name: str):
        path = _page_run_dir(name) / "loss.png"
        if not path.is_file() or path.is_symlink():
            abort(404)
        return send_file(path, mimetype="image/png")

    def _page_run_dir(name: str) -> Path:
        path = confined(name)
        if path is None:
            abort(404)
        return path

    def detail_of(name: str, path: Path) -> dict[str, Any]:
        detail = run_detail(root, path) if path.is_dir() and confined_run_dir(root, name) else {
            "info": launched_info(name), "config": jobs.queued_config(name) or jobs.config(name), "plan": None,
            "eval_before": {}, "eval_after": {}, "memory": None, "replans": None, "has_loss_png": False}
        detail["info"]["status"] = jobs.status(name, detail["info"]["status"] if path.is_dir() else "failed")
        detail["info"]["queue_position"] = jobs.position(name)
        record = jobs.record("train", name)
        detail["job"] = None if record is None else {
            "exit_code": record.get("exit_code"), "started": record.get("started"), "ended": record.get("ended"),
            "log_tail": jobs.log_tail("train", name)}
        detail["exports"] = export_rows(name, path)
        return detail

    @app.route("/runs/<path:name>")
    def run_page(name: str) -> str:
        path = _page_run_dir(name)
        detail = detail_of(name, path)
        import importlib.util

        from maximus.export.to_gguf import K_QUANTS, QUANTS

        quants = list(QUANTS) + (list(K_QUANTS) if importlib.util.find_spec("llama_cpp") is not None else [])
        return render_template("run.html", name=name, detail=detail, export_formats=EXPORT_FORMATS, quants=quants,
                               has_run_json=(path / "run.json").is_file(),
                               config_text=json.dumps(detail["config"], indent=2) if detail["config"] else "")

    @app.route("/api/runs/<path:name>/metrics")
    def api_metrics(name: str):
        since = request.args.get("since", "0")
        if not since.isdigit():
            abort(400)
        path = _page_run_dir(name)
        rows = read_metrics(path, int(since))
        return jsonify({"since": int(since), "rows": rows, "info": detail_of(name, path)["info"]})

    @app.route("/api/runs/<path:name>", methods=["GET"])
    def api_run(name: str):
        return jsonify(detail_of(name, run_dir_of(name)))

    # ------------------------------------------------------------------ train, stop, resume
    def body() -> dict:
        data = request.get_json(silent=True)
        if not isinstance(data, dict):
            raise ConfigError("the request body is not a JSON object", "send Content-Type: application/json")
        return data

    def run_name(cfg_dir: str) -> str:
        return Path(cfg_dir).relative_to(roots.runs).as_posix()

    @app.route("/api/check", methods=["POST"])
    def api_check():
        req = body()
        data, _ = confine_config(req.get("config"), roots, allow_code=allow_code, overrides=req.get("overrides"))
        from maximus.memory.plan_command import plan_json

        with tempfile.TemporaryDirectory(prefix="maximus-ui-") as tmp:  # exactly `maximus plan --config FILE --json`
            path = Path(tmp) / "config.yaml"
            path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
            report = plan_json(["--config", str(path)])
        return jsonify({"run": run_name(data["output_dir"]), "config": data, "plan": report,
                        "plan_html": render_template("_plan_report.html", report=report)})

    def started(name: str, position: int | None) -> dict[str, Any]:
        if position is None:
            return {"run": name, "status": "starting"}
        return {"run": name, "status": "queued", "queue_position": position}

    @app.route("/api/runs", methods=["POST"])
    def api_start():
        req = body()
        data, _ = confine_config(req.get("config"), roots, allow_code=allow_code, overrides=req.get("overrides"))
        name = run_name(data["output_dir"])
        path = Path(data["output_dir"])
        jobs.refuse_in_use(name, path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise Conflict(f"output_dir {path} already exists and is not empty",
                           f"resume it with POST /api/runs/{name}/resume, or choose another output_dir")
        return jsonify(started(name, jobs.submit(name, path, data))), 201

    @app.route("/api/runs/<path:name>/stop", methods=["POST"])
    def api_stop(name: str):
        jobs.stop(name, run_dir_of(name))
        return jsonify({"run": name, "status": "stopping"}), 202

    @app.route("/api/runs/<path:name>/resume", methods=["POST"])
    def api_resume(name: str):
        path = run_dir_of(name)
        status = jobs.status(name, run_status(path) if path.is_dir() else "failed")
        if status == "queued":
            raise Conflict(f"run {name} is queued", "it starts when a slot frees; or cancel it")
        if status in ("running", "starting", "stopping"):
            raise Conflict(f"run {name} is {status}", "wait for it to stop first")
        if status == "finished":
            raise Conflict(f"run {name} is finished", "start a new run, or export this one")
        # The config this server started it with, else the one its trainer recorded; confined again either way.
        saved = jobs.config(name) or run_detail(root, path).get("config")
        if not saved:
            raise Conflict(f"run {name} recorded no config to resume from", "re-run its maximus-train command")
        saved, _ = confine_config(yaml.safe_dump(saved), roots, allow_code=allow_code)
        if Path(saved["output_dir"]) != path:
            raise Refused(f"run {name} recorded output_dir {saved['output_dir']}, not this directory",
                          "resume it with its own maximus-train command")
        return jsonify(started(name, jobs.submit(name, path, saved, resume=True))), 202

    @app.route("/api/runs/<path:name>/cancel", methods=["POST"])
    def api_cancel(name: str):
        run_dir_of(name)
        jobs.cancel(name)
        return jsonify({"run": name, "status": "cancelled"})

    # ------------------------------------------------------------------ chat
    @app.route("/api/chat", methods=["POST"])
    def api_chat():
        data = body()
        name = data.get("run")
        if not isinstance(name, str):
            raise ConfigError("the chat request names no run", 'send "run": NAME (GET /api/runs lists them)')
        path = run_dir_of(name)
        if not (path / "run.json").is_file():
            raise Conflict(f"run {name} is not finished", "chat with a finished run")
        settings = chat_settings(data)
        rows = chats.stream(path, settings)
        return Response((json.dumps(r) + "\n" for r in rows), mimetype="application/x-ndjson")

    # ------------------------------------------------------------------ export
    def export_target(path: Path, fmt: str, quant: str | None) -> tuple[str, Path]:
        export_id = fmt if quant is None else f"{fmt}-{quant}"
        return export_id, path / "exports" / (f"{export_id}.gguf" if fmt == "gguf" else export_id)

    def export_rows(name: str, path: Path) -> list[dict]:
        rows = []
        for fmt in EXPORT_FORMATS:
            for rec_path in sorted(p for p in jobs.state_dir(name).glob(f"export-{fmt}*.json")
                                   if not p.name.endswith(".progress.json")):
                export_id = rec_path.stem[len("export-"):]
                rec = jobs.record(f"export-{export_id}", name) or {}
                code = rec.get("exit_code")
                quant = export_id.split("-", 1)[1] if "-" in export_id else None
                _, out = export_target(path, fmt, quant)
                tail = jobs.log_tail(f"export-{export_id}", name).strip().splitlines()
                rows.append({"id": export_id, "format": fmt, "quant": quant, "path": str(out),
                             "status": "running" if code is None and jobs.alive(f"export-{export_id}", name)
                             else "done" if code == 0 and out.exists() else "failed",
                             "exit_code": code, "last_line": tail[-1] if tail else "",
                             "progress": jobs.export_progress(name, export_id),
                             "download": f"/runs/{name}/exports/{export_id}" if code == 0 and out.exists() else None})
        return rows

    @app.route("/api/runs/<path:name>/export", methods=["POST"])
    def api_export(name: str):
        from maximus.export.to_gguf import check_quant

        data = body()
        path = run_dir_of(name)
        fmt, quant = data.get("format"), data.get("quant")
        if fmt not in EXPORT_FORMATS:
            raise ConfigError(f"format must be one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}", 'e.g. "format": "gguf"')
        if quant is not None and fmt not in ("gguf", "ollama"):
            raise ConfigError(f"quant applies to format gguf or ollama, not {fmt}", "drop quant or change format")
        if fmt in ("gguf", "ollama"):
            quant = quant or ("f16" if fmt == "gguf" else "q8_0")
            if not isinstance(quant, str):
                raise ConfigError(f"quant must be a string, got {quant!r}", 'e.g. "quant": "q8_0"')
            check_quant(quant)
        if not (path / "run.json").is_file():
            raise Conflict(f"run {name} is not finished", "export a finished run")
        export_id, out = export_target(path, fmt, quant)
        args = [str(path), "--out", str(out), "--format", fmt] + (["--quant", quant] if quant else [])
        if out.exists():
            args.append("--overwrite")  # replaces only a previous export of ours (maximus.export.target)
        out.parent.mkdir(exist_ok=True)
        jobs.start_export(name, export_id, args)
        return jsonify({"run": name, "export": export_id, "path": str(out)}), 202

    @app.route("/runs/<path:name>/exports/<export_id>")
    def download_export(name: str, export_id: str):
        path = _page_run_dir(name)
        fmt, _, quant = export_id.partition("-")
        if fmt not in EXPORT_FORMATS or not re.fullmatch(r"[a-z0-9_]*", quant):
            abort(404)
        _, out = export_target(path, fmt, quant or None)
        if out.is_symlink() or not out.exists() or not out.resolve().is_relative_to(path):
            abort(404)
        if out.is_file():
            return send_file(out, as_attachment=True, download_name=out.name)
        buf = tempfile.SpooledTemporaryFile(max_size=64 * 2**20)
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
            for f in sorted(out.rglob("*")):
                if f.is_file() and not f.is_symlink():
                    zf.write(f, f.relative_to(out).as_posix())
        buf.seek(0)
        return send_file(buf, as_attachment=True, download_name=f"{Path(name).name}-{export_id}.zip",
                         mimetype="application/zip")

    # ------------------------------------------------------------------ train form
    @app.route("/train")
    def train_page() -> str:
        from maximus.ui.form import config_sections

        return render_template("train.html", sections=config_sections())

    return app


def plan_text(p: dict[str, Any]) -> str:
    """One line for a plan, as the CLI's per-card table says it (`maximus.memory.plan.plan_summary`)."""
    from maximus.memory.plan import plan_summary

    return plan_summary(p)


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
