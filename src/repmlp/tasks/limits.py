"""The ranges of the options, in one place: the command line's parsers (:mod:`repmlp.commands._common`)
and the checks of a configuration read back from a training state (:meth:`TrainConfig.validate
<repmlp.tasks.classification.TrainConfig.validate>`) use the same bounds, so that a value the command line
refuses is refused from an edited state too.

The upper bounds are far beyond any real use and far below what would overflow, fork a process storm or
exhaust memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "MAX_COUNT",
    "MAX_SIDE",
    "MAX_PAD",
    "MAX_CHANNELS",
    "MAX_BATCH",
    "MAX_WORKERS",
    "MAX_THREADS",
    "MAX_REAL",
    "MAX_SEED",
    "MAX_LIMIT",
    "MAX_EPOCHS",
    "Range",
]

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
