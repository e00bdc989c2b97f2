"""Full float32 for the checks that compare a training-time model with its converted form.

A conversion is exact to float32 rounding, so its check compares outputs to about 1e-4. On a GPU, PyTorch's
defaults break that: cuDNN runs float32 convolutions in TF32 (10 mantissa bits), programs allow TF32 for
matmuls, a caller may hold autocast open, and the training-time form's convolutions then round to about 5e-4
where the converted FC3 does not. :func:`full_float32` switches all of that off for a check and restores the
caller's settings after, in either of PyTorch's two interfaces for them (the legacy flags, and since torch 2.9
``fp32_precision`` per backend and operator, whose getters raise when the two disagree).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["full_float32", "float32_flags", "run_precision", "AUTOCAST_DEVICES"]

# Device types whose autocast state full_float32 switches off (those this torch build knows).
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu")

# Every new-style fp32_precision setting (its object's path under torch.backends) -> the setting it
# inherits from when "none": operator -> its backend's "all" -> the generic one ("" is
# torch.backends.fp32_precision; "cudnn" holds CUDA's "all", which cuBLAS matmuls inherit too).
_FP32_PRECISION = {
    "": None,
    "cudnn": "",
    "cuda.matmul": "cudnn",
    "cudnn.conv": "cudnn",
    "cudnn.rnn": "cudnn",
    "mkldnn": "",
    "mkldnn.matmul": "mkldnn",
    "mkldnn.conv": "mkldnn",
    "mkldnn.rnn": "mkldnn",
}


def _precision_holders() -> list[tuple[str, Any]]:
    """``(path, object)`` of each ``torch.backends`` object with an ``fp32_precision`` (none before 2.9)."""
    holders = []
    for path in _FP32_PRECISION:
        obj: Any = torch.backends
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        try:
            if obj is not None and isinstance(obj.fp32_precision, str):
                holders.append((path, obj))
        except (AttributeError, RuntimeError):
            continue
    return holders


def _quiet(fn: Callable[[], Any]) -> Any:
    """``fn()`` with warnings silenced (a deprecation notice of the legacy flags must not become an error
    under ``-W error``), ``None`` when it raises ``RuntimeError`` (torch's mixed-interface check)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return fn()
        except RuntimeError:
            return None


def _autocast_devices() -> list[str]:
    available = getattr(torch.amp, "is_autocast_available", None)
    return [d for d in AUTOCAST_DEVICES if available is None or available(d)]


def _resolved(precisions: dict[str, str], path: str | None) -> str:
    """The effective new-style precision of ``path`` ("none" inherits: op -> backend -> generic)."""
    while path is not None:
        if precisions.get(path, "none") != "none":
            return precisions[path]
        path = _FP32_PRECISION[path]
    return "none"


def _save() -> dict[str, Any]:
    precisions = {path: obj.fp32_precision for path, obj in _precision_holders()}
    return {
        "matmul_precision": _quiet(torch.get_float32_matmul_precision),
        "cudnn_tf32": _quiet(lambda: torch.backends.cudnn.allow_tf32),
        "precisions": precisions,
    }


def _set(state: dict[str, Any], restoring: bool) -> None:
    """Apply the legacy settings, then the new-style ones (the legacy setters overwrite some of those)."""
    holders = dict(_precision_holders())
    matmul, cudnn_tf32 = state["matmul_precision"], state["cudnn_tf32"]
    if restoring:
        # A caller in a mixed state (its legacy getters raised): recreate the legacy value that disagrees.
        if matmul is None:
            matmul = "highest" if _resolved(state["precisions"], "cuda.matmul") == "tf32" else "high"
        if cudnn_tf32 is None:
            cudnn_tf32 = _resolved(state["precisions"], "cudnn.conv") != "tf32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        for path, value in state["precisions"].items():
            if path in holders:
                holders[path].fp32_precision = value


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """Run the body in full float32: no TF32 for cuDNN or matmuls (CUDA, and oneDNN's reduced float32
    modes on CPUs), float32 matmul precision ``"highest"``, autocast off for every device type.

    The caller's settings, in whichever interface it set them, are restored on exit, also when the body
    raises. Nests. Models and inputs keep their dtype: a float32 model runs in float32; one in
    bfloat16/float16 still runs in its own dtype.
    """
    saved = _save()
    exact = {
        "matmul_precision": "highest",
        "cudnn_tf32": False,
        "precisions": {path: "ieee" for path in saved["precisions"]},
    }
    with contextlib.ExitStack() as stack:
        stack.callback(_set, saved, True)
        _set(exact, False)
        for device in _autocast_devices():
            try:
                with warnings.catch_warnings():  # notices about a backend's AMP support: irrelevant when off
                    warnings.simplefilter("ignore")
                    stack.enter_context(torch.autocast(device, enabled=False))
            except Exception:  # noqa: BLE001 - a backend this build cannot run autocast for: nothing to switch off
                continue
        yield


def float32_flags() -> dict[str, Any]:
    """What float32 arithmetic is allowed now: ``cudnn_tf32``, ``matmul_tf32`` (effective settings, new
    interface where torch has it), ``matmul_precision`` and ``autocast`` (device type -> enabled)."""
    precisions = {path: obj.fp32_precision for path, obj in _precision_holders()}
    if precisions:
        cudnn_tf32 = _resolved(precisions, "cudnn.conv") == "tf32"
        matmul_tf32 = _resolved(precisions, "cuda.matmul") == "tf32"
    else:
        cudnn_tf32 = bool(_quiet(lambda: torch.backends.cudnn.allow_tf32))
        matmul_tf32 = bool(_quiet(lambda: torch.backends.cuda.matmul.allow_tf32))
    return {
        "cudnn_tf32": cudnn_tf32,
        "matmul_tf32": matmul_tf32,
        "matmul_precision": _quiet(torch.get_float32_matmul_precision),
        "autocast": {d: torch.is_autocast_enabled(d) for d in _autocast_devices() if d in ("cpu", "cuda")},
    }


def run_precision(device: torch.device, amp: bool, amp_dtype: torch.dtype | None = None) -> str:
    """How a run's own forward passes compute on ``device``, in words (for reports): the autocast dtype
    with ``amp``, else float32, and on CUDA whether its float32 convolutions and matmuls may use TF32."""
    dtype = str(amp_dtype or torch.bfloat16).replace("torch.", "")
    base = f"AMP ({dtype} autocast)" if amp else "float32"
    if device.type != "cuda":
        return base
    flags = float32_flags()
    tf32 = [
        name for name, on in (("convolutions", flags["cudnn_tf32"]), ("matmuls", flags["matmul_tf32"])) if on
    ]
    return base + (f", TF32 for float32 {' and '.join(tf32)}" if tf32 else ", no TF32")
