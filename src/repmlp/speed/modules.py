"""The fast modules of the models' modules: subclasses that compute the same function faster on some device.

Each subclasses one plain module and overrides its ``forward`` only (no parameters or buffers of its own),
so a pass (:mod:`repmlp.speed.passes`) can change a module's class in place and back: state-dict keys,
hooks and weights stay. They are never built directly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp.models.pure_mlp import PartitionConvBlock
from repmlp.nn.block import LocalPerceptron, RepMLPBlock, to_group_rows
from repmlp.speed import copies
from repmlp.speed.copies import is_channels_last
from repmlp.speed.dense import dense_branch_sum

__all__ = [
    "FastRepMLPBlock",
    "DenseLocalPerceptron",
    "FastPartitionConvBlock",
    "DensePartitionConvBlock",
    "LayoutConv2d",
    "PatchwiseConv2d",
    "MaxPool2x2",
]


class FastRepMLPBlock(RepMLPBlock):
    """:class:`~repmlp.RepMLPBlock` whose output keeps its input's memory format (a channels_last model
    stays channels_last) and whose training-time partition copies are the custom ops of
    :mod:`repmlp.speed.copies`. The same values as the plain block, bit for bit."""

    def forward(self, x: Tensor) -> Tensor:
        c, (h, w), (hp, wp), g = self.in_channels, self.partition, self.parts, self.groups
        if self.padding != (0, 0):
            x = F.pad(x, (0, self.padding[1], 0, self.padding[0]))
        n, b = x.shape[0], x.shape[0] * hp * wp
        if self.local_perceptron is None:
            rows = to_group_rows(x, h, w, g)
            if self.global_perceptron is not None:
                v = self.global_perceptron(x).reshape(n, g, c // g, hp, wp).permute(1, 0, 3, 4, 2)
                rows = (rows.reshape(g, b, c // g, h * w) + v.reshape(g, b, c // g, 1)).reshape(rows.shape)
            out = copies.from_group_rows_like(x, self.partition_perceptron(rows), n, hp, wp, h, w)
        else:
            parts = copies.partition_for(x, h, w, self.training)
            if self.global_perceptron is not None:
                parts = parts + self.global_perceptron(x).permute(0, 2, 3, 1).reshape(b, c, 1, 1)
            fc3 = self.partition_perceptron(parts.reshape(b, g, -1).transpose(0, 1))
            out = fc3.transpose(0, 1).reshape(b, -1, h, w) + self.local_perceptron(parts)
            out = copies.unpartition_like(x, out, n, hp, wp, self.training)
        if self.padding != (0, 0):
            out = out[:, :, : self.resolution[0], : self.resolution[1]]
        return out


class DenseLocalPerceptron(LocalPerceptron):
    """:class:`~repmlp.LocalPerceptron` whose branches train as one dense FC (:mod:`repmlp.speed.dense`) on
    maps of ``map_size`` (set by the pass); evaluation runs the convs. Its convs' own hooks do not fire in
    training."""

    map_size: tuple[int, int]

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            return dense_branch_sum(x, list(self.branches), *self.map_size)
        return super().forward(x)


class FastPartitionConvBlock(PartitionConvBlock):
    """Row D's block (:class:`~repmlp.models.pure_mlp.PartitionConvBlock`) with the partition copies of
    :class:`FastRepMLPBlock`."""

    def forward(self, x: Tensor) -> Tensor:
        n, c, p = x.shape[0], self.in_channels, self.partition
        parts = copies.partition_for(x, p, p, self.training)
        if self.global_perceptron is not None:
            parts = parts + self.global_perceptron(x).permute(0, 2, 3, 1).reshape(parts.shape[0], c, 1, 1)
        return copies.unpartition_like(x, self.convs(parts), n, self.parts, self.parts, self.training)

    def convs(self, parts: Tensor) -> Tensor:
        """The big conv plus the Local Perceptron's on the partition map ``(B, C, p, p)`` -> ``(B, O, p, p)``."""
        out = self.conv(parts)
        for branch in self.local or ():
            out = out + branch(parts)
        return out


class DensePartitionConvBlock(FastPartitionConvBlock):
    """:class:`FastPartitionConvBlock` whose big conv and Local Perceptron train as one dense FC."""

    def convs(self, parts: Tensor) -> Tensor:
        if self.training:
            return dense_branch_sum(parts, [self.conv, *(self.local or ())], self.partition, self.partition)
        return super().convs(parts)


class _Relayout(torch.autograd.Function):
    """``x.contiguous(memory_format=layout)`` whose backward hands the gradient back in ``x``'s own layout."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layout: torch.memory_format) -> Tensor:
        ctx.layout = torch.channels_last if is_channels_last(x) else torch.contiguous_format
        return x.contiguous(memory_format=layout)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.contiguous(memory_format=ctx.layout), None


class LayoutConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose training forward on a plain NCHW CPU input writes NCHW, as the Local Perceptron's
    partition map is: with channels_last weights (a channels_last model) oneDNN would write channels_last,
    and a BatchNorm whose gradient and input differ in layout runs its backward several times slower. Convs
    that oneDNN has no direct NCHW kernel for (:func:`slow_in_nchw`: it runs an im2col GEMM per image and
    group instead) compute in channels_last inside and hand back NCHW, with an NCHW input gradient."""

    def forward(self, x: Tensor) -> Tensor:
        return _conv_in_layout_of(x, self)


@torch.fx.wrap
def _conv_in_layout_of(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """:class:`LayoutConv2d`'s forward; a ``torch.fx`` leaf, since it branches on the layout."""
    if x.device.type != "cpu" or x.dim() != 4 or not x.is_contiguous() or not torch.is_grad_enabled():
        return nn.Conv2d.forward(conv, x)
    if not slow_in_nchw(conv):
        return conv._conv_forward(x, conv.weight.clone(memory_format=torch.contiguous_format), conv.bias)
    cl = torch.channels_last
    y = conv._conv_forward(_Relayout.apply(x, cl), conv.weight.contiguous(memory_format=cl), conv.bias)
    return _Relayout.apply(y, torch.contiguous_format)


def slow_in_nchw(conv: nn.Conv2d) -> bool:
    """Whether oneDNN has no direct NCHW kernel for this training conv: a kernel above 1x1 whose groups have a
    number of input or output channels that is not a multiple of 8 (the float32 vector width of AVX2)."""
    per_group_out = conv.out_channels // conv.groups
    per_group_in = conv.in_channels // conv.groups
    return conv.kernel_size[0] * conv.kernel_size[1] > 1 and bool(per_group_in % 8 or per_group_out % 8)


class PatchwiseConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose kernel tiles its input (kernel = stride, no padding, no dilation, one group),
    computed as one matmul over each patch's pixels: the paper's FC on each pixel or ``k x k`` patch. oneDNN
    runs such a conv slowly on one input channel (its weight gradient most), and on a ``1 x 1`` map a conv
    kernel's set-up outweighs the product. Output in channels_last memory.

    Shapes: ``(N, C_in, H, W)`` -> ``(N, C_out, H/k, W/k)``.
    """

    @staticmethod
    def tiles(conv: nn.Conv2d) -> bool:
        k = conv.kernel_size
        return k[0] == k[1] and k == conv.stride and conv.padding == (0, 0) and conv.dilation == (1, 1) and (
            conv.groups == 1 and conv.padding_mode == "zeros"
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        k = self.kernel_size[0]
        x = F.pixel_unshuffle(x, k) if k > 1 else x  # a patch's values in the kernel's order
        return F.linear(x.permute(0, 2, 3, 1), self.weight.flatten(1), self.bias).permute(0, 3, 1, 2)


class MaxPool2x2(nn.MaxPool2d):
    """``nn.MaxPool2d(2)`` as two elementwise maxima over strided views on a contiguous NCHW input: PyTorch's
    CPU NCHW max-pool kernel runs far slower than a copy of its input. Other inputs: the plain pooling."""

    def forward(self, x: Tensor) -> Tensor:
        return _max_pool_2x2(x)


@torch.fx.wrap
def _max_pool_2x2(x: Tensor) -> Tensor:
    """:class:`MaxPool2x2`'s forward; a ``torch.fx`` leaf, since it branches on the shape and layout."""
    n, c, h, w = x.shape
    if h % 2 or w % 2 or not x.is_contiguous():
        return F.max_pool2d(x, 2)
    rows = x.view(n, c, h // 2, 2, w)
    pairs = torch.maximum(rows[:, :, :, 0], rows[:, :, :, 1]).view(n, c, h // 2, w // 2, 2)
    return torch.maximum(pairs[..., 0], pairs[..., 1])
