"""The training-time RepMLP block as dense matmuls: FC3 and every Local Perceptron branch as one FC each.

The paper's identity (Sec. 3.3): a same-padded conv on an ``h x w`` partition is an FC whose kernel holds
the conv's weights at fixed places and zeros elsewhere. On a GPU the Local Perceptron's convs are grouped
convs with a few channels a group on ``7 x 7`` maps, each launched with its own BatchNorm, while the same
sums as batched matmuls are a few large kernels on the tensor cores. So an eager training step there
computes every branch as an FC: the kernel is expanded into its dense FC (a view of the zero-padded kernel,
materialised once a step; autograd sums the FC's gradient back onto the kernel), one ``bmm`` gives the
branch's pre-BN output, and the branch's own BatchNorm normalises it on batch statistics, as the conv form
does. The dense FCs cost ``h*w / (kh*kw)`` times the convs' multiply-accumulates (zeros). Measured on an
H200 (``benchmarks/bench_gpu.py``, docs/gpu.md): eager training steps 3-18% faster than the conv form; as
CUDA graphs, where launches cost nothing, the conv form was 1-9% faster, and the engine uses it there. On a
CPU the conv form (with :mod:`repmlp.nn.branches_fc` for narrow groups) stays.

Layout: the partitions are *columns*, ``(g, C/g*h*w, B)`` with ``B = N*Hp*Wp``, so that every output is
``(O*h*w, B)`` in memory: FC3's ``BatchNorm1d(O*h*w)`` normalises it as ``(1, O*h*w, B)`` (features x
batch) and a branch's ``BatchNorm2d(O)`` as ``(1, O, h*w, B)``, both views, with the modules' own
parameters and running statistics. The sums are the conv form's; their order differs, so results agree
to float rounding, not bit for bit.

FC3 and the convs are read, not called: where a hook watches them (``RepMLPBlock._observed``), the block
runs the conv form instead, so that every module it holds runs its own call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp.nn.ops import is_channels_last

__all__ = [
    "conv_as_dense_flipped",
    "to_group_columns",
    "from_group_columns",
    "from_group_columns_like",
    "add_partition_values",
    "dense_partition_sum",
]


def conv_as_dense_flipped(kernel: Tensor, partition: tuple[int, int], groups: int) -> Tensor:
    """The FC of a same-padded stride-1 groupwise conv on an ``h x w`` map, for the map with both spatial
    axes reversed.

    Entry ``[j, (o, y, x), (c, i, u)]`` of the result is ``kernel[j*O/g + o, c, (h-1-i) - y + kh//2,
    (w-1-u) - x + kw//2]`` (zero outside the kernel): the FC that maps columns whose input points are
    reversed (:func:`dense_partition_sum` flips them once for all branches) to the conv's output at
    ``(y, x)``. Reversing the input turns the kernel's offsets into sums, so the FC is a sliding-window view
    (``unfold``) of the flipped, zero-padded kernel: one copy to materialise it, one ``unfold`` backward for
    the kernel's gradient, and memory of one FC kernel.

    Shapes: ``kernel`` ``(O, C/g, kh, kw)`` (odd sizes at most ``(h, w)``) -> ``(g, O/g*h*w, C/g*h*w)``.
    """
    out_ch, cg, kh, kw = kernel.shape
    h, w = partition
    # (O, C/g, 2h-1, 2w-1); F.pad takes the last dimension first.
    big = F.pad(kernel.flip(2, 3), (w - 1 - kw // 2, w - 1 - kw // 2, h - 1 - kh // 2, h - 1 - kh // 2))
    # (O, C/g, h, w, h, w): entry [o, c, y, x, i, u] is big[o, c, y + i, x + u]
    windows = big.unfold(2, h, 1).unfold(3, w, 1)
    return windows.permute(0, 2, 3, 1, 4, 5).reshape(groups, out_ch // groups * h * w, cg * h * w)


def to_group_columns(x: Tensor, h: int, w: int, groups: int) -> Tensor:
    """``(N, C, H, W)`` -> ``(g, C/g*h*w, N*H/h*W/w)``: each partition a column, per group (one copy).

    Columns are ordered ``(n, row, column)`` of the partitions, as :func:`repmlp.nn.ops.partition` orders them.
    """
    n, c, hh, ww = x.shape
    hp, wp = hh // h, ww // w
    return (
        x.reshape(n, groups, c // groups, hp, h, wp, w)
        .permute(1, 2, 4, 6, 0, 3, 5)
        .reshape(groups, (c // groups) * h * w, n * hp * wp)
    )


def add_partition_values(columns: Tensor, values: Tensor, h: int, w: int) -> Tensor:
    """Add one value per partition and channel to every point of that partition's column.

    Shapes: ``columns`` ``(g, C/g*h*w, B)``, ``values`` ``(N, C, Hp, Wp)`` (the Global Perceptron's output,
    ``B = N*Hp*Wp``) -> ``(g, C/g*h*w, B)``.
    """
    g, rows, b = columns.shape
    n, c, hp, wp = values.shape
    v = values.reshape(n, g, c // g, hp * wp).permute(1, 2, 0, 3).reshape(g, c // g, 1, b)
    return (columns.reshape(g, c // g, h * w, b) + v).reshape(g, rows, b)


def from_group_columns(
    maps: Tensor, n: int, hp: int, wp: int, h: int, w: int, channels_last: bool = False
) -> Tensor:
    """Inverse of :func:`to_group_columns` for an output ``(O, h*w, B)``: ``(N, O, Hp*h, Wp*w)`` (one copy;
    in channels_last memory when asked)."""
    o = maps.shape[0]
    m = maps.reshape(o, h, w, n, hp, wp)
    # contiguous(): with one partition (hp = wp = 1) the reshapes are views in the columns' order.
    if channels_last:
        return m.permute(3, 4, 1, 5, 2, 0).reshape(n, hp * h, wp * w, o).contiguous().permute(0, 3, 1, 2)
    return m.permute(3, 0, 4, 1, 5, 2).reshape(n, o, hp * h, wp * w).contiguous()


@torch.fx.wrap
def from_group_columns_like(x: Tensor, maps: Tensor, n: int, hp: int, wp: int, h: int, w: int) -> Tensor:
    """:func:`from_group_columns` in ``x``'s memory format (a channels_last model stays channels_last). A
    ``torch.fx`` leaf, since it branches on the layout."""
    return from_group_columns(maps, n, hp, wp, h, w, channels_last=is_channels_last(x))


def dense_partition_sum(
    columns: Tensor,
    fc3_weight: Tensor,
    fc3_bias: Tensor | None,
    fc3_bn: nn.Module | None,
    branches: Sequence[nn.Module],
    partition: tuple[int, int],
) -> Tensor:
    """``BN1d(FC3(p)) + sum_k BN_k(conv_k(p))`` for every partition ``p`` (a column), as dense matmuls.

    ``branches`` are :class:`repmlp.ConvBN` modules (``conv``: a same-padded stride-1 groupwise conv of
    the block's groups; ``bn``: a ``BatchNorm2d`` or ``None``); ``fc3_weight`` is FC3's ``(O*h*w, C/g*h*w)``
    kernel in grouped layout and ``fc3_bn`` its ``BatchNorm1d(O*h*w)`` (or ``None``). The BatchNorms run
    as modules, in their own mode: batch statistics (and running-statistics updates) in training.

    Shapes: ``columns`` ``(g, C/g*h*w, B)`` -> ``(O, h*w, B)``.
    """
    g, rows, b = columns.shape
    h, w = partition
    q = fc3_weight.shape[0]
    o = q // (h * w)
    y = torch.bmm(fc3_weight.reshape(g, q // g, rows), columns)  # (g, O/g*h*w, B)
    if fc3_bias is not None:
        y = y + fc3_bias.reshape(g, q // g, 1)
    total = y.reshape(1, q, b)  # FC3's features x the batch: BatchNorm1d's (N, C, L) with N = 1
    if fc3_bn is not None:
        total = fc3_bn(total)
    total = total.reshape(o, h * w, b)
    if not branches:
        return total
    # Reversed input points, for conv_as_dense_flipped: one copy shared by every branch.
    flipped = columns.reshape(g, rows // (h * w), h, w, b).flip(2, 3).reshape(g, rows, b)
    for branch in branches:
        conv = branch.conv
        z = torch.bmm(conv_as_dense_flipped(conv.weight, partition, g), flipped).reshape(1, o, h * w, b)
        if conv.bias is not None:
            z = z + conv.bias.reshape(1, o, 1, 1)
        if branch.bn is not None:
            z = branch.bn(z)  # BatchNorm2d over (1, O, h*w, B): per channel over every point and partition
        total = total + z.reshape(o, h * w, b)
    return total
