"""Tensor re-arrangements and the groupwise FC used by RepMLP (paper Sec. 3.2).

The paper implements the groupwise FC (FC3) as a grouped 1x1 conv, which it notes is inefficient. A
batched matmul over a ``(g, partitions, C*h*w/g)`` layout computes the same result faster on every CPU
measured (``benchmarks/bench_fc3.py``; results in ``docs/benchmarks.md``), so it is the form used for
training and on every device. For float32 CPU inference, one oneDNN 1x1 conv per group over a zero-copy
channels_last view of the same rows can be faster still, where oneDNN's GEMM outruns PyTorch's BLAS
(``benchmarks/bench_deploy.py`` prints both rates). With a few rows (a small batch) FC3 is bound by
reading its kernel, and the transposed product (:func:`groupwise_fc_transposed`) streams it fastest.
:func:`groupwise_fc` times the forms once per kernel shape and row class, outside any forward, and keeps
the fastest (:func:`fc3_form`), unless :func:`set_fc3_backend` (or ``REPMLP_FC3``) pins one form. The
grouped-conv form stays available as :func:`groupwise_fc_conv` for reference.
"""

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from repmlp.errors import UserError

__all__ = [
    "partition",
    "unpartition",
    "unpartition_like",
    "partition_copy",
    "partition_for",
    "unpartition_copy",
    "is_channels_last",
    "pointwise_conv_as_linear",
    "to_group_rows",
    "from_group_rows",
    "groupwise_fc",
    "groupwise_fc_bmm",
    "groupwise_fc_onednn",
    "groupwise_fc_transposed",
    "groupwise_fc_conv",
    "FC3_FORMS",
    "FC3_ROW_CLASSES",
    "FC3_BACKENDS",
    "set_fc3_backend",
    "get_fc3_backend",
    "fc3_backend",
    "fc3_form",
]

# Read once: a call inside a compiled region would break the graph.
_HAS_ONEDNN = torch.backends.mkldnn.is_available()
# The forms of float32 CPU inference; "bmm" is the reference, and the form of every other case.
FC3_FORMS = ("bmm", "onednn", "transposed")
FC3_BACKENDS = ("auto", *FC3_FORMS)
# (g, P/g, Q/g, bias?, threads, rows class) -> the form measured fastest ("auto" backend).
_FC3_CHOICE: dict[tuple, str] = {}
# Row counts a group are timed in classes, the powers of two up to 512 (about a batch of 8 at the paper's
# sizes); more rows are timed at 512: the ranking of the forms stops changing there.
FC3_ROW_CLASSES = tuple(1 << i for i in range(10))
_TIMING_ROWS = FC3_ROW_CLASSES[-1]
# Bytes of kernel copies a timing cycles through, more than a CPU's last-level cache holds.
_COLD_BYTES = 64 << 20


class FC3SettingError(UserError, ValueError):
    """A ``REPMLP_FC3`` value that names no backend (one line from the CLI; a ``ValueError`` to callers)."""


def _backend_from_env() -> str:
    """``REPMLP_FC3`` (default ``auto``), case and spaces aside; :class:`FC3SettingError` for another value."""
    name = os.environ.get("REPMLP_FC3", "auto").strip().lower() or "auto"
    if name not in FC3_BACKENDS:
        raise FC3SettingError(
            f"REPMLP_FC3={name!r}: expected one of {', '.join(FC3_BACKENDS)} (or unset it: auto)"
        )
    return name


# None until first needed: the environment is read where FC3 runs (get_fc3_backend), not when repmlp is
# imported, so that a bad value cannot stop commands that run no model (--version, --help).
_backend: str | None = None


def partition(x: Tensor, h: int, w: int) -> Tensor:
    """Split ``(N, C, H, W)`` into the partition map ``(N*H/h*W/w, C, h, w)`` (one permute).

    Partitions are ordered ``(n, row, column)``.
    """
    n, c, hh, ww = x.shape
    hp, wp = hh // h, ww // w
    return x.reshape(n, c, hp, h, wp, w).permute(0, 2, 4, 1, 3, 5).reshape(n * hp * wp, c, h, w)


def unpartition(p: Tensor, n: int, hp: int, wp: int, channels_last: bool = False) -> Tensor:
    """Inverse of :func:`partition`: ``(N*hp*wp, C, h, w)`` -> ``(N, C, hp*h, wp*w)``.

    One copy either way; ``channels_last=True`` writes the result in channels_last memory order (as
    :func:`from_group_rows`), so that a channels_last model's next layer gets the layout it runs in.
    """
    _, c, h, w = p.shape
    p = p.reshape(n, hp, wp, c, h, w)
    if channels_last:
        # contiguous(): with one partition the reshape is a view, still in the NCHW order
        return p.permute(0, 1, 4, 2, 5, 3).reshape(n, hp * h, wp * w, c).contiguous().permute(0, 3, 1, 2)
    return p.permute(0, 3, 1, 4, 2, 5).reshape(n, c, hp * h, wp * w)


# The training-time block's partition copies as custom ops: the same single copies, but opaque to
# torch.compile, whose CPU code generator otherwise fuses these permutes into the BatchNorm reductions
# around them and emits slow strided loops (benchmarks/bench_train.py --profile). Each is the other's
# gradient. They return fresh tensors, never views, as custom ops must (one partition too: a copy then).
@torch.library.custom_op("repmlp::partition_copy", mutates_args=())
def partition_copy(x: Tensor, h: int, w: int) -> Tensor:
    """:func:`partition` as one copy into a fresh contiguous ``(N*H/h*W/w, C, h, w)`` tensor."""
    n, c, hh, ww = x.shape
    hp, wp = hh // h, ww // w
    out = x.new_empty((n * hp * wp, c, h, w))
    out.view(n, hp, wp, c, h, w).copy_(x.view(n, c, hp, h, wp, w).permute(0, 2, 4, 1, 3, 5))
    return out


@partition_copy.register_fake
def _(x: Tensor, h: int, w: int) -> Tensor:
    n, c, hh, ww = x.shape
    return x.new_empty((n * (hh // h) * (ww // w), c, h, w))


@torch.library.custom_op("repmlp::unpartition_copy", mutates_args=())
def unpartition_copy(p: Tensor, n: int, hp: int, wp: int, channels_last: bool) -> Tensor:
    """:func:`unpartition` as one copy into a fresh ``(N, C, hp*h, wp*w)`` tensor (channels_last memory
    if asked)."""
    out = _unpartition_out(p, n, hp, wp, channels_last)
    _, c, h, w = p.shape
    out.view(n, c, hp, h, wp, w).copy_(p.view(n, hp, wp, c, h, w).permute(0, 3, 1, 4, 2, 5))
    return out


def _unpartition_out(p: Tensor, n: int, hp: int, wp: int, channels_last: bool) -> Tensor:
    _, c, h, w = p.shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return p.new_empty((n, c, hp * h, wp * w)).contiguous(memory_format=fmt)


unpartition_copy.register_fake(_unpartition_out)


def _partition_backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
    return unpartition_copy(grad.contiguous(), ctx.n, ctx.hp, ctx.wp, ctx.channels_last), None, None


def _partition_setup(ctx, inputs: tuple, output: Tensor) -> None:
    x, h, w = inputs
    ctx.n, ctx.hp, ctx.wp = x.shape[0], x.shape[2] // h, x.shape[3] // w
    ctx.channels_last = is_channels_last(x)


def _unpartition_backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
    return partition_copy(grad, ctx.h, ctx.w), None, None, None, None


def _unpartition_setup(ctx, inputs: tuple, output: Tensor) -> None:
    ctx.h, ctx.w = inputs[0].shape[2], inputs[0].shape[3]


partition_copy.register_autograd(_partition_backward, setup_context=_partition_setup)
unpartition_copy.register_autograd(_unpartition_backward, setup_context=_unpartition_setup)


def is_channels_last(x: Tensor) -> bool:
    """Whether ``x`` is stored channels_last and not also plain contiguous (as with one channel or 1x1)."""
    return not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def partition_for(x: Tensor, h: int, w: int, training: bool = False) -> Tensor:
    """:func:`partition` for a layer's forward: in training one copy by :func:`partition_copy` (opaque to
    ``torch.compile``); in evaluation the plain form that exporters (ONNX) know. A ``torch.fx`` leaf
    where it is called (``torch.fx.wrap("partition_for")``), so a traced graph is the same in both modes.
    """
    if training:
        return torch.ops.repmlp.partition_copy(x, h, w)
    return partition(x, h, w)


def unpartition_like(x: Tensor, p: Tensor, n: int, hp: int, wp: int, training: bool = False) -> Tensor:
    """:func:`unpartition` in ``x``'s memory format, so that a channels_last model stays channels_last
    from block to block. It branches on the layout: a module that calls it declares it a ``torch.fx``
    leaf (``torch.fx.wrap("unpartition_like")`` at its top level, which is where fx looks).

    ``training``: the copy as :func:`unpartition_copy`, opaque to ``torch.compile``; evaluation keeps the
    plain form that exporters (ONNX) know.

    Shapes: ``p`` ``(N*hp*wp, O, h, w)`` -> ``(N, O, hp*h, wp*w)``.
    """
    if not training:
        return unpartition(p, n, hp, wp, channels_last=is_channels_last(x))
    return torch.ops.repmlp.unpartition_copy(p.contiguous(), n, hp, wp, is_channels_last(x))


def pointwise_conv_as_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """A 1x1 conv (stride 1, one group) as a matmul over the channels: ``(N, C, H, W)`` -> ``(N, O, H, W)``,
    written channels_last. The same sums as ``F.conv2d(x, weight, bias)``; used to train layers whose
    conv form is slow on CPU (oneDNN's weight gradient of a 1x1 conv on one input channel)."""
    return F.linear(x.permute(0, 2, 3, 1), weight.flatten(1), bias).permute(0, 3, 1, 2)


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
    y: Tensor, n: int, hp: int, wp: int, h: int, w: int, channels_last: bool = False
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


# TorchScript (of a torch.fx graph, where this is a leaf) calls it as Python: the same choice as eager.
@torch.jit.ignore
def groupwise_fc(rows: Tensor, weight: Tensor, bias: Tensor | None, training: bool | None = None) -> Tensor:
    """Groupwise FC on per-group rows.

    Args:
        rows: ``(g, B, P/g)`` input rows of each group.
        weight: ``(Q, P/g)`` kernel in grouped-1x1-conv layout (rows of group ``j`` are
            ``j*Q/g ... (j+1)*Q/g - 1``).
        bias: ``(Q,)`` or ``None``.
        training: whether the calling layer is in training mode (``None``: whether autograd records
            this call).

    Returns:
        ``(g, B, Q/g)``.

    A batched matmul, except for float32 CPU inference (``training`` false), where the form set by
    :func:`set_fc3_backend` runs: by default (``"auto"``) the form measured fastest on this machine for
    this weight shape and about this many rows (:func:`fc3_form`). The choice depends on the weight's
    shape, the thread count and the row count's power-of-two class (the batch times the partitions), so
    eager, traced and scripted forms of a model compute the same bits in one process; a batch of another
    class may round FC3 differently in the last bits.
    """
    mode = _fc3_mode(rows, weight, training)
    if mode == "compiled":
        # Inside torch.compile the choice is made when the graph runs: an opaque op to the compiler.
        return torch.ops.repmlp.groupwise_fc_picked(rows, weight, bias)
    if mode == "pick":
        return _FORM_FNS[fc3_form(rows.shape[0], weight.shape, bias is not None, rows.shape[1])](
            rows, weight, bias
        )
    if mode == "train":
        return _GroupwiseFCTrain.apply(rows, weight, bias)
    return groupwise_fc_bmm(rows, weight, bias)


def set_fc3_backend(name: str) -> str:
    """Set how float32 CPU inference runs FC3, for the whole process; returns the previous setting.

    ``"auto"`` (default): the form timed clearly faster than the batched matmul on this machine for the
    weight shape and row-count class (:func:`fc3_form`), else the batched matmul. Which form wins depends
    on the CPU and the BLAS of the torch build, so two machines (or, on a close call, two processes) may
    round FC3 differently in the last bits. ``"bmm"``: always the batched matmul, for results that do
    not depend on a timing. ``"onednn"`` (:func:`groupwise_fc_onednn`) or ``"transposed"``
    (:func:`groupwise_fc_transposed`): always that form. The environment variable ``REPMLP_FC3`` sets the
    starting value. Training (autograd), other dtypes and devices always use the batched matmul.
    """
    global _backend
    if name not in FC3_BACKENDS:
        raise ValueError(f"FC3 backend {name!r}: expected one of {', '.join(FC3_BACKENDS)}")
    previous, _backend = get_fc3_backend(), name
    return previous


def get_fc3_backend() -> str:
    """The current :func:`set_fc3_backend` setting (at first, ``REPMLP_FC3``'s: read on the first call)."""
    global _backend
    if _backend is None:
        _backend = _backend_from_env()
    return _backend


@contextmanager
def fc3_backend(name: str) -> Iterator[None]:
    """:func:`set_fc3_backend` for the duration of a ``with`` block."""
    previous = set_fc3_backend(name)
    try:
        yield
    finally:
        set_fc3_backend(previous)


@torch.library.custom_op("repmlp::groupwise_fc_picked", mutates_args=(), device_types="cpu")
def _groupwise_fc_picked(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`groupwise_fc`'s eager choice as one op, so that a compiled graph keeps it (inductor would
    otherwise lower FC3 to its own batched matmul)."""
    return _FORM_FNS[fc3_form(rows.shape[0], weight.shape, bias is not None, rows.shape[1])](
        rows, weight, bias
    )


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


class _GroupwiseFCTrain(torch.autograd.Function):
    """:func:`groupwise_fc_bmm` whose backward computes the weight's gradient in the weight's own layout,
    ``grad^T @ rows`` per group. Autograd's backward of the batched matmul computes it as ``rows^T @ grad``,
    the transposed kernel, and then copies it into the weight's layout: a transposition of the whole kernel
    every step, a visible share of ``repmlp_cifar``'s CPU step (benchmarks/bench_train.py)."""

    @staticmethod
    def forward(ctx, rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return groupwise_fc_bmm(rows, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows, weight = ctx.saved_tensors
        g = rows.shape[0]
        kernels = weight.reshape(g, weight.shape[0] // g, weight.shape[1])  # (g, Q/g, P/g)
        need_rows, need_weight, need_bias = ctx.needs_input_grad
        grad_rows = torch.bmm(grad, kernels) if need_rows else None
        grad_weight = torch.bmm(grad.transpose(1, 2), rows).reshape(weight.shape) if need_weight else None
        grad_bias = grad.sum(1).reshape(-1) if ctx.has_bias and need_bias else None
        return grad_rows, grad_weight, grad_bias


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


def groupwise_fc_transposed(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`groupwise_fc` as the transposed product per group, ``(W_j @ rows_j^T)^T``; same shapes.

    With a few rows (a small batch) FC3 is bound by reading its kernel, and BLAS streams a
    ``(Q/g, P/g)`` kernel fastest as the left operand in its stored row order (a matrix-vector product
    per row); the batched matmul reads it transposed. The ``(g, B, Q/g)`` result is made contiguous, as
    the other forms return it.
    """
    g, b, k = rows.shape
    kernels = weight.reshape(g, weight.shape[0] // g, k)
    if bias is None:
        out = torch.bmm(kernels, rows.transpose(1, 2))
    else:
        out = torch.baddbmm(bias.reshape(g, -1, 1), kernels, rows.transpose(1, 2))
    return out.transpose(1, 2).contiguous()


_FORM_FNS = {"bmm": groupwise_fc_bmm, "onednn": groupwise_fc_onednn, "transposed": groupwise_fc_transposed}


def _fc3_mode(rows: Tensor, weight: Tensor, training: bool | None) -> str:
    """How :func:`groupwise_fc` runs this call: ``"bmm"``; for a recorded training call on a CPU, ``"train"``
    (the same matmul, with :class:`_GroupwiseFCTrain`'s backward); or, for float32 CPU inference, ``"pick"``
    (the backend's form, traced as such by ``torch.jit.trace`` and ``torch.export``) or ``"compiled"``
    (the same choice inside an op opaque to ``torch.compile``).

    Training keeps the batched matmul (one fast backward). Inference is decided by the layer's mode,
    not by whether autograd is on, so an eval-mode model computes the same bits with and without
    gradients, eagerly and exported. ``torch.fx`` records :func:`groupwise_fc` itself (a leaf where
    it is called), so a traced graph makes the same choice as the module when it runs.
    """
    if isinstance(rows, torch.fx.Proxy):
        return "bmm"
    recording = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)
    if training is None:
        training = recording
    if training and recording and _trains_without_copy(rows, weight):
        return "train"
    if training or not (
        (_backend or get_fc3_backend()) != "bmm"
        and rows.device.type == "cpu"
        and rows.dtype == torch.float32
        and weight.dtype == torch.float32
        and _HAS_ONEDNN
    ):
        return "bmm"
    if torch.compiler.is_compiling() and not torch.compiler.is_exporting():
        # The opaque op has no backward: a compiled graph that autograd records keeps the matmul.
        return "bmm" if recording else "compiled"
    return "pick"


def _trains_without_copy(rows: Tensor, weight: Tensor) -> bool:
    """Whether a recorded training call runs :class:`_GroupwiseFCTrain`: on a CPU (where it was measured),
    in one dtype without autocast (its backward would get the autocast dtype), not traced for export."""
    return (
        rows.device.type == "cpu"
        and rows.dtype == weight.dtype
        and not torch.is_autocast_enabled("cpu")
        and not torch.jit.is_tracing()
        and not torch.compiler.is_exporting()
    )


def fc3_form(groups: int, weight_shape: Sequence[int], bias: bool, rows: int | torch.SymInt) -> str:
    """The form (one of :data:`FC3_FORMS`) float32 CPU inference runs for an FC3 of kernel shape
    ``(Q, P/g)`` on ``rows`` rows a group.

    Under the ``"auto"`` backend the forms are timed once per kernel shape, thread count and row class
    (``rows`` rounded up to a power of two, at most ``_TIMING_ROWS``; a symbolic count, as in an export
    with a dynamic batch, is the largest class), as ``torch.backends.cudnn.benchmark`` picks conv
    algorithms: on a synthetic input of that many rows, in a separate thread, so that no dispatch mode
    (``FlopCounterMode``, fake tensors, tracers) and no random number generator of the caller sees the
    trials. A form other than the batched matmul must win clearly (10%), so that a close call does not
    flip between processes. The row class matters: with a few rows FC3 reads its kernel for little
    work, and the form that streams the kernel best wins (``benchmarks/bench_fc3_weights.py``).
    """
    backend = _backend or get_fc3_backend()
    if backend != "auto":
        return backend if _HAS_ONEDNN or backend != "onednn" else "bmm"
    # int(): under torch.jit.trace sizes are tensors, which would not hash as equal keys.
    groups, q, k = int(groups), int(weight_shape[0]), int(weight_shape[1])
    rows_class = _rows_class(rows)
    threads = torch.get_num_threads()
    key = (groups, k, q // groups, bias, threads, rows_class)
    if key not in _FC3_CHOICE:
        result: list[str] = []
        worker = threading.Thread(
            target=lambda: result.append(_fastest_form(groups, k, q, bias, threads, rows_class))
        )
        worker.start()
        worker.join()
        _FC3_CHOICE[key] = result[0] if result else "bmm"
    return _FC3_CHOICE[key]


def _rows_class(rows: int | torch.SymInt) -> int:
    """``rows`` rounded up to a power of two, at most ``_TIMING_ROWS`` (also for a symbolic count)."""
    if isinstance(rows, torch.SymInt):
        return _TIMING_ROWS
    rows = max(int(rows), 1)  # int(): a tensor under torch.jit.trace
    return min(1 << (rows - 1).bit_length(), _TIMING_ROWS)


def _fastest_form(groups: int, k: int, q: int, bias: bool, threads: int, rows: int) -> str:
    """Time every FC3 form on constant inputs of the given shapes; the fastest, if >10% faster than bmm.

    Each call reads the next of several copies of the kernel (as many as fill ``_COLD_BYTES``, at most 64,
    one when the kernel alone is that large), so that it comes from memory, as in a model, where the other
    layers' weights evict it. With few rows that is what a form's speed depends on: a kernel timed again
    and again from the cache would rank the forms differently.
    """
    torch.set_num_threads(threads)  # a new thread starts with the default count
    forms = FC3_FORMS if _HAS_ONEDNN else ("bmm", "transposed")
    copies = min(max(_COLD_BYTES // (4 * q * k), 1), 64)
    with torch.no_grad():
        x = torch.full((groups, rows, k), 0.5)
        weights = [torch.full((q, k), 0.01) for _ in range(copies)]
        b = torch.full((q,), 0.1) if bias else None
        best = {}
        for name in forms:
            fn = _FORM_FNS[name]
            fn(x, weights[0], b)  # warm-up: oneDNN builds its kernel on the first call
            times: list[float] = []
            # At least 4 calls and 5 ms: a call of a few rows takes microseconds, and the best of a few
            # of those is noise.
            while len(times) < 4 or (sum(times) < 5e-3 and len(times) < 100):
                w = weights[(len(times) + 1) % copies]
                t0 = time.perf_counter()
                fn(x, w, b)
                times.append(time.perf_counter() - t0)
            best[name] = min(times)
    fastest = min(best, key=best.get)
    return fastest if best[fastest] < 0.9 * best["bmm"] else "bmm"


def groupwise_fc_conv(x: Tensor, weight: Tensor, bias: Tensor | None, groups: int) -> Tensor:
    """The paper's gMMUL: a groupwise FC as a grouped 1x1 conv. ``x``: ``(B, P)`` -> ``(B, Q)``."""
    q, pg = weight.shape
    out = F.conv2d(x.reshape(x.shape[0], -1, 1, 1), weight.reshape(q, pg, 1, 1), bias, groups=groups)
    return out.reshape(x.shape[0], q)
