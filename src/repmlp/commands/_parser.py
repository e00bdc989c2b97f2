"""The command line's argparse classes: help that keeps line breaks and names defaults, errors on one line.

Shared by :mod:`repmlp.cli` (the top-level parser) and the commands that build parsers of their own.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["ArgumentParser", "HelpFormatter"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks; appends ``(default: X)`` where the help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or action.default in (None, False, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)".strip()


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` with errors as one line (``repmlp: error: ...``) instead of usage + message."""

    def __init__(self, *args, **kwargs) -> None:
        # No prefix matching: a task's options pass through the top-level parser, where an abbreviation
        # could be taken for another option (e.g. "--val" for "--val-limit").
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"repmlp: error: {message} (see '{self.prog} --help')\n")
