"""`ArgumentParser` for every Maximus command: a command-line mistake raises `UsageError`, which
the CLI prints as one line and exit code 2, instead of argparse's usage block plus an error line."""
from __future__ import annotations

import argparse

from maximus.errors import UsageError


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose `error` raises `UsageError` naming the command."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}", f"`{self.prog} --help` lists the arguments")
