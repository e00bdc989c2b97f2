"""The training form: the model as a new module tree that trains faster on this device, sharing the model's
parameters and buffers (training it trains the model; checkpoints keep the plain state-dict keys).

One form earns its place today (docs/benchmarks.md, "The training step"): on a CPU, a Local Perceptron whose
groups have a few channels trains as one dense FC (paper Sec. 3.3's identity: a conv on an ``h x w``
partition is an FC with fixed zeros). oneDNN trains such convs far below its matmul rate; the dense FC's
extra zeros cost less than that. Everything else trains as the plain modules do.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from repmlp.nn.block import LocalPerceptron, RepMLPBlock
from repmlp.nn.convert import swap_modules
from repmlp.nn.layers import ConvBN

__all__ = ["training_form", "DenseLocalPerceptron", "dense_conv_index", "fits_dense"]

# Largest ratio of the dense FC's multiply-accumulates to the convs' at which a CPU uses the dense form:
# oneDNN's training convs of a few channels a group ran several times below the matmul rate where this was
# measured (docs/benchmarks.md); the zeros' extra work must stay below that.
FC_MAC_RATIO = 4.0


def training_form(model: nn.Module, *, dense: bool | None = None) -> nn.Module:
    """``model`` as it trains fastest on the device of its parameters: a new tree
    (:func:`~repmlp.nn.convert.swap_modules`) in which each RepMLP block's Local Perceptron that
    :func:`fits_dense` is a :class:`DenseLocalPerceptron`; ``model`` itself where nothing changes.
    ``dense``: ``None`` on a CPU only (on CUDA the convs measured faster: docs/gpu.md), ``True`` wherever it
    fits, ``False`` never. ``model`` is not changed."""
    param = next(model.parameters(), None)
    cpu = param is None or param.device.type == "cpu"
    if dense is False or (dense is None and not cpu):
        return model
    maps = {
        id(m.local_perceptron): m.partition
        for m in model.modules()
        if isinstance(m, RepMLPBlock) and m.local_perceptron is not None
    }

    def dense_form(m: nn.Module) -> nn.Module | None:
        fits = id(m) in maps and type(m) is LocalPerceptron and not _watched(m)
        fits = fits and fits_dense(m.branches, maps[id(m)], cpu=not dense)
        return DenseLocalPerceptron(m.branches, maps[id(m)]) if fits else None

    return swap_modules(model, dense_form)


def _watched(module: nn.Module) -> bool:
    """Whether a hook watches ``module`` or anything in it (a forward or pre-forward hook, such as
    ``torch.nn.utils.prune``'s, a backward hook; or one registered for every module): the dense form would
    not call the modules the hook is on, so such a Local Perceptron keeps its convs."""
    every = nn.modules.module
    if every._global_forward_hooks or every._global_forward_pre_hooks or every._global_backward_hooks:
        return True
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        for m in module.modules()
    )


class DenseLocalPerceptron(nn.Module):
    """The Local Perceptron's branches (the same modules, so the same parameters and keys) computed as one dense
    FC on maps of ``map_size``: every branch's kernel gathered into its FC by a fixed index (a buffer outside
    the state dict; autograd scatters the FC's gradient back onto the kernels), one batched matmul for all
    branches, each branch's BatchNorm called on its slice. The same function as
    :class:`~repmlp.nn.block.LocalPerceptron`, its sums in another order; the convs' own hooks do not fire.

    Shapes: ``(B, C, h, w)`` -> ``(B, O, h, w)``.
    """

    def __init__(self, branches: nn.ModuleList, map_size: tuple[int, int]) -> None:
        super().__init__()
        first, (h, w) = branches[0].conv, map_size
        g = first.groups
        self.branches, self.map_size, self.groups, self.out_channels = (
            branches,
            map_size,
            g,
            first.out_channels,
        )
        self.cols = first.in_channels // g * h * w  # an FC row's inputs: C/g*h*w
        shapes = tuple((b.conv.out_channels, first.in_channels // g, *b.conv.kernel_size) for b in branches)
        index = _stacked_index(shapes, h, w, g).to(first.weight.device)
        self.register_buffer("index", index, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        g, k, (h, w) = self.groups, len(self.branches), self.map_size
        flat = [x.new_zeros(1)]
        for branch in self.branches:
            flat.append(branch.conv.weight.reshape(-1))
        dense = torch.cat(flat).index_select(0, self.index).view(g, -1, self.cols)  # (g, K*O/g*h*w, C/g*h*w)
        rows = x.reshape(-1, g, self.cols).transpose(0, 1)  # (g, B, C/g*h*w), from either memory format
        out = torch.bmm(rows, dense.transpose(1, 2))  # (g, B, K*O/g*h*w)
        # Branch-major, so that each branch's map is one contiguous (B, O, h, w) block for its BatchNorm.
        maps = out.view(g, -1, k, self.out_channels // g, h * w).permute(2, 1, 0, 3, 4).contiguous()
        maps = maps.view(k, -1, self.out_channels, h, w)
        total: Tensor | None = None
        for i, branch in enumerate(self.branches):
            y = branch.bn(maps[i])
            total = y if total is None else total + y
        assert total is not None  # a Local Perceptron has branches
        return total


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


def _stacked_index(shapes: tuple[tuple[int, ...], ...], h: int, w: int, groups: int) -> Tensor:
    """Index of the dense kernel ``(g, K*O/g*h*w, C/g*h*w)`` of ``K`` branches into the concatenation
    ``[0, kernel_1.flatten(), ..., kernel_K.flatten()]``, flattened."""
    per_branch, offset = [], 0
    for out_ch, cg, kh, kw in shapes:
        index = dense_conv_index(out_ch, cg, kh, kw, h, w)
        per_branch.append(
            torch.where(index > 0, index + offset, 0).reshape(groups, out_ch // groups * h * w, -1)
        )
        offset += out_ch * cg * kh * kw
    return torch.cat(per_branch, dim=1).reshape(-1)


def fits_dense(branches: Sequence[ConvBN], partition: tuple[int, ...], cpu: bool) -> bool:
    """Whether :class:`DenseLocalPerceptron` can compute these branches on ``partition``-sized maps (2-D
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
