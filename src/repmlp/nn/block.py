"""The RepMLP block (paper Sec. 3.2-3.4): Global, Partition and Local Perceptron, and its conversion.

Training-time block (2-D; the 1-D block is the same on sequences)::

    x (N,C,H,W) --pad--> partitions (N*Hp*Wp, C, h, w) + GlobalPerceptron(x), broadcast over each partition
        -> PartitionPerceptron: FC3 (groupwise) + BN1d(O*h*w)
        +  LocalPerceptron: sum of conv(K)+BN branches, groupwise, same padding
        -> un-partition -> crop -> (N, O, H, W)

:meth:`RepMLPBlock.reparameterize` merges the Local Perceptron and every BatchNorm into FC1 and FC3, after
which the block computes the same function with three FC layers (FC1, FC2, FC3). The block computes one
way, on inputs in either memory format, and writes its output in its input's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp.nn import checks
from repmlp.nn.layers import ConvBN, GroupwiseLinear
from repmlp.nn.reparam import absorb_bn_into_fc, format_size, merge_fc3, ntuple

__all__ = [
    "GlobalPerceptron",
    "PartitionPerceptron",
    "LocalPerceptron",
    "RepMLPBlock",
    "RepMLPBlock1d",
    "is_channels_last",
    "merge_image",
    "partition",
    "unpartition",
    "to_group_rows",
    "from_group_rows",
]


# ------------------------------------------------------------------------------------- partitions
# The copies below write their output in the input's memory format, as PyTorch's own layers do: a
# channels_last model stays channels_last from block to block, an NCHW one NCHW, with one copy either way.
# Each takes the format as an argument, so each is a ``torch.fx`` leaf (a traced graph records the call).
@torch.fx.wrap
def is_channels_last(x: Tensor) -> bool:
    """Whether ``x`` is stored channels_last and not also plain contiguous (as a tensor of one channel or of
    1x1 maps is): the memory format the block's outputs take (``torch.channels_last`` if so, else NCHW)."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


@torch.fx.wrap
def merge_image(t: Tensor, channels_last: bool, size: tuple[int, int] | None = None) -> Tensor:
    """``t`` ``(n, g, og, hp, h, wp, w)``-shaped as the image ``(n, g*og, hp*h, wp*w)``, cropped to ``size``
    ``(H, W)`` if given, in one copy (two when cropped): NCHW, or channels_last (the channels innermost)."""
    n, g, og, hp, h, wp, w = t.shape
    if channels_last:
        img = t.permute(0, 3, 4, 5, 6, 1, 2).contiguous().view(n, hp * h, wp * w, g * og)
        img = img if size is None else img[:, : size[0], : size[1]].contiguous()
        return img.permute(0, 3, 1, 2)
    img = t.contiguous().view(n, g * og, hp * h, wp * w)
    return img if size is None else img[:, :, : size[0], : size[1]].contiguous()


@torch.fx.wrap
def partition(x: Tensor, h: int, w: int, channels_last: bool = False) -> Tensor:
    """``(N, C, Hp*h, Wp*w)`` -> the partition map ``(N*Hp*Wp, C, h, w)``, partitions in ``(n, row, column)``
    order (one copy; channels_last if ``channels_last``)."""
    n, c, hh, ww = x.shape
    hp, wp = hh // h, ww // w
    if channels_last:  # in (n, H, W, c) order, so that the gradient comes back channels_last too
        t = x.permute(0, 2, 3, 1).reshape(n, hp, h, wp, w, c).permute(0, 1, 3, 2, 4, 5)
        return t.reshape(n * hp * wp, h, w, c).contiguous().permute(0, 3, 1, 2)
    return x.reshape(n, c, hp, h, wp, w).permute(0, 2, 4, 1, 3, 5).reshape(n * hp * wp, c, h, w).contiguous()


@torch.fx.wrap
def unpartition(
    p: Tensor, n: int, hp: int, wp: int, channels_last: bool = False, size: tuple[int, int] | None = None
) -> Tensor:
    """Inverse of :func:`partition`: ``(N*hp*wp, C, h, w)`` -> ``(N, C, hp*h, wp*w)``, cropped to ``size``
    if given (:func:`merge_image`)."""
    _, c, h, w = p.shape
    if not channels_last:
        return merge_image(p.reshape(n, hp, wp, 1, c, h, w).permute(0, 3, 4, 1, 5, 2, 6), False, size)
    # in (n, H, W, c) order, so that the gradient comes back channels_last too
    img = (
        p.permute(0, 2, 3, 1)
        .reshape(n, hp, wp, h, w, c)
        .permute(0, 1, 3, 2, 4, 5)
        .reshape(n, hp * h, wp * w, c)
    )
    return (img if size is None else img[:, : size[0], : size[1]]).contiguous().permute(0, 3, 1, 2)


def to_group_rows(x: Tensor, h: int, w: int, groups: int) -> Tensor:
    """``(N, C, Hp*h, Wp*w)`` -> FC3's input rows per group, ``(g, N*Hp*Wp, C/g*h*w)``: partitioning and the
    group split in one copy, from either memory format."""
    n, c, hh, ww = x.shape
    hp, wp = hh // h, ww // w
    rows = x.reshape(n, groups, c // groups, hp, h, wp, w).permute(1, 0, 3, 5, 2, 4, 6)
    return rows.reshape(groups, n * hp * wp, (c // groups) * h * w)


@torch.fx.wrap
def from_group_rows(
    y: Tensor, n: int, hp: int, wp: int, h: int, w: int, channels_last: bool = False,
    size: tuple[int, int] | None = None,
) -> Tensor:  # fmt: skip
    """Inverse of :func:`to_group_rows`: ``(g, N*hp*wp, O/g*h*w)`` -> ``(N, O, hp*h, wp*w)``, cropped to
    ``size`` if given (:func:`merge_image`)."""
    g, og = y.shape[0], y.shape[2] // (h * w)
    return merge_image(y.reshape(g, n, hp, wp, og, h, w).permute(1, 0, 4, 2, 5, 3, 6), channels_last, size)


# ------------------------------------------------------------------------------------- perceptrons
class GlobalPerceptron(nn.Module):
    """Inter-partition correlations (paper Sec. 3.2): each partition average-pooled to one value per channel,
    then BN -> FC1 -> ReLU -> FC2 on the flattened ``(C, *parts)`` vector (FC1: ``C*Hp*Wp`` ->
    ``C*Hp*Wp // reduction``). 2-D for ``partition = (h, w)``, 1-D for ``(l,)``.

    Shapes: ``(N, C, Hp*h, Wp*w)`` -> ``(N, C, Hp, Wp)``; 1-D ``(N, C, Lp*l)`` -> ``(N, C, Lp)``.
    """

    def __init__(
        self, channels: int, parts: tuple[int, ...], partition: tuple[int, ...], reduction: int = 1,
        deploy: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        width = channels * math.prod(parts)
        if not isinstance(reduction, int) or isinstance(reduction, bool) or reduction < 1:
            raise ValueError(f"global_reduction must be a positive int, got {reduction!r}")
        if width // reduction < 1:
            raise ValueError(f"global_reduction={reduction} leaves FC1 no outputs (input width {width})")
        two_d = len(partition) == 2
        self.pool = nn.AvgPool2d(partition) if two_d else nn.AvgPool1d(partition)
        bn = nn.BatchNorm2d(channels) if two_d else nn.BatchNorm1d(channels)
        self.bn: nn.modules.batchnorm._BatchNorm | None = None if deploy else bn
        self.fc1 = nn.Linear(width, width // reduction)
        self.fc2 = nn.Linear(width // reduction, width)

    def forward(self, x: Tensor) -> Tensor:
        v = self.pool(x).contiguous()  # the layout flatten() below gives the BN's gradient, in any model
        if self.bn is not None:
            v = self.bn(v)
        return self.fc2(F.relu(self.fc1(v.flatten(1)))).reshape(v.shape)

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Absorb the BN into FC1 (paper Appendix C)."""
        if self.bn is not None:
            weight, bias = absorb_bn_into_fc(self.fc1.weight, self.fc1.bias, self.bn)
            self.fc1.weight.copy_(weight)
            self.fc1.bias.copy_(bias)
            self.bn = None


class PartitionPerceptron(nn.Module):
    """FC3, a groupwise FC over a whole partition, followed in training by ``BatchNorm1d(O*h*w)`` (``h*w``:
    the partition's volume, ``l`` in 1-D).

    Shapes: per-group rows ``(g, B, C/g*h*w)`` -> ``(g, B, O/g*h*w)``.
    """

    def __init__(
        self, in_channels: int, out_channels: int, partition: tuple[int, ...], groups: int, deploy: bool
    ) -> None:
        super().__init__()
        volume = math.prod(partition)
        self.fc3 = GroupwiseLinear(in_channels * volume, out_channels * volume, groups, bias=deploy)
        self.bn: nn.BatchNorm1d | None = None if deploy else nn.BatchNorm1d(out_channels * volume)

    def forward(self, rows: Tensor) -> Tensor:
        y = self.fc3(rows)
        if self.bn is None:
            return y
        g, b, q = y.shape
        return self.bn(y.transpose(0, 1).reshape(b, g * q)).reshape(b, g, q).transpose(0, 1)


class LocalPerceptron(nn.Module):
    """Parallel groupwise conv+BN branches on the partition map, summed (training time only). Kernels are
    ``(kh, kw)`` (2-D convs) or ``(k,)`` (1-D convs).

    Shapes: ``(B, C, h, w)`` -> ``(B, O, h, w)``; 1-D ``(B, C, l)`` -> ``(B, O, l)``.
    """

    def __init__(
        self, in_channels: int, out_channels: int, kernel_sizes: Sequence[tuple[int, ...]], groups: int
    ) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            ConvBN(in_channels, out_channels, k, groups=groups, dims=len(k)) for k in kernel_sizes
        )

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor | None = None  # a loop over the whole ModuleList: TorchScript slices none
        for branch in self.branches:
            y = branch(x)
            out = y if out is None else out + y
        assert out is not None  # the block builds a Local Perceptron only with kernels
        return out


# ------------------------------------------------------------------------------------- the blocks
def _positive(value: int | Sequence[int], dims: int, name: str) -> tuple[int, ...]:
    size = ntuple(value, dims, name)
    if min(size) < 1:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size


def _kernel_sizes(
    kernel_sizes: Sequence[int | Sequence[int]], part: tuple[int, ...]
) -> tuple[tuple[int, ...], ...]:
    """The Local Perceptron's kernel sizes as tuples: odd (same padding) and no larger than the partition."""
    if not isinstance(kernel_sizes, Sequence) or isinstance(kernel_sizes, str):
        raise ValueError(
            f"kernel_sizes must be a sequence of kernel sizes such as (1, 3, 5), got {kernel_sizes!r}"
        )
    kernels = tuple(_positive(k, len(part), "kernel_sizes") for k in kernel_sizes)
    for size in kernels:
        if any(v % 2 == 0 for v in size):
            raise ValueError(f"kernel_sizes must be odd (same padding), got {format_size(size)}")
        if any(v > p for v, p in zip(size, part, strict=True)):
            raise ValueError(
                f"kernel_sizes entry {format_size(size)} is larger than the partition {format_size(part)}"
            )
    return kernels


class _RepMLP(nn.Module):
    """What the 2-D and 1-D blocks share: the arguments' checks, the three perceptrons and the conversion.

    ``size`` is the input's spatial size ``(H, W)`` or ``(L,)``; ``partition`` and every kernel have as many
    dimensions. Inputs not a multiple of the partition are zero-padded at the end and cropped back.
    """

    def __init__(
        self, in_channels: int, out_channels: int, size: int | Sequence[int], partition: int | Sequence[int], *,
        dims: int, size_name: str, groups: int, kernel_sizes: Sequence[int | Sequence[int]], global_reduction: int,
        global_perceptron: bool, deploy: bool,
    ) -> None:  # fmt: skip
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"groups={groups} must divide in_channels={in_channels} and out_channels={out_channels}"
            )
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.size = _positive(size, dims, size_name)
        self.partition = _positive(partition, dims, "partition")
        self.kernel_sizes = _kernel_sizes(kernel_sizes, self.partition)
        self.parts = tuple(-(-n // p) for n, p in zip(self.size, self.partition, strict=True))
        self.padding = tuple(k * p - n for k, p, n in zip(self.parts, self.partition, self.size, strict=True))
        has_global = global_perceptron and math.prod(self.parts) > 1  # one partition: nothing to correlate
        self.global_perceptron = (
            GlobalPerceptron(in_channels, self.parts, self.partition, global_reduction, deploy)
            if has_global
            else None
        )
        self.partition_perceptron = PartitionPerceptron(
            in_channels, out_channels, self.partition, groups, deploy
        )
        self.local_perceptron = (
            LocalPerceptron(in_channels, out_channels, self.kernel_sizes, groups)
            if self.kernel_sizes and not deploy
            else None
        )
        self.deploy = deploy

    def extra_repr(self) -> str:
        return (
            f"in_channels={self.in_channels}, out_channels={self.out_channels}, size={self.size}, "
            f"partition={self.partition}, groups={self.groups}, kernel_sizes={self.kernel_sizes}, deploy={self.deploy}"
        )

    @torch.no_grad()
    def merged_fc3(self) -> tuple[Tensor, Tensor]:
        """The inference FC3: kernel ``(O*h*w, C*h*w/g)`` and bias ``(O*h*w,)``, FC3 with its BN and every Local
        Perceptron branch merged (:func:`~repmlp.nn.reparam.merge_fc3`, running statistics)."""
        pp = self.partition_perceptron
        branches = [] if self.local_perceptron is None else self.local_perceptron.branches
        return merge_fc3(
            pp.fc3.weight, pp.fc3.bias, pp.bn, [(b.conv.weight, b.conv.bias, b.bn) for b in branches],
            self.partition, self.groups,
        )  # fmt: skip

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Convert in place into the inference structure: FC1, FC2, FC3 only (paper Sec. 3.4). Equivalent in
        eval mode (the BatchNorms' running statistics are what gets merged)."""
        if self.deploy:
            return
        weight, bias = self.merged_fc3()
        fc3 = GroupwiseLinear(weight.shape[1] * self.groups, weight.shape[0], self.groups, bias=True)
        fc3 = fc3.to(device=weight.device, dtype=weight.dtype).train(self.training)
        fc3.weight.copy_(weight)
        fc3.bias.copy_(bias)
        self.partition_perceptron.fc3, self.partition_perceptron.bn = fc3, None
        self.local_perceptron = None
        if self.global_perceptron is not None:
            self.global_perceptron.reparameterize()
        self.deploy = True


class RepMLPBlock(_RepMLP):
    """RepMLP: Global, Partition and Local Perceptron, re-parameterizable into three FC layers.

    Args:
        in_channels: ``C``; out_channels: ``O``.
        resolution: ``(H, W)`` of the input the block will see (int or pair).
        partition: ``(h, w)`` of each partition (int or pair).
        groups: ``g`` of FC3 and of every Local Perceptron conv.
        kernel_sizes: the Local Perceptron's branches, each an odd int or ``(kh, kw)`` pair no larger than
            the partition; empty for none.
        global_reduction: FC1's output width is ``C*Hp*Wp // global_reduction``.
        global_perceptron: ``False`` drops the Global Perceptron (absent too when the input is one partition).
        deploy: build the inference structure (FC1, FC2, FC3 with bias; no BN, no conv).

    Shapes: ``(N, C, H, W)`` -> ``(N, O, H, W)``.
    """

    def __init__(
        self, in_channels: int, out_channels: int, resolution: int | Sequence[int], partition: int | Sequence[int],
        *, groups: int = 1, kernel_sizes: Sequence[int | Sequence[int]] = (1, 3, 5, 7), global_reduction: int = 1,
        global_perceptron: bool = True, deploy: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(
            in_channels, out_channels, resolution, partition, dims=2, size_name="resolution", groups=groups,
            kernel_sizes=kernel_sizes, global_reduction=global_reduction, global_perceptron=global_perceptron,
            deploy=deploy,
        )  # fmt: skip
        self.resolution: tuple[int, int] = (self.size[0], self.size[1])

    def forward(self, x: Tensor) -> Tensor:
        c, (h, w), (hp, wp), g = self.in_channels, self.partition, self.parts, self.groups
        checks.check_input_shape(
            x, (c, *self.resolution),
            f"RepMLPBlock expected input of shape (N, {c}, {self.resolution[0]}, {self.resolution[1]}), got {{shape}}",
        )  # fmt: skip
        cl = is_channels_last(x)  # the output's memory format
        crop: tuple[int, int] | None = None
        if self.padding != (0, 0):
            x = F.pad(x, (0, self.padding[1], 0, self.padding[0]))
            crop = self.resolution
        n, b = x.shape[0], x.shape[0] * hp * wp
        if self.local_perceptron is None:  # the inference structure: FC3 straight on the partitions' rows
            rows = to_group_rows(x, h, w, g)
            if self.global_perceptron is not None:  # one value per partition and channel, over its h*w points
                v = self.global_perceptron(x).reshape(n, g, c // g, hp, wp).permute(1, 0, 3, 4, 2)
                rows = (rows.reshape(g, b, c // g, h * w) + v.reshape(g, b, c // g, 1)).reshape(rows.shape)
            return from_group_rows(self.partition_perceptron(rows), n, hp, wp, h, w, cl, crop)
        parts = partition(x, h, w, cl)  # (B, C, h, w), in x's memory format
        if self.global_perceptron is not None:
            parts = parts + self.global_perceptron(x).permute(0, 2, 3, 1).reshape(b, c, 1, 1)
        fc3 = self.partition_perceptron(parts.reshape(b, g, -1).transpose(0, 1))
        local = self.local_perceptron(parts)
        return unpartition(local + fc3.transpose(0, 1).reshape(local.shape), n, hp, wp, cl, crop)


class RepMLPBlock1d(_RepMLP):
    """RepMLP on sequences ``(N, C, L)``: partitions of ``l`` consecutive positions, 1-D convs in the Local
    Perceptron, the same conversion. Arguments as :class:`RepMLPBlock`'s, with ``length`` (``L``) for the
    resolution and ``partition`` an int ``l`` (or 1-tuple).

    Shapes: ``(N, C, L)`` -> ``(N, O, L)``.
    """

    def __init__(
        self, in_channels: int, out_channels: int, length: int, partition: int | Sequence[int], *, groups: int = 1,
        kernel_sizes: Sequence[int | Sequence[int]] = (1, 3, 5, 7), global_reduction: int = 1,
        global_perceptron: bool = True, deploy: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(
            in_channels, out_channels, length, partition, dims=1, size_name="length", groups=groups,
            kernel_sizes=kernel_sizes, global_reduction=global_reduction, global_perceptron=global_perceptron,
            deploy=deploy,
        )  # fmt: skip
        self.length: int = self.size[0]

    def forward(self, x: Tensor) -> Tensor:
        c, o, (l,), (lp,), g = self.in_channels, self.out_channels, self.partition, self.parts, self.groups
        checks.check_input_shape(
            x,
            (c, self.length),
            f"RepMLPBlock1d expected input of shape (N, {c}, {self.length}), got {{shape}}",
        )
        if self.padding[0]:
            x = F.pad(x, (0, self.padding[0]))
        n = x.shape[0]
        parts = x.reshape(n, c, lp, l).transpose(1, 2).reshape(n * lp, c, l)  # (N*Lp, C, l)
        if self.global_perceptron is not None:
            parts = parts + self.global_perceptron(x).transpose(1, 2).reshape(n * lp, c, 1)
        out = self.partition_perceptron(parts.reshape(n * lp, g, -1).transpose(0, 1))
        out = out.transpose(0, 1).reshape(n * lp, o, l)
        if self.local_perceptron is not None:
            out = out + self.local_perceptron(parts)
        out = out.reshape(n, lp, o, l).transpose(1, 2).reshape(n, o, lp * l)
        return out[:, :, : self.length] if self.padding[0] else out
