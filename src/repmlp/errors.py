"""Errors a user can cause (bad data folder, bad checkpoint, option out of range, ...).

The CLI turns a :class:`UserError` into one line on stderr (``repmlp: error: <message>``) and exit status 2,
without a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""
