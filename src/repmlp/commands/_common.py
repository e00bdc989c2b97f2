"""What several commands share: the rule of their output files, argument types and options."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

from repmlp.data.inputs import not_regular
from repmlp.errors import UserError
from repmlp.tasks.limits import (  # noqa: F401 - the options' bounds, re-exported for the commands
    MAX_BATCH,
    MAX_CHANNELS,
    MAX_COUNT,
    MAX_PAD,
    MAX_REAL,
    MAX_SEED,
    MAX_SIDE,
    MAX_THREADS,
    MAX_WORKERS,
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ output files
def model_name(text: str) -> str:
    """argparse type of ``--model``: a name :func:`repmlp.create_model` knows (repmlp's, timm's, torchvision's);
    an unknown one is refused before any work, with the closest names of all three."""
    import timm  # start-up time: the registries load only when a model is named
    import torchvision

    from repmlp.models.registry import resolve_model

    try:
        resolve_model(text)
    except ValueError as exc:
        names = dict.fromkeys(
            [*timm.list_models(), *torchvision.models.list_models(module=torchvision.models)]
        )
        close = difflib.get_close_matches(text.rpartition(":")[2], list(names), n=5, cutoff=0.6)
        raise argparse.ArgumentTypeError(
            f"{exc}" + (f"; did you mean: {', '.join(close)}." if close else "")
        ) from None
    return text


def add_force_argument(parser: argparse.ArgumentParser, flag: str = "--output") -> None:
    """``--force``: what lets a command replace an existing ``flag`` file (see :func:`check_output_file`)."""
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"replace an existing {flag} file (never one of the command's inputs)",
    )


def check_output_file(
    output: Path | None, inputs: Sequence[Path | str] = (), *, force: bool, flag: str = "--output"
) -> None:
    """The rule of every command's output file but ``train``'s run folder: nothing the user owns is
    replaced unasked. Refused with one line, before any work: an ``output`` that is one of the command's
    ``inputs`` (symlinks and hard links seen through: ``os.path.samefile``; also with ``--force``), a
    folder or special file, and an existing non-empty file unless ``force``. The commands then write it
    atomically (:func:`repmlp.io.model_file.staged`): a failed write leaves the old file. ``None``: no
    output asked for."""
    if output is None:
        return
    for src in inputs:
        try:
            same = os.path.samefile(output, src)
        except (OSError, ValueError):  # one of them missing or unreadable: not the same file
            same = False
        if same:
            what = "the checkpoint being read" if str(src).endswith(".safetensors") else f"its input {src}"
            raise UserError(f"{flag} {output} would overwrite {what}: write it under another name")
    kind = not_regular(output)
    if kind not in (None, "missing"):
        raise UserError(f"{flag} {output} is {kind}, not a file")
    if kind is None and not force and output.stat().st_size > 0:
        raise UserError(f"{flag} {output} already exists: add --force to replace it, or choose another name")


# The options' upper bounds (MAX_BATCH, ...) are repmlp.tasks.limits's: a resumed state gets the same.


def int_at_least(minimum: int, maximum: int = MAX_COUNT):
    """An ``argparse`` type: an int in ``minimum..maximum`` (out of range -> one-line usage error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


def seed_int(text: str) -> int:
    """An ``argparse`` type: a random seed, ``0 .. 2**32 - 1`` (what numpy takes)."""
    return int_at_least(0, MAX_SEED)(text)


def float_in(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False, what: str | None = None):
    """An ``argparse`` type: a finite number in the interval from ``lo`` to ``hi`` (open ends excluded);
    ``what`` describes the lower bound in errors (``"a positive number"``)."""
    interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or not (value > lo if lo_open else value >= lo):
            raise argparse.ArgumentTypeError(f"must be {what or 'a number in ' + interval}, got {text}")
        if not (value < hi if hi_open else value <= hi):
            bound = f"less than {hi:g}" if hi_open else f"at most {hi:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


# A finite float > 0 / >= 0 (up to MAX_REAL).
positive_float = float_in(0.0, MAX_REAL, lo_open=True, what="a positive number")
nonneg_float = float_in(0.0, MAX_REAL, what="a number >= 0")
# A fraction in [0, 1): momentum, label smoothing, margins.
fraction = float_in(0.0, 1.0, hi_open=True)


_BARE_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def model_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE as JSON (``kernel_sizes=[3]``, ``img_size=64``, ``mixer="conv"``); a bare
    word (``mixer=conv``) is taken as that string. Anything else (``kernel_sizes=1,3``) is refused with the
    text as given, rather than guessed at."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        if _BARE_WORD.fullmatch(value) and value not in ("True", "False", "None", "NaN", "Infinity"):
            return key, value
        raise argparse.ArgumentTypeError(
            f'{key}={value}: the value is not JSON (write a list as [1,3], a text as "text", '
            "true/false/null in lower case)"
        ) from None
    if isinstance(parsed, float) and not math.isfinite(parsed):
        raise argparse.ArgumentTypeError(f"{key}={value}: the value must be a finite number")
    return key, parsed


def add_limit_argument(group, flag: str, what: str) -> None:
    """``--train-limit`` / ``--val-limit N``: use N examples of ``what`` only (an in-memory data set's
    first N, already in random order; of an image folder a seeded stratified subset)."""
    group.add_argument(
        flag,
        type=int_at_least(1, 2**31 - 1),
        default=None,
        metavar="N",
        help=f"use N {what} only: the first N of an in-memory data set, a seeded subset of an image folder "
        "that keeps every class's share",
    )


def add_run_arguments(group, *, resume_help: str, step: str) -> None:
    """The run flags every task's training shares: ``--resume``, ``--ckpt-every``, ``--device``, ``--amp``,
    ``--threads``, ``--compile``, ``--cuda-graphs``, ``--no-fast-training`` (and the hidden
    ``--stop-after-steps``); ``step`` names a training step in the help (optimizer step, iteration)."""
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
    group.add_argument(
        "--threads", type=int_at_least(1, MAX_THREADS), default=None, help="CPU threads (default: torch's)"
    )
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
    group.add_argument(
        "--no-fast-training",
        dest="fast_training",
        action="store_false",
        help="train the plain modules: no speed pass (repmlp.speed.fast_training)",
    )
    # Hidden: a simulated crash after N steps (exit 3, no cleanup), for tests of --resume.
    group.add_argument("--stop-after-steps", type=int_at_least(1), default=None, help=argparse.SUPPRESS)


def add_init_argument(group, *, help: str, aliases: Sequence[str] = ()) -> None:
    """``--init FILE``: start training from the weights of a model file (every task; see
    :mod:`repmlp.tasks.finetune`). ``aliases``: older spellings of the same option."""
    group.add_argument("--init", *aliases, dest="init", default=None, metavar="FILE", help=help)


def add_device_argument(parser: argparse.ArgumentParser, default: str = "cpu") -> None:
    parser.add_argument(
        "--device",
        default=default,
        help=f"cpu, cuda, cuda:N, or auto (cuda when available) (default: {default})",
    )


def add_runtime_argument(parser: argparse.ArgumentParser, what: str) -> None:
    from repmlp.deploy.runtimes import RUNTIMES

    parser.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default="torch",
        help=f"run {what} in PyTorch, or export to ONNX and run in ONNX Runtime or OpenVINO (CPU; "
        "onnxruntime comes with repmlp[export], openvino with repmlp[openvino])",
    )


def check_runtime(runtime: str, device) -> None:  # noqa: ANN001 - torch.device
    """A runtime that is not installed, or an ONNX runtime asked for a GPU, is a one-line error."""
    from repmlp.deploy.runtimes import missing_runtime

    reason = missing_runtime(runtime)
    if reason is not None:
        raise UserError(reason)
    if runtime != "torch" and device.type != "cpu":
        raise UserError(f"--runtime {runtime} runs on the CPU: leave out --device {device}")
