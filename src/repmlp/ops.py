"""Tensor re-arrangements and the groupwise FC used by RepMLP (paper Sec. 3.2).

The paper implements the groupwise FC (FC3) as a grouped 1x1 conv, which it notes is inefficient.
On the CPU we measured (``benchmarks/bench_fc3.py``, results in ``docs/benchmarks.md``), a batched
matmul over a ``(g, partitions, C*h*w/g)`` layout computes the same result 1.7-5x faster than the
grouped 1x1 conv, so it is the form used for training and on every device. For float32 CPU
inference, one oneDNN 1x1 conv per group over a zero-copy channels_last view of the same rows can be
faster still (on an AMD EPYC with AVX-512, oneDNN's GEMM ran at about twice PyTorch's BLAS, MKL:
``benchmarks/bench_deploy.py`` prints both rates); :func:`groupwise_fc` times both once per shape and
keeps the faster. The grouped-conv form stays available as :func:`groupwise_fc_conv` for reference.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "partition",
    "unpartition",
    "to_group_rows",
    "from_group_rows",
    "groupwise_fc",
    "groupwise_fc_bmm",
    "groupwise_fc_onednn",
    "groupwise_fc_conv",
]

# Read once: a call inside a compiled region would break the graph.
_HAS_ONEDNN = torch.backends.mkldnn.is_available()
# (g, B, P/g, Q/g, bias?, dtype, threads) -> whether the oneDNN form was measured faster.
_ONEDNN_CHOICE: dict[tuple, bool] = {}


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

    A batched matmul, except for float32 CPU inference where :func:`groupwise_fc_onednn` measured
    faster for this shape on this machine (see :func:`_onednn_faster`).
    """
    mode = _fc3_mode(rows, weight)
    if mode == "compiled":
        # Inside torch.compile the choice is made when the graph runs: an opaque op to the compiler.
        return torch.ops.repmlp.groupwise_fc_picked(rows, weight, bias)
    if mode == "eager" and _onednn_faster(rows, weight, bias):
        return groupwise_fc_onednn(rows, weight, bias)
    return groupwise_fc_bmm(rows, weight, bias)


@torch.library.custom_op("repmlp::groupwise_fc_picked", mutates_args=(), device_types="cpu")
def _groupwise_fc_picked(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`groupwise_fc`'s eager choice as one op, so that a compiled graph keeps it (inductor would
    otherwise lower FC3 to its own batched matmul)."""
    if _onednn_faster(rows, weight, bias):
        return groupwise_fc_onednn(rows, weight, bias)
    return groupwise_fc_bmm(rows, weight, bias)


@_groupwise_fc_picked.register_fake
def _(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    g, b, _ = rows.shape
    return rows.new_empty(g, b, weight.shape[0] // g)


def groupwise_fc_bmm(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`groupwise_fc` as one batched matmul over the groups (``torch.baddbmm``)."""
    g = rows.shape[0]
    wt = weight.reshape(g, weight.shape[0] // g, weight.shape[1]).transpose(1, 2)
    if bias is None:
        return torch.bmm(rows, wt)
    return torch.baddbmm(bias.reshape(g, 1, -1), rows, wt)


def groupwise_fc_onednn(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`groupwise_fc` as one oneDNN 1x1 convolution per group; same shapes, CPU.

    Group ``j``'s rows ``(B, P/g)`` are, without a copy, a channels_last image of ``P/g`` channels and
    ``B x 1`` pixels; a 1x1 conv of it is the FC, run by oneDNN's GEMM kernels, which use every vector
    extension of the CPU (PyTorch's float32 ``bmm`` calls MKL, slower on the AMD CPU we measured). The
    per-group outputs, channels_last ``(1, Q/g, B, 1)``, are ``(B, Q/g)`` in memory.
    """
    g, b, k = rows.shape
    n = weight.shape[0] // g
    kernels = weight.reshape(g, n, k, 1, 1)
    biases = [None] * g if bias is None else bias.reshape(g, n)
    outs = [
        F.conv2d(rows[j].reshape(1, b, 1, k).permute(0, 3, 1, 2), kernels[j], biases[j]) for j in range(g)
    ]
    return torch.stack([o.permute(0, 2, 3, 1).reshape(b, n) for o in outs])


def _fc3_mode(rows: Tensor, weight: Tensor) -> str:
    """How :func:`groupwise_fc` runs this call: ``"bmm"``, or, for float32 CPU inference, ``"eager"``
    (pick the faster form now) or ``"compiled"`` (pick it inside an op opaque to ``torch.compile``).

    Tracers that record standard ops (fx, jit, ``torch.export``) and autograd keep the batched matmul:
    portable graphs, one backward.
    """
    if isinstance(rows, torch.fx.Proxy) or torch.jit.is_tracing() or torch.compiler.is_exporting():
        return "bmm"
    if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad):
        return "bmm"
    if not (
        rows.device.type == "cpu"
        and rows.dtype == torch.float32
        and weight.dtype == torch.float32
        and rows.shape[1] >= 16  # oneDNN's set-up dominates for a handful of rows
        and _HAS_ONEDNN
    ):
        return "bmm"
    return "compiled" if torch.compiler.is_compiling() else "eager"


def _onednn_faster(rows: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether :func:`groupwise_fc_onednn` beats :func:`groupwise_fc_bmm` for this call's shapes, timed
    once per shape and thread count (as ``torch.backends.cudnn.benchmark`` picks conv algorithms): which
    one wins depends on the CPU's vector units, the BLAS PyTorch was built with and the shape."""
    g, b, k = rows.shape
    key = (g, b, k, weight.shape[0] // g, bias is None, rows.dtype, torch.get_num_threads())
    if key not in _ONEDNN_CHOICE:
        best = {}
        for name, fn in (("bmm", groupwise_fc_bmm), ("onednn", groupwise_fc_onednn)):
            fn(rows, weight, bias)  # warm-up: oneDNN builds its kernel on the first call
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn(rows, weight, bias)
                times.append(time.perf_counter() - t0)
            best[name] = min(times)
        _ONEDNN_CHOICE[key] = best["onednn"] < 0.9 * best["bmm"]  # a clear win only: results stay put
    return _ONEDNN_CHOICE[key]


def groupwise_fc_conv(x: Tensor, weight: Tensor, bias: Tensor | None, groups: int) -> Tensor:
    """The paper's gMMUL: a groupwise FC as a grouped 1x1 conv. ``x``: ``(B, P)`` -> ``(B, Q)``."""
    q, pg = weight.shape
    out = F.conv2d(x.reshape(x.shape[0], -1, 1, 1), weight.reshape(q, pg, 1, 1), bias, groups=groups)
    return out.reshape(x.shape[0], q)
