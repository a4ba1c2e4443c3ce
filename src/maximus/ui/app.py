"""The `maximus ui` web app (Flask): plan, train, stop, resume, chat and export from the browser.

`create_app` wires one server together: the guard every request passes first
(`maximus.ui.guard.Guard`: host, origin, token, run names confined to ``--runs``; configs confined
to the roots, code only with ``--allow-code``), the children (`maximus.ui.jobs.Jobs`), the chat
models, the error handlers, and one blueprint per page or API area (`maximus.ui.routes`):

- `routes.planner`: ``/`` and ``/api/plan``;
- `routes.train`: ``/train``, ``POST /api/check``, ``POST /api/runs`` and a run's stop, resume, cancel;
- `routes.runs`: ``/runs``, ``/runs/<run>``, and the reads ``GET /api/runs[/<run>[/metrics]]``;
- `routes.chat`: ``POST /api/chat`` (NDJSON rows);
- `routes.export`: ``POST /api/runs/<run>/export`` and its download.

The JSON API is documented in docs/ui.md. Every planner number comes from
`maximus.plan_command` and every config check from `Config.from_dict`, so the pages and the
CLI cannot disagree. Any failure is one line: a `MaximusError` its own, anything else a generic line
(the traceback stays in the server log); the API answers ``{"error": "<one line>"}`` with a 4xx
(5xx for a bug). Uploads and configs are capped (`MAX_UPLOAD_BYTES`,
`maximus.ui.confine.MAX_CONFIG_BYTES`), chats in tokens and to one generation per model.
"""
from __future__ import annotations

import re
from pathlib import Path

from flask import Flask, Response, jsonify, render_template, request
from werkzeug.exceptions import HTTPException

from maximus.config import format_bytes
from maximus.errors import MaximusError
from maximus.ui.chat import Busy, ChatModels, NoRoom
from maximus.ui.confine import Confinement, Refused, Roots
from maximus.ui.guard import LOOPBACK_HOSTS, TOKEN_COOKIE, Guard, NotFound
from maximus.ui.jobs import Conflict, Jobs
from maximus.ui.routes import BLUEPRINTS
from maximus.ui.routes.planner import MAX_UPLOAD_BYTES, planner_context
from maximus.ui.state import UiState

__all__ = ["create_app", "LOOPBACK_HOSTS", "TOKEN_COOKIE", "MAX_UPLOAD_BYTES", "error_key"]

STATUS_CODES = {Refused: 403, NotFound: 404, Conflict: 409, NoRoom: 409, Busy: 429}


def create_app(runs_dir: str | Path, token: str | None = None, *, open_reads: bool = False,
               roots: Roots | None = None, allow_code: bool = False, allowed_hosts: frozenset[str] | None = None,
               train_argv: list[str] | None = None, export_argv: list[str] | None = None,
               slots: int | None = None) -> Flask:
    """The app over `runs_dir`. `token`: needed by every mutating request, and by reads unless
    `open_reads`; `roots`: where a browser's config may point (default: the working directory for
    data and models, `runs_dir` for runs); `allow_code`: configs may run code; `allowed_hosts`: the
    Host names served (None: any); `train_argv` / `export_argv`: the child commands; `slots`: runs
    at once, the rest queue (`maximus.ui.jobs.Jobs`: one per CUDA device, one without)."""
    app = Flask(__name__)
    app.url_map.merge_slashes = False  # '/runs//etc' must reach the confinement check, not be redirected
    app.jinja_env.filters.update(gib=format_bytes)
    app.config["MAX_CONTENT_LENGTH"] = MAX_UPLOAD_BYTES + 16 * 1024  # the form fields around the file
    root = Path(runs_dir)
    confinement = Confinement(roots or Roots.of(Path.cwd(), Path.cwd(), root), allow_code)
    jobs = Jobs(root, admit=confinement.saved_run, train_argv=train_argv, export_argv=export_argv, slots=slots)
    guard = Guard(root, confinement, token=token, open_reads=open_reads, allowed_hosts=allowed_hosts,
                  pending=lambda name: name in jobs.launched() or jobs.position(name) is not None)
    chats = ChatModels()
    app.extensions.update(maximus=UiState(root, guard, jobs, chats), maximus_jobs=jobs, maximus_chats=chats)
    guard.install(app)
    _install_error_handlers(app)
    for blueprint in BLUEPRINTS:
        app.register_blueprint(blueprint)
    jobs.start_queue()  # the queue an earlier server left in <runs>/.maximus-ui/.queue.json moves on
    return app


def error_key(message: str) -> str | None:
    """The config key a one-line error names (`Config.from_dict`'s and the guard's wording), if any."""
    from maximus.ui.form import config_keys

    m = re.search(r"(?:key|value for) '([^']+)'", message)
    if m:
        return m.group(1)
    m = re.match(r"(?:config: )?([a-z_]+(?:\.[a-z_]+)*)[ :]", message)
    return m.group(1) if m and m.group(1) in config_keys() else None


def _install_error_handlers(app: Flask) -> None:
    def api() -> bool:
        return request.path.startswith("/api/")

    @app.errorhandler(413)
    def too_large(_exc):
        if api():
            return jsonify({"error": f"the request is larger than {MAX_UPLOAD_BYTES // 1024} KiB "
                                     "(hint: send the config only)"}), 413
        return render_template("planner.html", **planner_context(
            error=f"config.json is larger than {MAX_UPLOAD_BYTES // 1024} KiB (hint: upload only the model's config.json)",
            form={})), 413

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        if api():
            return jsonify({"error": f"{exc.code} {exc.name}: {exc.description}".split("\n")[0]}), exc.code
        return exc

    @app.errorhandler(MaximusError)
    def user_error(exc: MaximusError):
        status = next((code for cls, code in STATUS_CODES.items() if isinstance(exc, cls)), 400)
        body = {"error": exc.one_line()}
        if (key := error_key(exc.message)) is not None:
            body["key"] = key
        if api():
            return jsonify(body), status
        return Response(f"error: {body['error']}\n", status=status, mimetype="text/plain")

    @app.errorhandler(Exception)
    def bug(exc: Exception):  # one line for the client; the traceback stays in the server log
        app.logger.exception("maximus ui failed on %s", request.path)
        line = f"the server failed on this request ({type(exc).__name__}) (hint: see the server log)"
        if api():
            return jsonify({"error": line}), 500
        return Response(f"error: {line}\n", status=500, mimetype="text/plain")
