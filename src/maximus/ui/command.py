"""`maximus ui [--runs DIR] [--host 127.0.0.1] [--port 7860] [--token T] [--data-root D]
[--models-root M] [--allow-code]`: serve the app.

Every mutating request needs a token, also on loopback: `--token`, or one is made and printed in
the URL to open (which sets a SameSite=Strict cookie). Reads stay open on loopback; any other host
needs the token for every request. Configs from the browser may only name paths under
`--data-root` (datasets), `--models-root` (models, tokenizers, adapters) and `--runs` (output
dirs); code (trust_remote_code, reward modules, custom metrics) only with `--allow-code`. The
server is Werkzeug's threaded WSGI server (Flask's own), enough for one user's browser tabs.
"""
from __future__ import annotations

import ipaddress
import secrets
from pathlib import Path

from maximus.arguments import ArgumentParser
from maximus.errors import ConfigError

__all__ = ["ui_main", "is_loopback"]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="maximus ui", description="Plan, train, stop, chat with and export runs in the browser.")
    p.add_argument("--runs", default="runs", help="directory holding run directories (default: runs)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860; 0 picks a free one)")
    p.add_argument("--token", help="access token (default: one is made and printed)")
    p.add_argument("--data-root", default=".", help="datasets named from the browser must lie under it (default: .)")
    p.add_argument("--models-root", default=".", help="models, tokenizers and adapters named from the browser must "
                                                      "lie under it (default: .)")
    p.add_argument("--allow-code", action="store_true", help="accept configs that run code (trust_remote_code, "
                   "GRPO reward modules, custom metrics): only if you trust every page that can reach this server")
    return p


def ui_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    runs = Path(args.runs)
    if runs.exists() and not runs.is_dir():
        raise ConfigError(f"--runs {runs} is not a directory", "point --runs at the folder that holds your output_dirs")
    for flag, value in (("--data-root", args.data_root), ("--models-root", args.models_root)):
        if not Path(value).is_dir():
            raise ConfigError(f"{flag} {value} is not a directory", f"point {flag} at an existing folder")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is not a port number", "use 1-65535, or 0 for any free port")
    try:
        import flask  # noqa: F401
    except ImportError:
        raise ConfigError("maximus ui needs Flask, which is not installed", "pip install 'maximusllm[ui]'") from None
    loopback = is_loopback(args.host)
    token = args.token
    if not token:
        token = secrets.token_urlsafe(24)
        if not loopback:
            print(f"--host {args.host} is not loopback: every request needs this token (made for this run): {token}",
                  flush=True)
    from werkzeug.serving import make_server

    from maximus.ui.app import LOOPBACK_HOSTS, create_app
    from maximus.ui.guard import Roots

    runs.mkdir(parents=True, exist_ok=True)
    app = create_app(runs, token=token, open_reads=loopback, allow_code=args.allow_code,
                     roots=Roots.of(args.data_root, args.models_root, runs),
                     allowed_hosts=LOOPBACK_HOSTS | {args.host} if loopback else None)
    try:
        server = make_server(args.host, args.port, app, threaded=True)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}",
                          "choose another --port, or stop what is using it") from None
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"maximus ui: http://{host}:{server.server_port}/?token={token} (runs under {runs.resolve()}; "
          "open this URL: it carries the token; Ctrl-C stops the server, not the runs)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
