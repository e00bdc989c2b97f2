"""Parallel conv+BN branches on small partition maps computed as one dense FC (paper Sec. 3.3's identity).

A same-padded conv on an ``h x w`` partition is an FC whose kernel holds the conv's weights at fixed places
and zeros elsewhere. Where the convs run slowly (groups of a few channels on a CPU, whose oneDNN kernels
then fall to slow paths; many small launches on a GPU), the same sums as one batched matmul over every
branch run at the machine's matmul rate: the kernels are gathered into the dense FC by a fixed index (so
autograd scatters the FC's gradient back onto the kernels), one ``bmm`` gives every branch's output, and
each branch's own BatchNorm normalises its slice. Zeros add nothing, so this is the convs' function; the
sums are ordered differently, so results agree to float rounding, not bit for bit. The convs' modules are
read, not called: their forward hooks do not fire here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from repmlp.nn.layers import ConvBN

__all__ = ["dense_conv_index", "dense_branch_sum", "fits_dense"]

# Largest ratio of the dense FC's multiply-accumulates to the convs' at which a CPU uses the dense version.
# oneDNN's training convs of a few channels a group ran several times below the matmul rate where this was
# measured (docs/benchmarks.md, benchmarks/bench_local_convs.py); the zeros' extra work must stay below that.
FC_MAC_RATIO = 4.0


@functools.lru_cache(maxsize=128)
def dense_conv_index(out_ch: int, cg: int, kh: int, kw: int, h: int, w: int) -> Tensor:
    """Where a same-padded stride-1 conv kernel ``(O, C/g, kh, kw)`` goes in its FC on an ``h x w`` map.

    A long tensor ``(O*h*w, C/g*h*w)`` in :func:`repmlp.nn.reparam.conv_to_fc`'s layout: entry ``i + 1``
    is the kernel's ``i``-th element (flattened), ``0`` a zero. Kernels larger than the map are allowed
    (their outer taps only ever meet the padding).
    """
    ys, xs = torch.arange(h), torch.arange(w)
    dy = ys[None, :] - ys[:, None] + kh // 2  # (y_out, y_in): the kernel row linking them
    dx = xs[None, :] - xs[:, None] + kw // 2
    valid = ((dy >= 0) & (dy < kh))[:, None, :, None] & ((dx >= 0) & (dx < kw))[None, :, None, :]
    tap = dy.clamp(0, kh - 1)[:, None, :, None] * kw + dx.clamp(0, kw - 1)[None, :, None, :]
    o = torch.arange(out_ch).reshape(out_ch, 1, 1, 1, 1, 1)
    c = torch.arange(cg).reshape(1, 1, 1, cg, 1, 1)
    index = torch.where(valid[None, :, :, None], (o * cg + c) * (kh * kw) + tap[None, :, :, None] + 1, 0)
    return index.reshape(out_ch * h * w, cg * h * w)  # (o, y_out, x_out) x (c, y_in, x_in)


@functools.lru_cache(maxsize=64)
def _stacked_index(
    shapes: tuple[tuple[int, ...], ...], h: int, w: int, groups: int, device: torch.device
) -> Tensor:
    """Index of the dense kernel ``(g, K*O/g*h*w, C/g*h*w)`` of ``K`` branches into the concatenation
    ``[0, kernel_1.flatten(), ..., kernel_K.flatten()]``, flattened, on ``device`` (kept there: a step
    replayed as a CUDA graph may copy nothing from the host)."""
    per_branch, offset = [], 0
    for out_ch, cg, kh, kw in shapes:
        index = dense_conv_index(out_ch, cg, kh, kw, h, w)
        per_branch.append(
            torch.where(index > 0, index + offset, 0).reshape(groups, out_ch // groups * h * w, -1)
        )
        offset += out_ch * cg * kh * kw
    return torch.cat(per_branch, dim=1).reshape(-1).to(device)


def fits_dense(branches: Sequence[ConvBN], partition: tuple[int, ...], cpu: bool) -> bool:
    """Whether :func:`dense_branch_sum` can compute these branches on ``partition``-sized maps (2-D
    same-padded stride-1 convs without bias, alike in channels and groups, each with its BatchNorm) and, on
    a CPU, pays: a few channels a group (not whole AVX2 vectors of 8) and dense MACs at most
    :data:`FC_MAC_RATIO` times the convs'."""
    convs = [b.conv for b in branches]
    first = convs[0] if convs else None
    if first is None or not all(
        b.bn is not None and isinstance(c, nn.Conv2d) and c.bias is None and c.stride == (1, 1)
        and c.dilation == (1, 1) and c.padding == (c.kernel_size[0] // 2, c.kernel_size[1] // 2)
        and (c.in_channels, c.out_channels, c.groups) == (first.in_channels, first.out_channels, first.groups)
        for b, c in zip(branches, convs, strict=True)
    ):  # fmt: skip
        return False
    if not cpu:
        return True
    narrow = first.in_channels // first.groups % 8 or first.out_channels // first.groups % 8
    conv_macs = sum(c.kernel_size[0] * c.kernel_size[1] for c in convs)
    return bool(narrow) and len(convs) * partition[0] * partition[1] <= FC_MAC_RATIO * conv_macs


def dense_branch_sum(x: Tensor, branches: Sequence[ConvBN], h: int, w: int) -> Tensor:
    """``sum(b(x) for b in branches)`` on ``h x w`` maps as one dense FC (the BatchNorms run as modules).

    Shapes: ``(B, C, h, w)`` -> ``(B, O, h, w)``.
    """
    first = branches[0].conv
    g, out_ch, k = first.groups, first.out_channels, len(branches)
    cg, og = first.in_channels // g, out_ch // g
    kernels = [b.conv.weight for b in branches]
    shapes = tuple((b.conv.out_channels, cg, *b.conv.kernel_size) for b in branches)  # static, for fx
    index = _stacked_index(shapes, h, w, g, x.device)
    flat = torch.cat([kernels[0].new_zeros(1), *(t.reshape(-1) for t in kernels)])
    dense = flat.index_select(0, index).view(g, k * og * h * w, cg * h * w)
    out = torch.bmm(x.reshape(-1, g, cg * h * w).transpose(0, 1), dense.transpose(1, 2))  # (g, B, K*O/g*h*w)
    # Branch-major, so that each branch's map is one contiguous (B, O, h, w) block for its BatchNorm.
    maps = out.view(g, -1, k, og, h * w).permute(2, 1, 0, 3, 4).contiguous().view(k, -1, out_ch, h, w)
    total = branches[0].bn(maps[0])
    for i in range(1, k):
        total = total + branches[i].bn(maps[i])
    return total
