"""One exception family for everything a user can get wrong.

The CLI prints a `MaximusError` as a single line (``error: <message> (hint: <hint>)``) and exits
with code 2. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations


class MaximusError(Exception):
    """A user-facing error: one line saying what is wrong, plus a hint on how to fix it."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = self.message
        if self.hint:
            text += f" (hint: {self.hint})"
        return " ".join(text.split())

    def __str__(self) -> str:
        return self.one_line()


class ConfigError(MaximusError):
    """The config file or an override is invalid."""


class DataError(MaximusError):
    """A dataset is missing, malformed, or empty."""


class ModelError(MaximusError):
    """A model cannot be found or loaded."""


class BudgetError(MaximusError):
    """Nothing fits the memory budget."""


class CheckpointError(MaximusError):
    """A checkpoint or run directory is unusable."""


class ExportError(MaximusError):
    """An export cannot be written: the target is not ours to replace, or the model or format is unsupported."""


class UsageError(MaximusError):
    """The command line is wrong: a missing, unknown or malformed argument."""


class RewardError(MaximusError):
    """A reward function (objective grpo) raised, or returned something other than one number per completion."""


class TrainingError(MaximusError):
    """Training cannot go on (e.g. too many non-finite steps in a row, out of memory at the smallest plan)."""


PREEMPTED_EXIT_CODE = 75


class Preempted(MaximusError):
    """A stop signal arrived; a checkpoint was written and the run can resume."""

    exit_code = PREEMPTED_EXIT_CODE
