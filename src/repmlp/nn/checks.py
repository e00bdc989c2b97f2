"""Input-shape checks that stay active in eager mode and in ``torch.fx``-traced modules.

Models built for one resolution (their FC layers fix it) check their input in ``forward``. A shape
comparison on an fx proxy is control flow on a traced value, so :func:`check_input_shape` is a
``torch.fx.wrap`` leaf: symbolic tracing records the call instead of evaluating it, and the traced
module still runs it. Call it as ``checks.check_input_shape`` (through the module attribute, which fx
patches while tracing), never through a ``from`` import.
"""

from typing import Any

import torch
from torch import Tensor

__all__ = ["check_input_shape"]


@torch.fx.wrap
@torch.jit.ignore  # TorchScript of an fx graph calls it as Python
def check_input_shape(x: Tensor, expected: Any, message: str) -> None:
    """Raise ``ValueError`` unless ``x`` is ``(N, *expected)``; ``expected`` is a tuple of sizes, ``None``
    for any size in that dimension (typed ``Any`` for TorchScript, which has no variadic tuples).

    ``message`` is formatted with ``shape`` (``x``'s shape tuple) and ``h``, ``w`` (its last two sizes).
    Skipped under ``torch.jit.trace`` and ``torch.compile``/``torch.export``, whose shapes are fixed or
    guarded.
    """
    if torch.jit.is_tracing() or torch.compiler.is_compiling():
        return
    got = tuple(x.shape)
    if len(got) == len(expected) + 1 and all(
        e is None or e == g for e, g in zip(expected, got[1:], strict=True)
    ):
        return
    h, w = (got[-2], got[-1]) if len(got) >= 2 else ("?", "?")
    raise ValueError(message.format(shape=got, h=h, w=w))
