"""The ranges of the options, in one table (:data:`OPTIONS`): the command line's parsers take their types
from it, and every task's config checks its fields against it (:meth:`repmlp.tasks.config.TaskConfig.validate`)
whether it comes from the command line, a Python caller or a resumed training state.

The upper bounds are far beyond any real use and far below what would overflow, fork a process storm or
exhaust memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MAX_COUNT", "MAX_SIDE", "MAX_PAD", "MAX_CHANNELS", "MAX_BATCH", "MAX_WORKERS", "MAX_THREADS", "MAX_REAL",
           "MAX_SEED", "MAX_LIMIT", "MAX_EPOCHS", "Range", "OPTIONS"]  # fmt: skip

MAX_COUNT = 10**9  # steps, epochs, examples, repeats, ...
MAX_SIDE = 4096  # --img-size, --crop-size: pixels per side
MAX_PAD = 1024  # --pad: pixels
MAX_CHANNELS = 4096
MAX_BATCH = 1 << 20
MAX_WORKERS = 256  # data loading processes: each is a fork of the training process
MAX_THREADS = 1024
MAX_REAL = 1e6  # learning rates, weight decays, loss weights, ...
MAX_SEED = 2**32 - 1  # numpy's seeds
MAX_LIMIT = 2**31 - 1  # --train-limit, --val-limit: examples
MAX_EPOCHS = 100_000


@dataclass(frozen=True)
class Range:
    """A closed or half-open interval of an option's values: integers (``integer``) or finite numbers."""

    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, value: object) -> bool:
        """Whether ``value`` is of the range's kind (an int; else a finite int or float; no bool) and in it."""
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not self.integer and not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def describe(self) -> str:
        """``"0..256"`` (integers) or ``"(0, 1e+06]"`` (numbers): what follows "must be in"."""
        if self.integer:
            return f"{self.lo}..{self.hi}"
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


def _ints(lo: int, hi: int = MAX_COUNT) -> Range:
    return Range(lo, hi, integer=True)


_POSITIVE, _NON_NEGATIVE, _FRACTION = (
    Range(0, MAX_REAL, lo_open=True),
    Range(0, MAX_REAL),
    Range(0, 1, hi_open=True),
)
# A config field -> its range (the option is ``--`` + the name with dashes), for every task's options.
OPTIONS: dict[str, Range] = {
    "epochs": _ints(1, MAX_EPOCHS),
    "iterations": _ints(1),
    "batch_size": _ints(1, MAX_BATCH),
    "eval_batch_size": _ints(1, MAX_BATCH),
    "bench_batch_size": _ints(1, MAX_BATCH),
    "lr": _POSITIVE,
    "min_lr": _NON_NEGATIVE,
    "momentum": _FRACTION,
    "weight_decay": _NON_NEGATIVE,
    "head_weight_decay": _NON_NEGATIVE,
    "warmup_epochs": _NON_NEGATIVE,
    "label_smoothing": _FRACTION,
    "mixup": _NON_NEGATIVE,
    "pad": _ints(0, MAX_PAD),
    "img_size": _ints(8, MAX_SIDE),
    "crop_size": _ints(8, MAX_SIDE),
    "train_limit": _ints(1, MAX_LIMIT),
    "val_limit": _ints(1, MAX_LIMIT),
    "seed": _ints(0, MAX_SEED),
    "workers": _ints(0, MAX_WORKERS),
    "threads": _ints(1, MAX_THREADS),
    "ckpt_every": _ints(0),
    "log_interval": _ints(1),
    "stop_after_steps": _ints(1),
    "am_scale": _POSITIVE,
    "am_margin": _FRACTION,
    "power": _POSITIVE,
    "head_lr_mult": _POSITIVE,
    # Random scales of segmentation crops, bounded so that a scaled image fits in memory.
    "scale_min": Range(0, 16, lo_open=True),
    "scale_max": Range(0, 16, lo_open=True),
    "aux_weight": _NON_NEGATIVE,
    "folds": _ints(2, 1000),
    "seeds": _ints(1, 1000),  # repmlp study
    "jobs": _ints(1, MAX_WORKERS),
    "width_multiplier": Range(0, 64, lo_open=True),
}
