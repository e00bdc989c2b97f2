"""FC3 for float32 CPU inference by the kernel measured fastest for its weight's shape and row count.

The plain :class:`~repmlp.nn.layers.GroupwiseLinear` is one batched matmul. On a CPU two other kernels of the
same sums can be faster: one oneDNN 1x1 conv per group over a zero-copy channels_last view of the rows
(oneDNN's GEMM outruns PyTorch's BLAS on some CPUs, with many rows), and the transposed product, kernel
times rows (with a few rows FC3 is bound by reading its kernel, which BLAS streams fastest as the left
operand). Which wins depends on the CPU, the threads, the kernel's shape and the rows, so the inference
pass times the kernels once per weight shape and row class (the rows a group, rounded up to a power of two,
at most 512) and :class:`TunedGroupwiseLinear` looks the choice up: no timing inside a forward, but two
machines may round FC3 differently in the last bits. Timings are kept for the process. For an ONNX graph,
:class:`PerGroupLinear` writes FC3 as one 2-D product per group (:func:`repmlp.speed.onnx_form`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from repmlp.nn.layers import GroupwiseLinear

__all__ = [
    "KERNELS", "ROW_CLASSES", "TunedGroupwiseLinear", "PerGroupLinear", "rows_class", "fastest_kernel", "fc3_bmm",
]  # fmt: skip

ROW_CLASSES = tuple(1 << i for i in range(10))
# Bytes of kernel copies a timing cycles through: more than a last-level cache holds, as in a model, where
# the other layers' weights evict FC3's kernel between calls.
_COLD_BYTES = 64 << 20
_CHOICES: dict[tuple[int, ...], str] = {}


def fc3_bmm(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The plain layer's batched matmul. Shapes: ``(g, B, P/g)``, ``(Q, P/g)``, ``(Q,)`` -> ``(g, B, Q/g)``."""
    g = rows.shape[0]
    kernels = weight.reshape(g, weight.shape[0] // g, -1).transpose(1, 2)
    return torch.bmm(rows, kernels) if bias is None else torch.baddbmm(bias.reshape(g, 1, -1), rows, kernels)


def fc3_onednn(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """One oneDNN 1x1 conv per group: group ``j``'s rows ``(B, P/g)`` are, without a copy, a channels_last
    image of ``P/g`` channels and ``B x 1`` pixels."""
    g, b, k = rows.shape
    n = weight.shape[0] // g
    kernels = weight.reshape(g, n, k, 1, 1)
    biases = [None] * g if bias is None else bias.reshape(g, n)
    outs = [
        F.conv2d(rows[j].reshape(1, b, 1, k).permute(0, 3, 1, 2), kernels[j], biases[j]) for j in range(g)
    ]
    return torch.stack([o.permute(0, 2, 3, 1).reshape(b, n) for o in outs])


def fc3_transposed(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The transposed product per group, ``(W_j @ rows_j^T)^T``, made contiguous."""
    g, _, k = rows.shape
    kernels = weight.reshape(g, weight.shape[0] // g, k)
    if bias is None:
        out = torch.bmm(kernels, rows.transpose(1, 2))
    else:
        out = torch.baddbmm(bias.reshape(g, -1, 1), kernels, rows.transpose(1, 2))
    return out.transpose(1, 2).contiguous()


KERNELS: dict[str, Callable[[Tensor, Tensor, Tensor | None], Tensor]] = {
    "bmm": fc3_bmm, "onednn": fc3_onednn, "transposed": fc3_transposed,
}  # fmt: skip


def rows_class(rows: int) -> int:
    """``rows`` rounded up to a power of two, at most 512."""
    return min(1 << (max(int(rows), 1) - 1).bit_length(), ROW_CLASSES[-1])


def fastest_kernel(groups: int, weight_shape: tuple[int, int], bias: bool, rows: int) -> str:
    """The fastest kernel for this weight shape and row class at this thread count (timed once a process):
    another than the batched matmul must be 10% faster, so that a close call does not flip."""
    q, k = weight_shape
    key = (groups, k, q // groups, int(bias), torch.get_num_threads(), rows_class(rows))
    if key not in _CHOICES:
        _CHOICES[key] = _time_kernels(groups, k, q, bias, rows_class(rows))
    return _CHOICES[key]


def _time_kernels(groups: int, k: int, q: int, bias: bool, rows: int) -> str:
    kernels = (
        KERNELS if torch.backends.mkldnn.is_available() else {n: KERNELS[n] for n in ("bmm", "transposed")}
    )
    copies = min(max(_COLD_BYTES // (4 * q * k), 1), 64)
    best = {}
    with torch.no_grad():
        x = torch.full((groups, rows, k), 0.5)
        weights = [torch.full((q, k), 0.01) for _ in range(copies)]
        b = torch.full((q,), 0.1) if bias else None
        for name, fn in kernels.items():
            fn(x, weights[0], b)  # warm-up: oneDNN builds its kernel on the first call
            times: list[float] = []
            while len(times) < 4 or (sum(times) < 5e-3 and len(times) < 100):  # calls of microseconds too
                w = weights[(len(times) + 1) % copies]
                start = time.perf_counter()
                fn(x, w, b)
                times.append(time.perf_counter() - start)
            best[name] = min(times)
    fastest = min(best, key=best.__getitem__)
    return fastest if best[fastest] < 0.9 * best["bmm"] else "bmm"


@torch.library.custom_op("repmlp::fc3_in_kernel", mutates_args=(), device_types="cpu")
def _fc3_in_kernel(rows: Tensor, weight: Tensor, bias: Tensor | None, kernel: str) -> Tensor:
    """FC3 by ``kernel`` as one op opaque to ``torch.compile`` (which would lower each to its own bmm)."""
    return KERNELS[kernel](rows, weight, bias)


@_fc3_in_kernel.register_fake
def _(rows: Tensor, weight: Tensor, bias: Tensor | None, kernel: str) -> Tensor:
    g, b, _ = rows.shape
    return rows.new_empty(g, b, weight.shape[0] // g)


class TunedGroupwiseLinear(GroupwiseLinear):
    """:class:`~repmlp.nn.layers.GroupwiseLinear` by the kernel its ``kernels`` attribute names for the row
    class of each call (``{rows class: kernel name}``, filled by the inference pass; a class not timed runs
    the batched matmul). Evaluation mode only: training runs the batched matmul."""

    kernels: dict[int, str]

    def forward(self, rows: Tensor) -> Tensor:
        if self.training:
            return super().forward(rows)
        return tuned_fc3(rows, self.weight, self.bias, tuple(sorted(self.kernels.items())))


@torch.fx.wrap
def tuned_fc3(
    rows: Tensor, weight: Tensor, bias: Tensor | None, kernels: tuple[tuple[int, str], ...]
) -> Tensor:
    """FC3 by the kernel ``kernels`` (``((rows class, kernel name), ...)``) names for ``rows``' row count; a
    ``torch.fx`` leaf, since the choice depends on the rows' shape (a dynamic one takes the top class)."""
    n = rows.shape[1]
    kernel = dict(kernels).get(ROW_CLASSES[-1] if isinstance(n, torch.SymInt) else rows_class(n), "bmm")
    if kernel != "bmm" and torch.compiler.is_compiling() and not torch.is_grad_enabled():  # no backward
        return torch.ops.repmlp.fc3_in_kernel(rows, weight, bias, kernel)
    return KERNELS[kernel](rows, weight, bias)


class PerGroupLinear(GroupwiseLinear):
    """:class:`~repmlp.nn.layers.GroupwiseLinear` as one 2-D product per group, stacked, in evaluation: the form
    written to ONNX, whose runtimes pre-pack a constant 2-D weight once when they load the graph (a batched
    3-D weight, on every run; with a few rows a group, as at batch 1, packing outweighs the product). The same
    sums, each group's in its own product. Shapes as the plain layer's."""

    def forward(self, rows: Tensor) -> Tensor:
        if self.training:
            return super().forward(rows)
        g = self.groups
        kernels = self.weight.reshape(g, self.out_features // g, -1)
        biases = [None] * g if self.bias is None else self.bias.reshape(g, -1)
        return torch.stack([F.linear(rows[j], kernels[j], biases[j]) for j in range(g)])
