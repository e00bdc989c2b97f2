"""The command line's argparse classes: help that keeps line breaks and names defaults, errors on one line.

An error about the arguments says what was probably meant (Python 3.11's argparse has no
``suggest_on_error``): the closest option or choice of the command that was run, and ``--checkpoint``
for a model file given without it.

Shared by :mod:`repmlp.cli` (the top-level parser) and the commands that build parsers of their own.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["ArgumentParser", "HelpFormatter", "unknown_argument_hints"]

# File endings of the model files that the commands take with --checkpoint.
_MODEL_FILE_ENDINGS = (".safetensors", ".pth", ".pt", ".onnx")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks; appends ``(default: X)`` where the help does not say it (not to a
    flag such as ``--no-fast-training``: its name says what it turns off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or action.default in (None, False, argparse.SUPPRESS)
            or not action.option_strings
            or (action.nargs == 0 and action.const is False)  # store_false
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

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """As argparse's; remembers the arguments and, when some are left over, the parser they were left to
        (a sub-command's, whose leftovers argparse hands up to its parent), for the hints of :meth:`error`."""
        self._raw_args = list(sys.argv[1:] if args is None else args)
        self._leftover_parser: ArgumentParser | None = None
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:
            self._leftover_parser = self._command_parser(namespace) or self
        return namespace, extra

    def _command_parser(self, namespace: argparse.Namespace) -> ArgumentParser | None:
        """The sub-command's parser that left arguments over in this parse, if any."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None) or "")
                return getattr(chosen, "_leftover_parser", None)
        return None

    def error(self, message: str) -> NoReturn:
        parser: ArgumentParser = getattr(self, "_leftover_parser", None) or self
        if message.startswith("unrecognized arguments: "):
            hints = unknown_argument_hints(message.split(": ", 1)[1].split(), parser)
        elif message.startswith(("the following arguments are required: ", "one of the arguments ")):
            # argparse checks these before it lists the unknown ones: a typo may be why one is missing.
            # A bare argument is a model file given without its option only while --checkpoint is missing.
            known = {s for a in parser._actions for s in a.option_strings}
            bare = "--checkpoint" in message
            raw = [a for a in getattr(parser, "_raw_args", []) if a.startswith("-") or bare]
            hints = unknown_argument_hints([a for a in raw if a.split("=", 1)[0] not in known], parser)
        else:
            hints = _choice_hint(message)
        message = f"{message}; {'; '.join(hints)}" if hints else message
        self.exit(2, f"repmlp: error: {message} (see '{parser.prog} --help')\n")


def unknown_argument_hints(extra: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """What ``parser``'s user may have meant by the ``extra`` arguments it did not recognise.

    ``--epoch`` -> "did you mean --epochs?" (the closest of the parser's own options, by
    :func:`difflib.get_close_matches`); a model file given without its option, where the parser has
    ``--checkpoint`` -> "give the model file with --checkpoint: --checkpoint FILE".
    """
    options = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    typos: dict[str, str] = {}  # given -> meant
    files: list[str] = []
    for arg in extra:
        given = arg.split("=", 1)[0]
        close = difflib.get_close_matches(given, options, n=1, cutoff=0.7) if arg.startswith("--") else []
        if close:
            typos[given] = close[0]
        elif (
            not arg.startswith("-")
            and "--checkpoint" in options
            and arg.lower().endswith(_MODEL_FILE_ENDINGS)
        ):
            files.append(arg)
    hints = []
    if len(typos) == 1:
        hints.append(f"did you mean {next(iter(typos.values()))}?")
    elif typos:
        hints.append(
            "did you mean " + ", ".join(f"{meant} for {given}" for given, meant in typos.items()) + "?"
        )
    if files and "--checkpoint" not in typos.values():  # else the typo's hint already says where it goes
        hints.append(f"give the model file with --checkpoint: --checkpoint {files[0]}")
    return hints


def _choice_hint(message: str) -> list[str]:
    """The hint "did you mean X?" for argparse's ``invalid choice: 'Y' (choose from 'X', ...)``."""
    match = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if not match:
        return []
    choices = re.findall(r"'([^']*)'", match.group(2))
    close = difflib.get_close_matches(match.group(1), choices, n=1, cutoff=0.6)
    return [f"did you mean {close[0]}?"] if close else []
