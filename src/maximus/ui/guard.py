"""The one guard of `maximus ui`: every request passes it before a route runs, and routes reach
run directories and configs only through it, so a route cannot forget a check.

Before any route (`Guard.check_request`, installed on the whole app, every blueprint included):

- a ``Host`` outside `allowed_hosts` is refused on every request (DNS rebinding);
- a POST whose ``Origin`` or ``Sec-Fetch-Site`` names another site is refused;
- a POST under ``/api/`` needs the token (``Authorization: Bearer`` or the SameSite=Strict
  HttpOnly cookie set from the printed ``?token=`` URL), except `UNGUARDED_POSTS` (planning, which
  starts and writes nothing); a server without a token refuses them all;
- any other request needs the token unless `open_reads` (loopback);
- a route's ``run`` URL value (``/runs/<path:run>``) becomes a `Run` confined to ``--runs``: a run
  directory there, or a run this server launched or queued (`NotFound`, 404, otherwise). Routes
  name no other run variable (tests/ui check the URL map).

What a route asks of it: `config` (a posted config, confined by `maximus.ui.confine.Confinement`:
paths under the roots, no code without ``--allow-code``), `recorded_config` (a config to resume,
confined again), `run` (a run a request body names), `finished_config` (a finished run's config to
load its model for chat or export: refused when it records code and the server lacks
``--allow-code``), `model` (a model the planner form names, confined to ``--models-root``: the
planner needs no token, but reads what it names) and `run_name` (the run a confined config writes). Refusals are
`maximus.ui.confine.Refused` (403).
"""
from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flask import Flask, Response, abort, jsonify, request

from maximus.config import Config
from maximus.errors import ConfigError, MaximusError
from maximus.ui.confine import Confinement, Refused, Roots
from maximus.ui.runs import confined_run_dir

__all__ = ["Guard", "NotFound", "Refused", "Roots", "Run", "LOOPBACK_HOSTS", "TOKEN_COOKIE", "UNGUARDED_POSTS"]

TOKEN_COOKIE = "maximus_ui_token"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
#: POSTs under /api/ that need no token: they start, write and stop nothing.
UNGUARDED_POSTS = frozenset({"/api/plan"})
#: The URL variable that names a run; the guard confines it before the route sees it.
RUN_VARIABLE = "run"


class NotFound(MaximusError):
    """No such run (or it lies outside --runs)."""


@dataclass(frozen=True)
class Run:
    """A run a request names, confined to ``--runs``: `name` as under ``--runs``, `path` resolved."""

    name: str
    path: Path


class Guard:
    """Checks every request of one server (see the module doc). `pending(name)`: whether this
    server launched or queued a run of that name (it may have no run files yet)."""

    def __init__(self, runs_root: Path, confinement: Confinement, *, token: str | None, open_reads: bool,
                 allowed_hosts: frozenset[str] | None, pending: Callable[[str], bool]):
        self.runs_root = Path(runs_root)
        self.confinement = confinement
        self.token = token
        self.open_reads = open_reads
        self.allowed_hosts = allowed_hosts
        self.pending = pending

    def install(self, app: Flask) -> None:
        app.before_request(self.check_request)
        app.after_request(self.remember_token)

    # ------------------------------------------------------------------ every request
    def check_request(self):
        if self.allowed_hosts is not None and request.host.rsplit(":", 1)[0] not in self.allowed_hosts:
            return refusal(f"Host {request.host!r} is not this server", "open the URL maximus ui printed")
        if request.method == "POST":
            origin = request.headers.get("Origin")
            if origin is not None and origin != f"{request.scheme}://{request.host}":
                return refusal(f"a request from {origin} is not from this server's pages",
                               "use the pages maximus ui serves, or send no Origin (curl, scripts)")
            site = request.headers.get("Sec-Fetch-Site")
            if site is not None and site not in ("same-origin", "none"):
                return refusal(f"a {site} request is not from this server's pages", "use the pages maximus ui serves")
        if request.method == "POST" and request.path.startswith("/api/") and request.path not in UNGUARDED_POSTS:
            if self.token is None:
                return refusal("this server was started without a token, so it changes nothing",
                               "start maximus ui again: it prints a URL with a token")
            if not self._token_ok(self._token_given(query=False)):
                return refusal("a mutating request needs the token",
                               "send Authorization: Bearer TOKEN, or open the ?token= URL maximus ui printed")
        elif self.token is not None and not self.open_reads and not self._token_ok(self._token_given(query=True)):
            abort(403)
        if request.view_args and RUN_VARIABLE in request.view_args:
            request.view_args[RUN_VARIABLE] = self.run(request.view_args[RUN_VARIABLE])
        return None

    def remember_token(self, resp: Response) -> Response:
        given = request.args.get("token")
        if self.token is not None and given and self._token_ok(given):
            resp.set_cookie(TOKEN_COOKIE, self.token, httponly=True, samesite="Strict")
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["X-Frame-Options"] = "DENY"
        resp.headers["Cache-Control"] = "no-store"
        return resp

    def _token_given(self, *, query: bool) -> str | None:
        auth = request.headers.get("Authorization", "")
        return ((request.args.get("token") if query else None) or request.cookies.get(TOKEN_COOKIE)
                or (auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else None))

    def _token_ok(self, given: str | None) -> bool:
        return self.token is not None and bool(given) and hmac.compare_digest(given.encode(), self.token.encode())

    # ------------------------------------------------------------------ what routes ask
    def run(self, name: str) -> Run:
        """`name` confined to ``--runs``: a run directory there, or a run this server launched or
        queued (which may have no files yet); else `NotFound`."""
        path = confined_run_dir(self.runs_root, name)
        if path is None and self.pending(name):
            root = self.runs_root.resolve()
            candidate = (root / name).resolve()
            if candidate.is_relative_to(root) and candidate != root:
                path = candidate
        if path is None:
            raise NotFound(f"no run {name!r} under --runs {self.runs_root}", "GET /api/runs lists the runs")
        return Run(name, path)

    def config(self, body: dict[str, Any]) -> tuple[dict, Config]:
        """The config of a request body ``{"config": YAML, "overrides": [...]}``, confined."""
        return self.confinement.config(body.get("config"), overrides=body.get("overrides"))

    def recorded_config(self, saved: dict) -> tuple[dict, Config]:
        """A config this server or a trainer recorded (a resume starts from it), confined again."""
        import yaml

        return self.confinement.config(yaml.safe_dump(saved))

    def run_name(self, output_dir: str) -> str:
        return self.confinement.run_name(output_dir)

    def model(self, key: str, value: str) -> str:
        """A model the planner form names (`key`: its field), confined to ``--models-root``."""
        return self.confinement.model(key, value)

    def finished_config(self, run: Run) -> Config:
        """The config a finished run recorded (`maximus.export.run_config`), to load its model with:
        refused when it runs code and this server lacks ``--allow-code``."""
        from maximus.export import run_config

        cfg = run_config(run.path)
        self.confinement.loadable(cfg, run.name)
        return cfg


def refusal(message: str, hint: str):
    """The response to a refused request: JSON under /api/, one line of text for a page; 403."""
    line = Refused(message, hint).one_line()
    if request.path.startswith("/api/"):
        return jsonify({"error": line}), 403
    return Response(f"error: {line}\n", status=403, mimetype="text/plain")


def json_body() -> dict:
    """The request's JSON object (ConfigError, 400, for anything else)."""
    data = request.get_json(silent=True)
    if not isinstance(data, dict):
        raise ConfigError("the request body is not a JSON object", "send Content-Type: application/json")
    return data
