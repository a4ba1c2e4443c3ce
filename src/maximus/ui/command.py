"""`maximus ui [--runs DIR] [--host 127.0.0.1] [--port 7860] [--token T]`: serve the app.

Loopback by default. Any other host needs a token: `--token`, or one is made and printed, and
every request must carry it. The server is Werkzeug's threaded WSGI server (Flask's own), which
is enough for one user's browser tabs polling their runs.
"""
from __future__ import annotations

import argparse
import ipaddress
import secrets
import sys
from pathlib import Path

from maximus.errors import ConfigError

__all__ = ["ui_main", "is_loopback"]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="maximus ui", description="The planner and live runs in the browser (read-only).")
    p.add_argument("--runs", default="runs", help="directory holding run directories (default: runs)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860; 0 picks a free one)")
    p.add_argument("--token", help="access token; required, or generated and printed, when --host is not loopback")
    return p


def ui_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    runs = Path(args.runs)
    if runs.exists() and not runs.is_dir():
        raise ConfigError(f"--runs {runs} is not a directory", "point --runs at the folder that holds your output_dirs")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is not a port number", "use 1-65535, or 0 for any free port")
    token = args.token
    if not is_loopback(args.host) and not token:
        token = secrets.token_urlsafe(24)
        print(f"--host {args.host} is not loopback: every request needs this token (made for this run): {token}",
              flush=True)
    from werkzeug.serving import make_server

    from maximus.ui.app import create_app

    try:
        server = make_server(args.host, args.port, create_app(runs, token=token), threaded=True)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}",
                          "choose another --port, or stop what is using it") from None
    host = f"[{args.host}]" if ":" in args.host else args.host
    query = f"?token={token}" if token else ""
    print(f"maximus ui: http://{host}:{server.server_port}/{query} (runs under {runs.resolve()}; Ctrl-C stops)",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
