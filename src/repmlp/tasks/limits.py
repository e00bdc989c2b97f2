"""The ranges of the options, in one table (:data:`OPTIONS`): the command line's types come from it, and every
task's config checks its fields against it (:meth:`repmlp.tasks.config.TaskConfig.validate`), whether they come
from the command line, a Python caller or a resumed training state.

The upper bounds are far beyond any real use and far below what would overflow, fork a process storm or
exhaust memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MAX_COUNT", "MAX_SIDE", "MAX_CHANNELS", "Range", "ints", "POSITIVE", "OPTIONS"]

MAX_COUNT = 10**9  # steps, epochs, examples, repeats, ...
MAX_SIDE = 4096  # pixels per side of an input
MAX_CHANNELS = 4096
MAX_REAL = 1e6  # learning rates, weight decays, loss weights, ...


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
        return above and (value < self.hi if self.hi_open else value <= self.hi)

    def describe(self) -> str:
        """``"0..256"`` (integers) or ``"(0, 1e+06]"`` (numbers): what follows "must be in"."""
        if self.integer:
            return f"{self.lo}..{self.hi}"
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


def ints(lo: int, hi: int = MAX_COUNT) -> Range:
    """The integers ``lo..hi``."""
    return Range(lo, hi, integer=True)


POSITIVE, _NON_NEGATIVE, _FRACTION = (
    Range(0, MAX_REAL, lo_open=True),
    Range(0, MAX_REAL),
    Range(0, 1, hi_open=True),
)
_BATCH, _SIDE, _EXAMPLES = ints(1, 1 << 20), ints(8, MAX_SIDE), ints(1, 2**31 - 1)
# A config field -> its range (the option is ``--`` + the name with dashes), for every task's options.
OPTIONS: dict[str, Range] = {
    "epochs": ints(1, 100_000),
    "iterations": ints(1),
    "batch_size": _BATCH,
    "eval_batch_size": _BATCH,
    "bench_batch_size": _BATCH,
    "lr": POSITIVE,
    "min_lr": _NON_NEGATIVE,
    "momentum": _FRACTION,
    "weight_decay": _NON_NEGATIVE,
    "head_weight_decay": _NON_NEGATIVE,
    "warmup_epochs": _NON_NEGATIVE,
    "label_smoothing": _FRACTION,
    "mixup": _NON_NEGATIVE,
    "pad": ints(0, 1024),
    "img_size": _SIDE,
    "crop_size": _SIDE,
    "train_limit": _EXAMPLES,
    "val_limit": _EXAMPLES,
    "seed": ints(0, 2**32 - 1),  # numpy's seeds
    "workers": ints(0, 256),  # data loading processes: each is a fork of the training process
    "threads": ints(1, 1024),
    "ckpt_every": ints(0),
    "log_interval": ints(1),
    "am_scale": POSITIVE,
    "am_margin": _FRACTION,
    "power": POSITIVE,
    "head_lr_mult": POSITIVE,
    # Random scales of segmentation crops, bounded so that a scaled image fits in memory.
    "scale_min": Range(0, 16, lo_open=True),
    "scale_max": Range(0, 16, lo_open=True),
    "aux_weight": _NON_NEGATIVE,
    "folds": ints(2, 1000),
    "seeds": ints(1, 1000),  # repmlp study
    "jobs": ints(1, 256),
    "width_multiplier": Range(0, 64, lo_open=True),
}
