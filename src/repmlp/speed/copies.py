"""The RepMLP block's partition copies, written in the input's memory format, for the fast paths.

The plain block (:mod:`repmlp.nn.block`) writes its output in NCHW whatever its input's layout, so in a
channels_last model every conv after a block would first reorder its input. The copies here write the
input's layout instead, so a channels_last model stays channels_last from block to block; each branches
on the layout, so each is a ``torch.fx`` leaf (a traced graph decides when it runs). In training, the
partition map's copies are custom ops: the same single copies, each the other's gradient, but opaque to
``torch.compile``, whose CPU code generator otherwise fuses the permutes into the BatchNorm reductions
around them into slow strided loops; their backward hands on contiguous gradients.

Shapes as :mod:`repmlp.nn.block`'s ``partition``, ``unpartition`` and ``from_group_rows``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from repmlp.nn.block import from_group_rows, partition, unpartition

__all__ = [
    "is_channels_last",
    "partition_copy",
    "unpartition_copy",
    "unpartition_like",
    "from_group_rows_like",
]


def is_channels_last(x: Tensor) -> bool:
    """Whether ``x`` is stored channels_last and not also plain contiguous (as with one channel or 1x1)."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _nhwc(t: Tensor, n: int, hh: int, ww: int) -> Tensor:
    """``t`` ``(n, hh, ww, c)``-ordered values as a channels_last ``(n, c, hh, ww)`` tensor (one copy)."""
    return t.reshape(n, hh, ww, -1).contiguous().permute(0, 3, 1, 2)


@torch.library.custom_op("repmlp::partition_copy", mutates_args=())
def partition_copy(x: Tensor, h: int, w: int) -> Tensor:
    """:func:`~repmlp.nn.block.partition` as one copy into a fresh contiguous tensor."""
    n, c, hh, ww = x.shape
    out = x.new_empty((n * (hh // h) * (ww // w), c, h, w))
    out.view(n, hh // h, ww // w, c, h, w).copy_(
        x.view(n, c, hh // h, h, ww // w, w).permute(0, 2, 4, 1, 3, 5)
    )
    return out


@partition_copy.register_fake
def _(x: Tensor, h: int, w: int) -> Tensor:
    n, c, hh, ww = x.shape
    return x.new_empty((n * (hh // h) * (ww // w), c, h, w))


def _unpartition_out(p: Tensor, n: int, hp: int, wp: int, channels_last: bool) -> Tensor:
    _, c, h, w = p.shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return p.new_empty((n, c, hp * h, wp * w)).contiguous(memory_format=fmt)


@torch.library.custom_op("repmlp::unpartition_copy", mutates_args=())
def unpartition_copy(p: Tensor, n: int, hp: int, wp: int, channels_last: bool) -> Tensor:
    """:func:`~repmlp.nn.block.unpartition` as one copy into a fresh tensor, channels_last if asked."""
    out = _unpartition_out(p, n, hp, wp, channels_last)
    _, c, h, w = p.shape
    out.view(n, c, hp, h, wp, w).copy_(p.view(n, hp, wp, c, h, w).permute(0, 3, 1, 4, 2, 5))
    return out


unpartition_copy.register_fake(_unpartition_out)


def _partition_setup(ctx, inputs: tuple, output: Tensor) -> None:  # noqa: ANN001 - autograd's context
    x, h, w = inputs
    ctx.n, ctx.hp, ctx.wp, ctx.channels_last = (
        x.shape[0],
        x.shape[2] // h,
        x.shape[3] // w,
        is_channels_last(x),
    )


def _partition_backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
    return unpartition_copy(grad.contiguous(), ctx.n, ctx.hp, ctx.wp, ctx.channels_last), None, None


def _unpartition_setup(ctx, inputs: tuple, output: Tensor) -> None:  # noqa: ANN001
    ctx.h, ctx.w = inputs[0].shape[2], inputs[0].shape[3]


def _unpartition_backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
    return partition_copy(grad, ctx.h, ctx.w), None, None, None, None


partition_copy.register_autograd(_partition_backward, setup_context=_partition_setup)
unpartition_copy.register_autograd(_unpartition_backward, setup_context=_unpartition_setup)


@torch.fx.wrap
def partition_for(x: Tensor, h: int, w: int, training: bool) -> Tensor:
    """The partition map: in training the custom op's copy, in evaluation the plain copy that exporters
    (ONNX) know."""
    return torch.ops.repmlp.partition_copy(x, h, w) if training else partition(x, h, w)


@torch.fx.wrap
def unpartition_like(x: Tensor, p: Tensor, n: int, hp: int, wp: int, training: bool) -> Tensor:
    """The block's output from the partition map ``p``, in ``x``'s memory format."""
    if training:
        return torch.ops.repmlp.unpartition_copy(p.contiguous(), n, hp, wp, is_channels_last(x))
    if not is_channels_last(x):
        return unpartition(p, n, hp, wp)
    _, c, h, w = p.shape
    return _nhwc(p.reshape(n, hp, wp, c, h, w).permute(0, 1, 4, 2, 5, 3), n, hp * h, wp * w)


@torch.fx.wrap
def from_group_rows_like(x: Tensor, y: Tensor, n: int, hp: int, wp: int, h: int, w: int) -> Tensor:
    """The deployed block's output from FC3's rows ``y`` ``(g, N*hp*wp, O/g*h*w)``, in ``x``'s memory format."""
    if not is_channels_last(x):
        return from_group_rows(y, n, hp, wp, h, w)
    g, og = y.shape[0], y.shape[2] // (h * w)
    return _nhwc(y.reshape(g, n, hp, wp, og, h, w).permute(1, 2, 5, 3, 6, 0, 4), n, hp * h, wp * w)
