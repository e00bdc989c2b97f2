"""Parallel conv-BN branches on small partition maps, trained as one dense FC (CPU training only).

The paper's identity (Sec. 3.3): a conv on an ``h x w`` partition is an FC whose kernel holds the conv's
weights at fixed places and zeros elsewhere. In a training step on a CPU, a Local Perceptron whose groups
have only a few channels runs its convs through oneDNN's slow paths (``layers.conv_in_layout_of``), while
the same sums as one batched matmul over all branches run at the machine's matmul rate. So where the
branches' dense FCs cost at most :data:`FC_MAC_RATIO` times the convs' multiply-accumulates, the branches
are computed as one FC: the kernels are gathered into the dense matrices (a fixed index, so autograd
scatters the FC's weight gradient back onto the kernels), one ``bmm`` gives every branch's output, and
each branch's own BatchNorm normalises its slice. The same maths as the convs (zeros add nothing); the
sums are ordered differently, so results agree to float rounding, not bit for bit. The convs' modules are
never called, so where hooks watch a branch (``layers.modules_observed``: forward hooks, pruning's forward
pre-hook) the convs run instead, and the hooks see every module the conv form calls.
"""

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from repmlp.nn.layers import ConvBN, modules_observed

__all__ = ["FC_MAC_RATIO", "FCBranches", "branches_fit_fc", "branch_sum_as_fc", "dense_conv_index"]

# Largest ratio of the dense FCs' multiply-accumulates to the convs' at which the FC form is used. oneDNN's
# training convs with a few channels a group ran several times below the matmul rate on the AVX2 machine
# where this was measured (benchmarks/bench_local_convs.py); the FCs' extra MACs (zeros) must stay below that.
FC_MAC_RATIO = 4.0


@functools.lru_cache(maxsize=128)
def dense_conv_index(out_ch: int, cg: int, kh: int, kw: int, h: int, w: int) -> Tensor:
    """Where a same-padded stride-1 conv kernel ``(O, C/g, kh, kw)`` goes in its FC on an ``h x w`` map.

    Returns a long tensor ``(O*h*w, C/g*h*w)`` (the grouped-1x1-conv layout of
    :func:`repmlp.nn.reparam.conv_to_fc`): entry ``i + 1`` means the kernel's ``i``-th element (flattened),
    ``0`` a zero. Kernels larger than the map are allowed (their outer taps only ever meet padding).
    """
    ys, xs = torch.arange(h), torch.arange(w)
    dy = ys[None, :] - ys[:, None] + kh // 2  # (y_out, y_in): the kernel row linking them
    dx = xs[None, :] - xs[:, None] + kw // 2
    # (y_out, x_out, y_in, x_in): whether a kernel tap links the two points, and which tap.
    valid = ((dy >= 0) & (dy < kh))[:, None, :, None] & ((dx >= 0) & (dx < kw))[None, :, None, :]
    tap = dy.clamp(0, kh - 1)[:, None, :, None] * kw + dx.clamp(0, kw - 1)[None, :, None, :]
    o = torch.arange(out_ch).reshape(out_ch, 1, 1, 1, 1, 1)
    c = torch.arange(cg).reshape(1, 1, 1, cg, 1, 1)
    index = torch.where(valid[None, :, :, None], (o * cg + c) * (kh * kw) + tap[None, :, :, None] + 1, 0)
    return index.reshape(out_ch * h * w, cg * h * w)  # (o, y_out, x_out) x (c, y_in, x_in)


@functools.lru_cache(maxsize=64)
def _stacked_index(shapes: tuple[tuple[int, ...], ...], h: int, w: int, groups: int) -> Tensor:
    """Index of :func:`branch_sum_as_fc`'s dense kernel ``(g, K*O/g*h*w, C/g*h*w)``, flattened, into the
    concatenation ``[0, kernel_1.flatten(), ..., kernel_K.flatten()]``."""
    per_branch, offset = [], 0
    for out_ch, cg, kh, kw in shapes:
        index = dense_conv_index(out_ch, cg, kh, kw, h, w)
        index = torch.where(index > 0, index + offset, 0)
        per_branch.append(index.reshape(groups, out_ch // groups * h * w, cg * h * w))
        offset += out_ch * cg * kh * kw
    return torch.cat(per_branch, dim=1).reshape(-1)


def branches_fit_fc(x: Tensor, branches: Sequence[ConvBN]) -> bool:
    """Whether :func:`branch_sum_as_fc` computes ``sum(b(x) for b in branches)`` in this call.

    Yes for a recorded training step (autograd on, BatchNorms in training mode) on a CPU, on a plain
    contiguous 2-D map, with branches that are same-padded stride-1 convs without bias, each followed by
    a BatchNorm, alike in channels and groups, with few channels a group (oneDNN's slow case), dense
    FCs costing at most :data:`FC_MAC_RATIO` times the convs' multiply-accumulates, and no hook watching
    the branches (:func:`~repmlp.nn.layers.modules_observed`).
    """
    if (
        isinstance(x, torch.fx.Proxy)
        or x.device.type != "cpu"
        or x.dim() != 4
        or not x.is_contiguous()
        or not torch.is_grad_enabled()
        or torch.jit.is_tracing()
        or torch.compiler.is_compiling()
    ):
        return False
    convs = [b.conv for b in branches]
    first = convs[0]
    for b, c in zip(branches, convs, strict=True):
        if (
            b.bn is None
            or not b.bn.training  # evaluation computes the same bits with and without autograd
            or c.bias is not None
            or c.weight.dim() != 4
            or (c.in_channels, c.out_channels, c.groups)
            != (first.in_channels, first.out_channels, first.groups)
            or tuple(c.stride) != (1, 1)
            or tuple(c.dilation) != (1, 1)
            or tuple(c.padding) != (c.kernel_size[0] // 2, c.kernel_size[1] // 2)
        ):
            return False
    # oneDNN's slow case (layers._slow_in_nchw): a group's channels do not fill whole AVX2 vector registers.
    if not (first.in_channels // first.groups % 8 or first.out_channels // first.groups % 8):
        return False
    h, w = x.shape[2:]
    fc_macs = len(convs) * h * w
    conv_macs = sum(c.kernel_size[0] * c.kernel_size[1] for c in convs)
    # Hooks fire only in the modules a forward calls, and this form calls no conv: where one watches a branch
    # (pruning's pre-hook, which recomputes the weight, too), the convs run.
    return fc_macs <= FC_MAC_RATIO * conv_macs and not modules_observed(branches)


def branch_sum_as_fc(x: Tensor, branches: Sequence[ConvBN]) -> Tensor:
    """``sum(b(x) for b in branches)`` (training mode) as one dense FC; see the module's docstring.

    Shapes: ``(B, C, h, w)`` -> ``(B, O, h, w)``, plain contiguous.
    """
    n, c, h, w = x.shape
    first = branches[0].conv
    g, out_ch = first.groups, first.out_channels
    cg, og, k = c // g, out_ch // g, len(branches)
    kernels = [b.conv.weight for b in branches]
    index = _stacked_index(tuple(tuple(t.shape) for t in kernels), h, w, g)
    flat = torch.cat([kernels[0].new_zeros(1), *(t.reshape(-1) for t in kernels)])
    dense = flat.index_select(0, index.to(x.device)).view(g, k * og * h * w, cg * h * w)
    rows = x.reshape(n, g, cg * h * w).transpose(0, 1)  # (g, B, C/g*h*w)
    out = torch.bmm(rows, dense.transpose(1, 2))  # (g, B, K*O/g*h*w)
    # Branch-major, so that each branch's map is one contiguous (B, O, h, w) block for its BatchNorm.
    maps = out.view(g, n, k, og, h * w).permute(2, 1, 0, 3, 4).contiguous().view(k, n, out_ch, h, w)
    total: Tensor | None = None
    for branch, y in zip(branches, maps.unbind(0), strict=True):
        assert branch.bn is not None  # checked by branches_fit_fc
        y = branch.bn(y)
        total = y if total is None else total + y
    assert total is not None
    return total


# No ``from __future__ import annotations`` in this module: TorchScript reads the real annotations of the
# methods below (it compiles them as stubs that raise), and string annotations would not resolve.
class FCBranches:
    """Mixin of a module whose training forward sums conv-BN branches (:meth:`_conv_branches`) on a partition
    map: :meth:`_fits_fc` / :meth:`_forward_as_fc` are :func:`branches_fit_fc` / :func:`branch_sum_as_fc`
    for them, hidden from TorchScript (call them after ``not torch.jit.is_scripting()``)."""

    def _conv_branches(self) -> list[ConvBN]:
        raise NotImplementedError

    @torch.jit.unused
    def _fits_fc(self, x: Tensor) -> bool:
        return branches_fit_fc(x, self._conv_branches())

    @torch.jit.unused
    def _forward_as_fc(self, x: Tensor) -> Tensor:
        return branch_sum_as_fc(x, self._conv_branches())
