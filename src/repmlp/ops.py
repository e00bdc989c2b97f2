"""Tensor re-arrangements and the groupwise FC used by RepMLP (paper Sec. 3.2).

The paper implements the groupwise FC (FC3) as a grouped 1x1 conv, which it notes is inefficient.
On the CPU we measured (``benchmarks/bench_fc3.py``, results in ``docs/benchmarks.md``), a batched
matmul over a ``(g, partitions, C*h*w/g)`` layout computes the same result 6-11x faster than the
grouped 1x1 conv and within 9% of the fastest of the other layouts tried, so it is used on every
device; no GPU was available to measure on (``bench_fc3.py --device cuda`` does). The
grouped-conv form stays available as :func:`groupwise_fc_conv` for reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "partition",
    "unpartition",
    "to_group_rows",
    "from_group_rows",
    "groupwise_fc",
    "groupwise_fc_conv",
]


def partition(x: Tensor, h: int, w: int) -> Tensor:
    """Split ``(N, C, H, W)`` into the partition map ``(N*H/h*W/w, C, h, w)`` (one permute).

    Partitions are ordered ``(n, row, column)``.
    """
    n, c, hh, ww = x.shape
    hp, wp = hh // h, ww // w
    return x.reshape(n, c, hp, h, wp, w).permute(0, 2, 4, 1, 3, 5).reshape(n * hp * wp, c, h, w)


def unpartition(p: Tensor, n: int, hp: int, wp: int) -> Tensor:
    """Inverse of :func:`partition`: ``(N*hp*wp, C, h, w)`` -> ``(N, C, hp*h, wp*w)``."""
    _, c, h, w = p.shape
    return p.reshape(n, hp, wp, c, h, w).permute(0, 3, 1, 4, 2, 5).reshape(n, c, hp * h, wp * w)


def to_group_rows(x: Tensor, h: int, w: int, groups: int) -> Tensor:
    """``(N, C, H, W)`` -> ``(g, N*H/h*W/w, C/g*h*w)``: partitions as FC input rows, per group.

    One permute does both the partitioning and the group split, so FC3 needs no further copy.
    """
    n, c, hh, ww = x.shape
    hp, wp = hh // h, ww // w
    return (
        x.reshape(n, groups, c // groups, hp, h, wp, w)
        .permute(1, 0, 3, 5, 2, 4, 6)
        .reshape(groups, n * hp * wp, (c // groups) * h * w)
    )


def from_group_rows(
    y: Tensor, n: int, hp: int, wp: int, h: int, w: int, *, channels_last: bool = False
) -> Tensor:
    """Inverse of :func:`to_group_rows`: ``(g, N*hp*wp, O/g*h*w)`` -> ``(N, O, hp*h, wp*w)``.

    One copy either way; ``channels_last=True`` makes it write the result in channels_last memory
    order, so a channels_last model stays channels_last (the next conv needs no layout change).
    """
    g = y.shape[0]
    og = y.shape[2] // (h * w)
    y = y.reshape(g, n, hp, wp, og, h, w)
    if channels_last:
        nhwc = y.permute(1, 2, 5, 3, 6, 0, 4).reshape(n, hp * h, wp * w, g * og)
        return nhwc.permute(0, 3, 1, 2)
    return y.permute(1, 0, 4, 2, 5, 3, 6).reshape(n, g * og, hp * h, wp * w)


def groupwise_fc(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Groupwise FC on per-group rows.

    Args:
        rows: ``(g, B, P/g)`` input rows of each group.
        weight: ``(Q, P/g)`` kernel in grouped-1x1-conv layout (rows of group ``j`` are
            ``j*Q/g ... (j+1)*Q/g - 1``).
        bias: ``(Q,)`` or ``None``.

    Returns:
        ``(g, B, Q/g)``.
    """
    g = rows.shape[0]
    wt = weight.reshape(g, weight.shape[0] // g, weight.shape[1]).transpose(1, 2)
    if bias is None:
        return torch.bmm(rows, wt)
    return torch.baddbmm(bias.reshape(g, 1, -1), rows, wt)


def groupwise_fc_conv(x: Tensor, weight: Tensor, bias: Tensor | None, groups: int) -> Tensor:
    """The paper's gMMUL: a groupwise FC as a grouped 1x1 conv. ``x``: ``(B, P)`` -> ``(B, Q)``."""
    q, pg = weight.shape
    out = F.conv2d(x.reshape(x.shape[0], -1, 1, 1), weight.reshape(q, pg, 1, 1), bias, groups=groups)
    return out.reshape(x.shape[0], q)
