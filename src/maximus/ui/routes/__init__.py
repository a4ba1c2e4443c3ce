"""The routes of `maximus ui`, one Flask blueprint per page or API area. None checks a token, a
path or a flag itself: `maximus.ui.guard.Guard` does, for all of them."""
from __future__ import annotations

from maximus.ui.routes import chat, export, planner, runs, train

__all__ = ["BLUEPRINTS"]

BLUEPRINTS = (planner.blueprint, train.blueprint, runs.blueprint, chat.blueprint, export.blueprint)
