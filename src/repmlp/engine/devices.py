"""Devices and models for a run: ``--device`` parsing, the hardware line of reports, ``build_model``."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from repmlp.errors import UserError

log = logging.getLogger(__name__)


def resolve_device(text: str) -> torch.device:
    """``--device`` -> ``torch.device`` (``auto``: CUDA when available); a device this machine lacks is a
    :class:`UserError`."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UserError(f"--device: unknown device {text!r} (use cpu, cuda, cuda:N, mps or auto)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {text}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {text}: Apple's MPS is not available on this machine")
    elif device.type not in ("cpu", "mps"):
        raise UserError(f"--device {text}: only cpu, cuda and mps are supported")
    return device


def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def hardware_summary(device: torch.device) -> str:
    """One line naming the processor (or GPU), core count, threads and library versions."""
    import platform

    if device.type == "cuda":
        hw = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        hw = cpu_name() + f", {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{hw}; torch {torch.__version__}, Python {platform.python_version()}"


def build_model(
    name: str,
    model_args: dict[str, Any] | None = None,
    *,
    num_classes: int | None = None,
    in_chans: int | None = None,
    img_size: int | None = None,
    expect: Mapping[str, Any] | None = None,
    where: object = "the training state",
) -> tuple[nn.Module, dict[str, Any]]:
    """``create_model(name, **model_args)`` sized for the data; returns ``(model, kwargs used)``.

    ``img_size`` is passed only to models built for one input size (:func:`takes_img_size`); other CNNs
    take any size. An unknown name or an option the model rejects (``ValueError``/``TypeError`` from its
    constructor) is a :class:`UserError`; any other exception is a bug and propagates with its traceback.
    ``expect``: a state dict the model must fit (a resumed run's saved weights, read from ``where``): the
    model is built on the ``meta`` device and compared with it first, so that a state whose options
    describe a huge model is refused before anything is allocated.
    """
    from repmlp.models import create_model

    kwargs = dict(model_args or {})
    kwargs.update({k: v for k, v in (("num_classes", num_classes), ("in_chans", in_chans)) if v is not None})
    if img_size is not None and takes_img_size(name):
        kwargs = {"img_size": img_size, **kwargs}
    if expect is not None:
        _check_expected(name, kwargs, expect, where)
    try:
        return create_model(name, **kwargs), kwargs
    except (TypeError, ValueError) as exc:
        # The message as the model gave it (stripping quotes off it would cut '1,3' to '1).
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot build model {name!r}: {first}") from exc


def _check_expected(name: str, kwargs: dict[str, Any], expect: Mapping[str, Any], where: object) -> None:
    """The model ``create_model(name, **kwargs)`` would build, on the ``meta`` device, must hold the keys
    and shapes of ``expect`` (a state dict of tensors)."""
    from repmlp.models import create_model
    from repmlp.models.file_format import CheckpointError
    from repmlp.models.file_metadata import build_error, compare_state, meta_model

    if not all(isinstance(v, torch.Tensor) for v in expect.values()):
        raise CheckpointError(f"{where}: its model weights are not all tensors")
    held = sum(v.numel() for v in expect.values())
    try:
        ghost = meta_model(
            lambda: create_model(name, **kwargs), 4 * held + (1 << 20), 4 * len(expect) + 10_000
        )
    except Exception as exc:  # noqa: BLE001 - the options come from the state file
        raise build_error(where, name, kwargs, held, exc, "config.model_args") from None
    compare_state(where, f"this run ({name} with {kwargs})", ghost.state_dict(), expect)


def takes_img_size(name: str) -> bool:
    """Whether model ``name`` is built for one input size: every repmlp model (FC3 and the partitions
    depend on it), and timm models whose config says ``fixed_input_size`` (vision transformers...)."""
    from repmlp.models import is_model

    source, _, bare = name.rpartition(":")
    if source in ("", "repmlp") and is_model(bare):
        return True
    if source in ("", "timm"):
        import timm

        if timm.is_model(bare):
            cfg = timm.models.get_pretrained_cfg(bare)
            return bool(cfg is not None and getattr(cfg, "fixed_input_size", False))
    return False


def amp_dtype(device: torch.device) -> torch.dtype:
    """The autocast dtype: bfloat16, or float16 on GPUs without bfloat16 (which then need a GradScaler)."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc's malloc.h)
_MMAP_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit systems
_TRIM_BYTES = 1 << 30  # free memory at the heap's top kept before returning it to the OS


def keep_freed_memory() -> bool:
    """Let glibc's malloc serve blocks of up to 32 MiB from its heap and keep up to 1 GiB freed for reuse.

    A CPU training step allocates and frees the same activation-sized buffers every step; by default glibc
    maps each large one afresh from the OS, so every step page-faults its activations in again (about
    10^4 faults a step for the main job's model). Once per process; returns whether it took effect
    (``False`` where the C library is not glibc). The memory stays with the process until it ends, so
    this is an application's choice: ``repmlp train`` and ``repmlp study`` make it, the library does not.
    """
    import ctypes
    import ctypes.util

    if os.name != "posix":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES))


COMPILE_CHOICES = ("auto", "on", "off")


def resolve_compile(choice: str, device: torch.device, graphs: bool = False) -> bool:
    """``--compile`` -> whether to ``torch.compile`` the training step. ``auto``: on CUDA unless the step runs
    as CUDA graphs (``graphs``, :func:`resolve_cuda_graphs`), off elsewhere.

    Off on CPU because compiling measured slower there: inductor's CPU kernels for the BatchNorm
    reductions over RepMLP's partition layouts are slower than the eager ones (benchmarks/bench_train.py).
    On CUDA the eager step replayed as CUDA graphs beat the compiled step for RepMLP models, whose steps
    are bound by the host's kernel launches, and it needs no compile time (docs/gpu.md).
    """
    if choice not in COMPILE_CHOICES:
        raise UserError(f"--compile must be one of {', '.join(COMPILE_CHOICES)}, got {choice!r}")
    return choice == "on" or (choice == "auto" and device.type == "cuda" and not graphs)


def resolve_cuda_graphs(
    choice: str, device: torch.device, *, world: int, compile_choice: str, scaler: bool, auto: bool = True
) -> bool:
    """``--cuda-graphs`` -> whether the training module's forward and backward run as CUDA graphs
    (:func:`repmlp.engine.loop.graph_module`).

    ``auto``: on a CUDA device, in one process, without ``--compile on`` and without a gradient scaler (fp16
    AMP), when the task supports it (``auto``); ``on`` asks for it and is refused where it cannot work;
    ``off`` never. A graph replays one batch shape; other shapes run eagerly.
    """
    if choice not in COMPILE_CHOICES:
        raise UserError(f"--cuda-graphs must be one of {', '.join(COMPILE_CHOICES)}, got {choice!r}")
    possible = device.type == "cuda" and world == 1 and not scaler
    if choice == "on":
        why = (
            "a CUDA device" if device.type != "cuda" else
            "one process (not torchrun with several)" if world > 1 else
            "bfloat16 or no AMP (fp16 AMP's gradient scaler cannot be captured)" if scaler else
            "no --compile on" if compile_choice == "on" else ""
        )  # fmt: skip
        if why:
            raise UserError(f"--cuda-graphs on needs {why}")
        return True
    return choice == "auto" and auto and possible and compile_choice != "on"
