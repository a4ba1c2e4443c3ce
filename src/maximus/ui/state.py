"""What every route of one `maximus ui` server shares: the guard, the children, the chat models."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flask import current_app

from maximus.ui.chat import ChatModels
from maximus.ui.guard import Guard
from maximus.ui.jobs import Jobs

__all__ = ["UiState", "ui_state"]


@dataclass(frozen=True)
class UiState:
    runs_root: Path  # --runs, as given
    guard: Guard
    jobs: Jobs
    chats: ChatModels


def ui_state() -> UiState:
    """The state of the app serving this request (`maximus.ui.app.create_app` stores it)."""
    return current_app.extensions["maximus"]
