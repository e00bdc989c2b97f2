"""Export a (deployed) model to ONNX, TorchScript or a ``torch.export`` program, checked against PyTorch.

The exporters write into a private temporary folder next to the destination, check the written
file there (ONNX with onnxruntime, TorchScript by loading it back) and only then move it into place
with ``os.replace``: an existing file at the destination is never left half-written or replaced by
a file that failed its check.

The batch dimension stays dynamic: the check runs at a different batch size from the one used to
trace, so a graph that baked the batch size in fails the check instead of failing later.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from repmlp.errors import UserError, first_line
from repmlp.nn.numerics import full_float32

__all__ = [
    "ExportError",
    "export_onnx",
    "export_torchscript",
    "export_program",
    "missing_onnx_packages",
    "write_int8_onnx",
    "DEFAULT_RTOL",
]

log = logging.getLogger(__name__)

# What ONNX export and its check import: the optional `repmlp[export]` extra.
ONNX_PACKAGES = ("onnx", "onnxruntime", "onnxscript")


def missing_onnx_packages() -> list[str]:
    """The packages of the ``repmlp[export]`` extra that are not installed."""
    import importlib.util

    return [name for name in ONNX_PACKAGES if importlib.util.find_spec(name) is None]


#: Relative tolerance of the checks: max |exported - PyTorch| <= DEFAULT_RTOL * max(1, max |PyTorch|).
DEFAULT_RTOL = 1e-4
# Batch sizes used to trace and, different on purpose, to check.
_TRACE_BATCH, _CHECK_BATCH = 2, 3


class ExportError(RuntimeError):
    """The model could not be exported, or the exported file does not reproduce PyTorch's outputs."""


def _example(input_size: Sequence[int], batch: int, seed: int) -> Tensor:
    """A fixed random input ``(batch, *input_size)``; ``input_size`` is ``(C, H, W)``."""
    if len(input_size) < 1 or any(int(s) < 1 for s in input_size):
        raise ValueError(
            f"input_size must be positive sizes without the batch, e.g. (3, 224, 224), got {input_size}"
        )
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *(int(s) for s in input_size), generator=gen)


def _cpu_eval_copy(model: nn.Module) -> nn.Module:
    """An eval-mode float32 CPU copy, so exporting never changes the caller's model."""
    return copy.deepcopy(model).to(device="cpu", dtype=torch.float32).eval()


def _first_tensor(out: object) -> Tensor:
    """The first tensor of a model output (a tensor, or a tuple/list/dict of them)."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise ExportError(f"cannot compare a model output of type {type(out).__name__}")


def _check_close(name: str, got: Tensor, ref: Tensor, rtol: float) -> float:
    """The max abs difference of ``got`` from ``ref`` relative to ``max(1, max |ref|)`` (what ``rtol``
    bounds: an imported model's logits near 1e6 differ by 1e1 in float32 and agree to 1e-6)."""
    if tuple(got.shape) != tuple(ref.shape):
        raise ExportError(f"{name} output shape {tuple(got.shape)} differs from PyTorch's {tuple(ref.shape)}")
    diff = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    scale = max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
    if not math.isfinite(diff) or diff > rtol * scale:
        raise ExportError(
            f"{name} output differs from PyTorch by {diff:.3g} ({diff / scale:.3g} of the output scale "
            f"{scale:.3g}; allowed {rtol:.3g})"
        )
    return diff / scale


#: What marks a file as written by repmlp's exporters (an ONNX ``metadata_props`` key; the name of an
#: extra file in a TorchScript or ``.pt2`` archive): ``repmlp export`` replaces such a file only.
MARK = "repmlp"
MARK_FILE = "repmlp.json"


def _mark() -> str:
    from repmlp._version import __version__

    return json.dumps({"written_by": f"repmlp {__version__}"})


@contextlib.contextmanager
def _staging(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on normal exit move it (and sidecar files) into place.
    A failed write (read-only folder, disk full, a folder in the way) is a :class:`UserError` naming
    ``path``, not the temporary one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.tmp-")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    with staging as tmp:
        staged = Path(tmp) / path.name
        yield staged
        try:
            # Sidecar files (ONNX external data, named after the file) first, the main file last.
            for extra in sorted(Path(tmp).iterdir()):
                if extra != staged:
                    os.replace(extra, path.parent / extra.name)
            with open(staged, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(staged, path)
        except OSError as exc:
            raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None


@full_float32()  # exported and compared in full float32, whatever the caller's TF32/autocast
def export_onnx(
    model: nn.Module,
    path: str | os.PathLike,
    input_size: Sequence[int],
    *,
    check: bool = True,
    opset_version: int | None = None,
    rtol: float = DEFAULT_RTOL,
) -> float:
    """Export ``model`` to ONNX at ``path`` (dynamic batch) and check it with onnxruntime.

    Uses the ``torch.export``-based exporter (PyTorch's default). Export a deployed model
    (:func:`repmlp.reparameterize_model`): it is the one meant for inference, and it is faster.

    Args:
        model: any module taking one ``(N, *input_size)`` tensor; exported from an eval-mode
            float32 CPU copy.
        path: destination ``.onnx`` file; written atomically.
        input_size: ``(C, H, W)``, without the batch.
        check: run the file with onnxruntime on a fresh input of another batch size and compare.
        opset_version: ONNX opset (exporter default when ``None``).
        rtol: allowed max abs difference relative to ``max(1, max |output|)``.

    Returns:
        Max abs difference between onnxruntime's and PyTorch's outputs relative to ``max(1, max |output|)``
        (``nan`` when ``check`` is off).

    Raises:
        ExportError: the exporter failed, or the check found a difference above tolerance (the
            destination is then left as it was).
    """
    path = Path(path)
    net = _cpu_eval_copy(model)
    example = _example(input_size, _TRACE_BATCH, seed=0)
    batch = torch.export.Dim("batch", min=1)
    with _staging(path) as staged:
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                program = torch.onnx.export(
                    net,
                    (example,),
                    dynamo=True,
                    input_names=["input"],
                    output_names=["output"],
                    dynamic_shapes=({0: batch},),
                    opset_version=opset_version,
                    verbose=False,
                )
            program.model.metadata_props[MARK] = _mark()  # what lets a later export replace this file
            program.save(str(staged))
        except ExportError:
            raise
        except Exception as exc:  # noqa: BLE001 - exporter errors are many types; report them as one
            raise ExportError(f"ONNX export of {type(model).__name__} failed: {_quoted(exc)}") from exc
        diff = _check_onnx(staged, net, input_size, rtol) if check else float("nan")
    log.debug("wrote %s (onnxruntime relative diff %.3g)", path, diff)
    return diff


def _check_onnx(path: Path, net: nn.Module, input_size: Sequence[int], rtol: float) -> float:
    try:
        import onnxruntime as ort
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ExportError("checking the ONNX file needs onnxruntime: pip install 'repmlp[export]'") from exc
    x = _example(input_size, _CHECK_BATCH, seed=1)
    with torch.no_grad():
        ref = _first_tensor(net(x))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    try:
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise ExportError(f"onnxruntime could not run the exported model: {_quoted(exc)}") from exc
    return _check_close("ONNX", torch.from_numpy(got), ref, rtol)


@full_float32()  # exported and compared in full float32, whatever the caller's TF32/autocast
def export_torchscript(
    model: nn.Module,
    path: str | os.PathLike,
    input_size: Sequence[int],
    *,
    rtol: float = DEFAULT_RTOL,
) -> float:
    """Trace ``model`` with ``torch.jit.trace``, save it to ``path`` atomically, load it back and check.

    Args:
        model: any module taking one ``(N, *input_size)`` tensor; traced from an eval-mode float32
            CPU copy (RepMLP blocks skip their Python shape check while tracing).
        path: destination ``.pt`` file.
        input_size: ``(C, H, W)``, without the batch.
        rtol: allowed max abs difference relative to ``max(1, max |output|)``.

    Returns:
        Max abs difference between the reloaded TorchScript module and PyTorch on a fresh input, relative
        to ``max(1, max |output|)``.

    Raises:
        ExportError: tracing failed or the reloaded module does not reproduce PyTorch.
    """
    path = Path(path)
    net = _cpu_eval_copy(model)
    example = _example(input_size, _TRACE_BATCH, seed=0)
    x = _example(input_size, _CHECK_BATCH, seed=1)
    with _staging(path) as staged, torch.no_grad(), warnings.catch_warnings():
        # torch.jit is deprecated upstream but still the way to get a Python-free artefact for C++.
        warnings.simplefilter("ignore")
        try:
            traced = torch.jit.trace(net, (example,), check_trace=False)
            traced.save(str(staged), _extra_files={MARK_FILE: _mark()})
            loaded = torch.jit.load(str(staged), map_location="cpu")
            got = _first_tensor(loaded(x))
        except Exception as exc:  # noqa: BLE001 - tracing errors are many types
            raise ExportError(f"TorchScript export of {type(model).__name__} failed: {_quoted(exc)}") from exc
        diff = _check_close("TorchScript", got, _first_tensor(net(x)), rtol)
    log.debug("wrote %s (TorchScript relative diff %.3g)", path, diff)
    return diff


@full_float32()  # exported and compared in full float32, whatever the caller's TF32/autocast
def export_program(
    model: nn.Module,
    path: str | os.PathLike,
    input_size: Sequence[int],
    *,
    rtol: float = DEFAULT_RTOL,
) -> float:
    """``torch.export.export`` ``model`` (dynamic batch), save the program (``.pt2``), load it back, check.

    ``torch.export`` is TorchScript's successor (and what the ONNX exporter builds on): a graph of ATen
    operators, loadable with ``torch.export.load`` and compilable ahead of time (AOTInductor).

    Args:
        model: any module taking one ``(N, *input_size)`` tensor; exported from an eval-mode float32
            CPU copy.
        path: destination ``.pt2`` file; written atomically.
        input_size: ``(C, H, W)``, without the batch.
        rtol: allowed max abs difference relative to ``max(1, max |output|)``.

    Returns:
        Max abs difference between the reloaded program and PyTorch on a fresh input of another batch size,
        relative to ``max(1, max |output|)``.

    Raises:
        ExportError: export failed or the reloaded program does not reproduce PyTorch.
    """
    path = Path(path)
    net = _cpu_eval_copy(model)
    example = _example(input_size, _TRACE_BATCH, seed=0)
    x = _example(input_size, _CHECK_BATCH, seed=1)
    batch = torch.export.Dim("batch", min=1)
    with _staging(path) as staged, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            program = torch.export.export(net, (example,), dynamic_shapes=({0: batch},))
            torch.export.save(program, str(staged), extra_files={MARK_FILE: _mark()})
            got = _first_tensor(torch.export.load(str(staged)).module()(x))
        except Exception as exc:  # noqa: BLE001 - export errors are many types
            raise ExportError(f"torch.export of {type(model).__name__} failed: {_quoted(exc)}") from exc
        diff = _check_close("ExportedProgram", got, _first_tensor(net(x)), rtol)
    log.debug("wrote %s (ExportedProgram max abs diff %.3g)", path, diff)
    return diff


def _quoted(exc: BaseException) -> str:
    """``Type: first line`` of a library's error, for the one line an :class:`ExportError` says."""
    return f"{type(exc).__name__}: {first_line(exc)}"


def write_int8_onnx(model: nn.Module, path: str | os.PathLike, input_size: Sequence[int]) -> None:
    """An int8 model file's quantized ONNX graph (``model.onnx``, stored as bytes) written as ``path``,
    atomically, once it has run on a batch of ``input_size`` inputs (``ExportError`` if it does not)."""
    try:
        with torch.inference_mode():
            model(torch.zeros(2, *input_size))
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        size = "x".join(map(str, input_size))
        raise ExportError(f"the int8 graph does not run on {size} inputs: {_quoted(exc)}") from exc
    with _staging(Path(path)) as staged:
        # The mark appended as one more metadata_props entry (ModelProto field 14): protobuf merges it.
        key, value = MARK.encode(), _mark().encode()
        entry = bytes([0x0A, len(key)]) + key + bytes([0x12]) + _varint(len(value)) + value
        staged.write_bytes(model.onnx.numpy().tobytes() + bytes([0x72]) + _varint(len(entry)) + entry)


def _varint(n: int) -> bytes:
    """``n`` as a protobuf varint."""
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)
