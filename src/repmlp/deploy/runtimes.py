"""A deployed model run by ONNX Runtime or OpenVINO instead of PyTorch: ``--runtime`` of bench and predict.

:func:`to_runtime` exports the model to ONNX (:func:`repmlp.deploy.export.export_onnx`, checked with
onnxruntime) and wraps the graph in a :class:`~repmlp.deploy.onnx_model.RuntimeModel`, a module that feeds
float32 ``(N, C, H, W)`` batches to the runtime's CPU engine and returns its logits as a tensor, so the
benchmark, the predictor and any user code call it like the PyTorch model. An int8 model
(:class:`repmlp.deploy.precision.Int8OnnxModel`, a ``RuntimeModel`` itself) already is an ONNX graph: its
QDQ graph goes to the runtime as it is, and each runtime picks its own int8 kernels.

* ``onnxruntime``: one ``InferenceSession`` with all graph optimizations, ``threads`` intra-op threads;
  the batch stays dynamic.
* ``openvino``: the graph compiled for the CPU plugin once per input shape (OpenVINO plans memory and
  picks kernels for static shapes), float32 inference precision unless the graph is int8: on CPUs with
  bf16 units OpenVINO would otherwise run float32 graphs in bf16 without being asked.
"""

from __future__ import annotations

import importlib.util
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from repmlp.deploy.onnx_model import ONNX_RUNTIMES, RuntimeModel
from repmlp.errors import UserError

__all__ = ["RUNTIMES", "RuntimeModel", "missing_runtime", "to_runtime", "onnx_bytes_of"]

log = logging.getLogger(__name__)

RUNTIMES = ("torch", *ONNX_RUNTIMES)
# runtime -> (the repmlp extra that installs it, the packages it needs: the exporter's and its own)
_EXTRAS = {
    "onnxruntime": ("export", ("onnx", "onnxscript", "onnxruntime")),
    "openvino": ("openvino", ("onnx", "onnxscript", "openvino")),
}


def missing_runtime(runtime: str) -> str | None:
    """Why ``runtime`` cannot run here (one line naming the extra to install), or ``None`` when it can."""
    if runtime not in RUNTIMES:
        return f"unknown runtime {runtime!r} (choose from {', '.join(RUNTIMES)})"
    if runtime == "torch":
        return None
    extra, packages = _EXTRAS[runtime]
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if not missing:
        return None
    return f"--runtime {runtime} needs {', '.join(missing)}: pip install 'repmlp[{extra}]'"


def onnx_bytes_of(model: nn.Module, input_size: Sequence[int]) -> tuple[bytes, bool]:
    """``(ONNX graph, is int8)`` of a deployed ``model``: the graph of a :class:`RuntimeModel` (an int8
    model's) as it is, else a float32 export.

    Raises:
        UserError: a bfloat16/float16 model (ONNX runtimes get the float32 model and choose precision
            themselves), or an export that fails its check.
    """
    from repmlp.deploy.export import ExportError, export_onnx
    from repmlp.deploy.precision import precision_of

    if isinstance(model, RuntimeModel):  # already a graph (an int8 model): as it is
        return model.onnx.cpu().numpy().tobytes(), model.int8
    precision = precision_of(model)
    if precision != "fp32":
        raise UserError(f"a {precision} model runs in PyTorch only; export the fp32 or int8 model instead")
    with tempfile.TemporaryDirectory(prefix="repmlp-runtime-") as tmp:
        path = Path(tmp) / "model.onnx"
        try:
            export_onnx(model, path, input_size)
        except ExportError as exc:
            raise UserError(f"cannot run {type(model).__name__} outside PyTorch: {exc}") from None
        data = path.read_bytes()
        if any(p.name != path.name for p in Path(tmp).iterdir()):
            # External weight files (models over 2 GB) do not travel as bytes.
            raise UserError(f"{type(model).__name__} is too large for an in-memory ONNX graph")
    return data, False


def to_runtime(
    model: nn.Module, runtime: str, input_size: Sequence[int], *, threads: int | None = None
) -> nn.Module:
    """``model`` (deployed, eval mode) ready to run in ``runtime``: itself for ``torch``, else a
    :class:`RuntimeModel` of its ONNX graph, checked against PyTorch on a random batch (float graphs;
    int8 graphs differ between runtimes by their rounding, so they are only run).

    Raises:
        UserError: the runtime is not installed (naming the extra), or the model cannot be exported or
            does not reproduce PyTorch in that runtime.
    """
    if runtime == "torch":
        return model
    reason = missing_runtime(runtime)
    if reason is not None:
        raise UserError(reason)
    onnx, int8 = onnx_bytes_of(model, input_size)
    wrapped = RuntimeModel(onnx, runtime, threads=threads, int8=int8)
    if hasattr(model, "metadata"):
        wrapped.metadata = model.metadata
    if not int8 and runtime != "onnxruntime":  # export_onnx already checked onnxruntime's output
        _check(wrapped, model, input_size)
    return wrapped


def _check(wrapped: RuntimeModel, model: nn.Module, input_size: Sequence[int]) -> None:
    from repmlp.deploy.export import DEFAULT_RTOL, ExportError, _check_close, _example
    from repmlp.nn.numerics import full_float32

    x = _example(input_size, 3, seed=1)
    with torch.inference_mode(), full_float32():
        ref = model(x)
        try:
            _check_close(wrapped.runtime, wrapped(x), ref, DEFAULT_RTOL)
        except ExportError as exc:
            raise UserError(f"{wrapped.runtime} does not reproduce PyTorch: {exc}") from None
