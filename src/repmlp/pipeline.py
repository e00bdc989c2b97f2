"""Compatibility name: the end of ``repmlp train`` now lives in :mod:`repmlp.tasks.classification`."""

from .tasks.classification import (
    EQUIVALENCE_RTOL,
    accuracy,
    compare_logits,
    finish_run,
    hardware_summary,
    plot_curves,
    predict,
)

__all__ = [
    "EQUIVALENCE_RTOL",
    "accuracy",
    "compare_logits",
    "finish_run",
    "hardware_summary",
    "plot_curves",
    "predict",
]
