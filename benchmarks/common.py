"""Options and reporting helpers shared by the benchmark scripts (not part of the package).

The scripts time through :mod:`repmlp.bench.timing`, alternatives always *interleaved*
(:func:`repmlp.bench.timing.time_interleaved`): every round runs each candidate in turn (after warm-up),
and the reported time is the median over rounds. On a shared 2-core machine the load of other processes
drifts, and interleaving makes that drift hit every candidate alike, so the *ratios* stay meaningful
even when absolute times wander.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

# Make `import repmlp` work from a plain checkout (e.g. on the GPU machine, where it is not installed):
# before the first import of it, here and in the scripts, which import this module first.
_SRC = Path(__file__).resolve().parents[1] / "src"
if str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

from repmlp.engine import cpu_name  # noqa: E402 - needs the path above


def hardware(device: torch.device) -> str:
    """One line naming the hardware the numbers come from."""
    cpu = f"{cpu_name()}, {os.cpu_count()} logical cores, torch threads={torch.get_num_threads()}"
    text = f"CPU: {cpu}; torch {torch.__version__}"
    if device.type == "cuda":
        text += f"; GPU: {torch.cuda.get_device_name(device)}"
    return text


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
