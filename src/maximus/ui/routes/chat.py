"""Chat: ``POST /api/chat`` streams a finished run's base or tuned answer as NDJSON rows
(`maximus.ui.chat`: limits, one generation per model)."""
from __future__ import annotations

import json

from flask import Blueprint, Response

from maximus.errors import ConfigError
from maximus.ui.chat import chat_settings
from maximus.ui.guard import json_body
from maximus.ui.jobs import Conflict
from maximus.ui.state import ui_state

__all__ = ["blueprint"]

blueprint = Blueprint("chat", __name__)


@blueprint.route("/api/chat", methods=["POST"])
def api_chat():
    state = ui_state()
    data = json_body()
    name = data.get("run")
    if not isinstance(name, str):
        raise ConfigError("the chat request names no run", 'send "run": NAME (GET /api/runs lists them)')
    run = state.guard.run(name)
    if not (run.path / "run.json").is_file():
        raise Conflict(f"run {name} is not finished", "chat with a finished run")
    settings = chat_settings(data)
    rows = state.chats.stream(run.path, state.guard.finished_config(run), settings)
    return Response((json.dumps(r) + "\n" for r in rows), mimetype="application/x-ndjson")
