"""Export a (deployed) model to ONNX, TorchScript or a ``torch.export`` program, checked against PyTorch.

Each exporter writes a temporary file beside the destination, loads it back (ONNX into onnxruntime),
compares its outputs with PyTorch's in full float32 at another batch size than the trace's (a graph that
baked the batch size in fails here), and only then moves it into place.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import math
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from repmlp.errors import first_line
from repmlp.io.model_file import atomic_write_bytes, staged
from repmlp.nn.block import RepMLPBlock
from repmlp.nn.convert import swap_modules
from repmlp.nn.layers import GroupwiseLinear
from repmlp.numerics import full_float32

__all__ = ["ExportError", "export_onnx", "export_torchscript", "export_program", "missing_onnx_packages",
           "write_int8_onnx", "DEFAULT_RTOL"]  # fmt: skip

ONNX_PACKAGES = ("onnx", "onnxruntime", "onnxscript")  # the optional repmlp[export] extra
DEFAULT_RTOL = 1e-4  # max |exported - PyTorch| <= DEFAULT_RTOL * max(1, max |PyTorch|)
_TRACE_BATCH, _CHECK_BATCH = 2, 3  # different on purpose
# Writes one format: (model, example input (N, C, H, W), path) -> the file loaded back, or None (unchecked).
_Writer = Callable[[nn.Module, Tensor, Path], Callable[[Tensor], object] | None]


class ExportError(RuntimeError):
    """The model could not be exported, or the exported file does not reproduce PyTorch's outputs."""


def missing_onnx_packages() -> list[str]:
    """The packages of the ``repmlp[export]`` extra that are not installed."""
    return [name for name in ONNX_PACKAGES if importlib.util.find_spec(name) is None]


def _example(input_size: Sequence[int], batch: int, seed: int) -> Tensor:
    """A fixed random input ``(batch, *input_size)``; ``input_size`` is ``(C, H, W)``."""
    if len(input_size) < 1 or any(int(s) < 1 for s in input_size):
        raise ValueError(
            f"input_size must be positive sizes without the batch, e.g. (3, 224, 224), got {input_size}"
        )
    return torch.randn(batch, *(int(s) for s in input_size), generator=torch.Generator().manual_seed(seed))


def _first_tensor(out: object) -> Tensor:
    """The first tensor of a model output (a tensor, or a tuple/list/dict of them)."""
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)) and out:
        out = out[0]
    if not isinstance(out, Tensor):
        raise ExportError(f"cannot compare a model output of type {type(out).__name__}")
    return out


def _check_close(name: str, got: Tensor, ref: Tensor, rtol: float) -> float:
    """The max abs difference of ``got`` from ``ref`` relative to ``max(1, max |ref|)`` (logits near 1e6 differ
    by 1e1 in float32 and still agree), at most ``rtol``, else an :class:`ExportError`."""
    if tuple(got.shape) != tuple(ref.shape):
        raise ExportError(f"{name} output shape {tuple(got.shape)} differs from PyTorch's {tuple(ref.shape)}")
    diff = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    scale = max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
    if not math.isfinite(diff) or diff > rtol * scale:
        raise ExportError(f"{name} output differs from PyTorch by {diff:.3g} ({diff / scale:.3g} of the output "
                          f"scale {scale:.3g}; allowed {rtol:.3g})")  # fmt: skip
    return diff / scale


def _quoted(exc: BaseException) -> str:
    """``Type: first line`` of a library's error, for the one line an :class:`ExportError` says."""
    return f"{type(exc).__name__}: {first_line(exc)}"


@full_float32()  # exported and compared in full float32, whatever the caller's TF32/autocast
def _export(what: str, write: _Writer, model: nn.Module, path: str | os.PathLike, input_size: Sequence[int],
            rtol: float, force: bool = False) -> float:  # fmt: skip
    """``write`` an eval-mode float32 CPU copy of ``model`` to ``path``, atomically, once the file loaded back
    matched PyTorch; returns the relative difference (``nan`` when ``write`` returns no runner). An
    :class:`ExportError` leaves the destination as it was; ``force``: files written beside ``path`` (ONNX
    external data) may replace existing ones (:func:`~repmlp.io.model_file.staged`)."""
    net = copy.deepcopy(model).to(device="cpu", dtype=torch.float32).eval()
    example, x = _example(input_size, _TRACE_BATCH, seed=0), _example(input_size, _CHECK_BATCH, seed=1)
    with staged(path, force=force) as tmp, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' deprecation and tracing notes
        try:
            reloaded = write(net, example, tmp)
            got = None if reloaded is None else _first_tensor(reloaded(x))
        except (ExportError, OSError):  # an OSError: writing the file failed, named by staged()
            raise
        except Exception as exc:  # noqa: BLE001 - exporters and runtimes raise many types: report them as one
            raise ExportError(f"{what} of {type(model).__name__} failed: {_quoted(exc)}") from exc
        return float("nan") if got is None else _check_close(what, got, _first_tensor(net(x)), rtol)


class PerGroupLinear(nn.Module):
    """FC3 (a :class:`~repmlp.nn.layers.GroupwiseLinear`'s ``weight`` and ``bias``, the same tensors) as one 2-D
    product per group, stacked: the form written to ONNX, whose runtimes pre-pack a constant 2-D weight once
    when they load the graph, and a batched 3-D one on every run (docs/benchmarks.md, "FC3 per group in the
    ONNX graph"). The same sums. Shapes: ``(g, B, P/g)`` -> ``(g, B, Q/g)``."""

    def __init__(self, fc3: GroupwiseLinear) -> None:
        super().__init__()
        self.groups, self.weight, self.bias = fc3.groups, fc3.weight, fc3.bias

    def forward(self, rows: Tensor) -> Tensor:
        g = self.groups
        kernels = self.weight.reshape(g, -1, self.weight.shape[1])
        biases = [None] * g if self.bias is None else self.bias.reshape(g, -1)
        return torch.stack([nn.functional.linear(rows[j], kernels[j], biases[j]) for j in range(g)])


def per_group_fc3(model: nn.Module) -> nn.Module:
    """``model`` as a new tree (:func:`~repmlp.nn.convert.swap_modules`) whose RepMLP blocks' FC3s are
    :class:`PerGroupLinear`: the form :func:`export_onnx` writes. ``model`` is not changed."""
    fc3s = {id(m.partition_perceptron.fc3) for m in model.modules() if isinstance(m, RepMLPBlock)}
    return swap_modules(model, lambda m: PerGroupLinear(m) if id(m) in fc3s else None)


def export_onnx(model: nn.Module, path: str | os.PathLike, input_size: Sequence[int], *, check: bool = True,
                opset_version: int | None = None, rtol: float = DEFAULT_RTOL,
                per_group: bool = True, force: bool = False) -> float:  # fmt: skip
    """Export ``model`` (taking one ``(N, *input_size)`` tensor) to ONNX at ``path`` with the
    ``torch.export``-based exporter, dynamic batch, checked in onnxruntime (``check``); see :func:`_export`.
    Export the deployed model (:func:`repmlp.reparameterize_model`): it is the one meant for inference.
    ``per_group``: FC3 as :func:`per_group_fc3` writes it (one 2-D product per group), else one batched one.
    ``force``: replace existing files of the external data written beside ``path`` (else refused)."""

    def write(net: nn.Module, example: Tensor, tmp: Path) -> Callable[[Tensor], object] | None:
        batch = torch.export.Dim("batch", min=1)
        net = per_group_fc3(net) if per_group else net
        program = torch.onnx.export(net, (example,), dynamo=True, input_names=["input"], dynamic_shapes=({0: batch},),
                                    output_names=["output"], opset_version=opset_version, verbose=False)  # fmt: skip
        program.save(str(tmp))
        return _onnxruntime(tmp) if check else None

    return _export("ONNX export", write, model, path, input_size, rtol, force)


def _onnxruntime(path: Path) -> Callable[[Tensor], Tensor]:
    import onnxruntime as ort  # optional: the repmlp[export] extra

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])


def export_torchscript(model: nn.Module, path: str | os.PathLike, input_size: Sequence[int], *,
                       rtol: float = DEFAULT_RTOL) -> float:  # fmt: skip
    """``torch.jit.trace`` ``model`` (deprecated upstream, still the way to a Python-free file for C++) to
    ``path`` (``.pt``), checked loaded back; see :func:`_export`."""

    def write(net: nn.Module, example: Tensor, tmp: Path) -> Callable[[Tensor], object]:
        buffer = io.BytesIO()  # torch's file writer aborts the process when a write fails (a full disk)
        torch.jit.save(torch.jit.trace(net, (example,), check_trace=False), buffer)
        tmp.write_bytes(buffer.getvalue())
        return torch.jit.load(str(tmp), map_location="cpu")

    return _export("TorchScript export", write, model, path, input_size, rtol)


def export_program(model: nn.Module, path: str | os.PathLike, input_size: Sequence[int], *,
                   rtol: float = DEFAULT_RTOL) -> float:  # fmt: skip
    """``torch.export.export`` ``model`` (dynamic batch; TorchScript's successor, ATen operators) to ``path``
    (``.pt2``), checked loaded back with ``torch.export.load``; see :func:`_export`."""

    def write(net: nn.Module, example: Tensor, tmp: Path) -> Callable[[Tensor], object]:
        batch = torch.export.Dim("batch", min=1)
        buffer = io.BytesIO()  # as in export_torchscript: torch's file writer aborts on a failed write
        torch.export.save(torch.export.export(net, (example,), dynamic_shapes=({0: batch},)), buffer)
        tmp.write_bytes(buffer.getvalue())
        return torch.export.load(str(tmp)).module()

    return _export("torch.export", write, model, path, input_size, rtol)


def write_int8_onnx(model: nn.Module, path: str | os.PathLike, input_size: Sequence[int]) -> None:
    """An int8 model's ONNX graph (its ``onnx`` bytes) written as ``path``, atomically, once it has run on a
    batch of ``input_size`` inputs (else an :class:`ExportError`)."""
    try:
        with torch.inference_mode():
            model(torch.zeros(2, *input_size))
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        size = "x".join(map(str, input_size))
        raise ExportError(f"the int8 graph does not run on {size} inputs: {_quoted(exc)}") from exc
    atomic_write_bytes(path, model.onnx.numpy().tobytes())
