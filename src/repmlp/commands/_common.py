"""Argument types and checkpoint helpers shared by the convert, export, bench and viz commands."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import UserError

log = logging.getLogger(__name__)


# Files a report or figure must never replace: weights and exported models.
_MODEL_SUFFIXES = (".safetensors", ".onnx", ".pt", ".pth", ".ckpt", ".bin")


def check_report_output(output: Path | None, inputs: Sequence[Path] = ()) -> None:
    """Refuse an ``--output`` for a text report or figure that would replace an input or a model file."""
    if output is None:
        return
    if output.is_dir():
        raise UserError(f"--output {output} is a folder")
    for src in inputs:
        if output.exists() and output.resolve() == Path(src).resolve():
            raise UserError(f"--output {output} would overwrite the checkpoint being read")
    if output.suffix.lower() in _MODEL_SUFFIXES:
        raise UserError(
            f"--output {output}: refusing to write a report over a model file name ({output.suffix})"
        )


def int_at_least(minimum: int):
    """An ``argparse`` type: an int >= ``minimum`` (out of range -> one-line usage error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


def positive_float(text: str) -> float:
    """An ``argparse`` type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def nonneg_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def model_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE parsed as JSON when it is JSON (``kernel_sizes=[3]``), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def add_limit_argument(group, flag: str, what: str) -> None:
    """``--train-limit`` / ``--val-limit N``: use the first N examples of ``what`` only."""
    group.add_argument(
        flag, type=int_at_least(1), default=None, metavar="N", help=f"use the first N {what} only"
    )


def add_run_arguments(group, *, resume_help: str, step: str) -> None:
    """The run flags every task's training shares: ``--resume``, ``--ckpt-every``, ``--device``, ``--amp``,
    ``--threads``, ``--compile`` (and the hidden ``--stop-after-steps``); ``step`` names a training step in the help
    (optimizer step, iteration)."""
    group.add_argument("--resume", action="store_true", help=resume_help)
    group.add_argument(
        "--ckpt-every",
        type=int_at_least(0),
        default=200,
        metavar="STEPS",
        help=f"checkpoint every STEPS {step}s as well (0: only at the usual points; default: 200)",
    )
    group.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N")
    group.add_argument(
        "--amp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="mixed precision (default: on CUDA); it changes the maths, so a resumed run keeps it",
    )
    group.add_argument("--threads", type=int_at_least(1), default=None, help="CPU threads (default: torch's)")
    group.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="torch.compile the training step (default auto: on CUDA unless the step runs as CUDA graphs, off on "
        "CPU, where it measured slower); "
        "a failed compilation falls back to eager with one logged line",
    )
    group.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="replay the model's forward and backward as CUDA graphs, so that the host launches two graphs "
        "a step instead of every kernel (default auto: on for classification on one CUDA device without "
        "--compile on; a failed capture falls back to eager with one logged line)",
    )
    # Hidden: a simulated crash after N steps (exit 3, no cleanup), for tests of --resume.
    group.add_argument("--stop-after-steps", type=int_at_least(1), default=None, help=argparse.SUPPRESS)


def add_init_argument(group, *, help: str, aliases: Sequence[str] = ()) -> None:
    """``--init FILE``: start training from the weights of a model file (every task; see
    :mod:`repmlp.finetune`). ``aliases``: older spellings of the same option."""
    group.add_argument("--init", *aliases, dest="init", default=None, metavar="FILE", help=help)


def add_device_argument(parser: argparse.ArgumentParser, default: str = "cpu") -> None:
    parser.add_argument(
        "--device",
        default=default,
        help=f"cpu, cuda, cuda:N, or auto (cuda when available) (default: {default})",
    )


def add_runtime_argument(parser: argparse.ArgumentParser, what: str) -> None:
    from ..runtimes import RUNTIMES

    parser.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default="torch",
        help=f"run {what} in PyTorch, or export to ONNX and run in ONNX Runtime or OpenVINO (CPU; "
        "onnxruntime comes with repmlp[export], openvino with repmlp[openvino])",
    )


def check_runtime(runtime: str, device) -> None:  # noqa: ANN001 - torch.device
    """A runtime that is not installed, or an ONNX runtime asked for a GPU, is a one-line error."""
    from ..runtimes import missing_runtime

    reason = missing_runtime(runtime)
    if reason is not None:
        raise UserError(reason)
    if runtime != "torch" and device.type != "cpu":
        raise UserError(f"--runtime {runtime} runs on the CPU: leave out --device {device}")


def runtime_version(runtime: str) -> str:
    """``"onnxruntime 1.32.0"``: the runtime and its installed version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{runtime} {version(runtime)}"
    except PackageNotFoundError:
        return runtime


def load_checkpoint(path: str | Path, *, form: str | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """:func:`repmlp.checkpoint.load_model` on the CPU (its errors are already one-line UserErrors)."""
    from ..checkpoint import load_model

    return load_model(path, device="cpu", form=form)


def checkpoint_input_size(
    model: nn.Module, info: dict[str, Any], img_size: int | None = None
) -> tuple[int, int, int]:
    """``(C, H, W)`` of the model in a checkpoint (:func:`repmlp.bench.model_input_size`)."""
    from ..bench import model_input_size

    return model_input_size(model, info, img_size)
