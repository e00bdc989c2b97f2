"""Errors a user can cause (bad data folder, bad checkpoint, option out of range, ...).

The CLI turns a :class:`UserError` into one line on stderr (``repmlp: error: <message>``) and exit status 2,
without a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""


class RunFinished(Exception):
    """Not an error: ``--resume auto`` of a run that has finished already (a scheduler rerunning a completed
    job). The CLI prints its message, one line, and exits with 0."""


def first_line(exc: BaseException) -> str:
    """The first non-empty line of ``exc``'s message, or its type's name when it has none: how an error
    from a library (onnxruntime, PIL, torch) is quoted inside one of ours."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__
