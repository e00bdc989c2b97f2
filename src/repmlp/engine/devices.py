"""The device of a run and how its steps run: ``--device``, the hardware line of reports, AMP's dtype,
``--compile``, ``--cuda-graphs`` and glibc's malloc settings for the commands."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

import torch

from repmlp.errors import UserError
from repmlp.io import model_file

COMPILE_CHOICES = ("auto", "on", "off")


def resolve_device(text: str) -> torch.device:
    """``--device`` -> ``torch.device`` (``auto``: CUDA when available); a device this machine lacks is a
    :class:`UserError` (:func:`repmlp.io.model_file.resolve_device`, the one rule for every device argument)."""
    return model_file.resolve_device(text, "--device")


def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
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
    if device.type == "cuda":
        hw = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        hw = cpu_name() + f", {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{hw}; torch {torch.__version__}, Python {platform.python_version()}"


def amp_dtype(device: torch.device) -> torch.dtype:
    """The autocast dtype: bfloat16, or float16 on GPUs without bfloat16 (which then need a GradScaler)."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def keep_freed_memory() -> bool:
    """Let glibc's malloc serve every block from its heap (never a fresh mapping) and keep up to 1 GiB freed for
    reuse: a CPU training step or forward pass frees and allocates the same large buffers every time, which
    glibc would otherwise map afresh and fault in each time (a mapping threshold cannot cover them: it stops
    at 32 MiB, which 224x224 batches of 32 pass). Whether it took effect (not glibc: ``False``). An
    application's choice (:mod:`repmlp.cli` makes it for every command): the memory stays with the process."""
    if os.name != "posix":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    # mallopt's parameters (glibc's malloc.h): M_MMAP_MAX -4 (0: no mapped blocks), M_TRIM_THRESHOLD -1
    return bool(mallopt(-4, 0)) and bool(mallopt(-1, 1 << 30))


def resolve_compile(choice: str, device: torch.device, graphs: bool = False) -> bool:
    """``--compile`` -> whether to ``torch.compile`` the training step. ``auto``: on CUDA unless the step
    runs as CUDA graphs (``graphs``), off elsewhere: inductor's CPU kernels for the BatchNorm reductions over
    RepMLP's partitions are slower than eager ones, and CUDA graphs of the eager step beat the compiled step
    of launch-bound RepMLP models without compile time (docs/benchmarks.md, docs/gpu.md)."""
    if choice not in COMPILE_CHOICES:
        raise UserError(f"--compile must be one of {', '.join(COMPILE_CHOICES)}, got {choice!r}")
    return choice == "on" or (choice == "auto" and device.type == "cuda" and not graphs)


def resolve_cuda_graphs(choice: str, device: torch.device, *, world: int, compile_choice: str, scaler: bool,
                        auto: bool = True) -> bool:  # fmt: skip
    """``--cuda-graphs`` -> whether the module's forward and backward run as CUDA graphs
    (:func:`repmlp.engine.loop.graph_module`). ``auto``: on a CUDA device, in one process, without
    ``--compile on`` nor a gradient scaler (fp16 AMP), when the task supports it (``auto``); ``on`` is refused
    where it cannot work. A graph replays one batch shape; other shapes run eagerly."""
    if choice not in COMPILE_CHOICES:
        raise UserError(f"--cuda-graphs must be one of {', '.join(COMPILE_CHOICES)}, got {choice!r}")
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
    possible = device.type == "cuda" and world == 1 and not scaler
    return choice == "auto" and auto and possible and compile_choice != "on"
