"""Compatibility name: the end of ``repmlp train`` now lives in :mod:`repmlp.tasks.classification_report`.

Kept so that ``from repmlp.pipeline import finish_run, compare_logits`` (scripts, the study) keeps working.
"""

from .tasks.classification_report import *  # noqa: F403 - the shim re-exports the module's public names
from .tasks.classification_report import __all__  # noqa: F401
