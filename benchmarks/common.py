"""Timing and reporting helpers shared by the benchmark scripts (not part of the package).

Alternatives are always timed *interleaved*: every round runs each candidate once (after warm-up), and
the reported time is the median over rounds. On a shared 2-core machine the load of other processes
drifts, and interleaving makes that drift hit every candidate alike, so the *ratios* stay meaningful
even when absolute times wander.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from repmlp.engine import cpu_name

# Make `import repmlp` work from a plain checkout (e.g. on the GPU machine, where it is not installed).
_SRC = Path(__file__).resolve().parents[1] / "src"
if str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))


def hardware(device: torch.device) -> str:
    """One line naming the hardware the numbers come from."""
    cpu = f"{cpu_name()}, {os.cpu_count()} logical cores, torch threads={torch.get_num_threads()}"
    text = f"CPU: {cpu}; torch {torch.__version__}"
    if device.type == "cuda":
        text += f"; GPU: {torch.cuda.get_device_name(device)}"
    return text


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    rounds: int = 7,
    min_round_s: float = 0.2,
    warmup: int = 2,
) -> dict[str, float]:
    """Median seconds per call of each function, measured interleaved (see module docstring).

    Each round calls a function ``k`` times back to back, with ``k`` chosen once from the warm-up so a
    round lasts about ``min_round_s``; the per-call time of a round is its wall time divided by ``k``.
    """
    reps: dict[str, int] = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        once = max(time.perf_counter() - t0, 1e-6)
        reps[name] = max(1, int(min_round_s / once))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            k = reps[name]
            sync(device)
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            sync(device)
            samples[name].append((time.perf_counter() - t0) / k)
    return {name: statistics.median(s) for name, s in samples.items()}


def device_arg(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (median)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and shorter rounds (smoke run)")
    parser.add_argument(
        "--tf32",
        action="store_true",
        help="allow TF32 in float32 matmuls AND convolutions on GPU (default: neither, exact float32)",
    )
    return parser


def parse_cpu_only(parser: argparse.ArgumentParser, what: str) -> argparse.Namespace:
    """``parser``'s arguments for a benchmark of the CPU only: any ``--device`` but ``cpu`` is a usage error
    naming ``what`` the script measures."""
    args = parser.parse_args()
    if args.device != "cpu":
        parser.error(f"this benchmark measures {what} on the CPU only (--device cpu)")
    return args


def set_tf32(allow: bool) -> None:
    """Same float32 precision for every candidate on GPU.

    PyTorch's defaults differ by op: cuDNN convolutions may use TF32 (10-bit mantissa) while matmuls
    may not, which would hand the grouped-1x1-conv formulation both a speed advantage and ~1e-3
    relative errors. Benchmarks therefore set both switches the same way.
    """
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow


def table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
