"""Argument types and checkpoint helpers shared by the convert, export, bench and viz commands."""

from __future__ import annotations

import argparse
import codecs
import difflib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

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


# Files a report or figure must never replace: weights and exported models.
_MODEL_SUFFIXES = (".safetensors", ".onnx", ".pt", ".pth", ".ckpt", ".bin")


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


def check_report_output(
    output: Path | None,
    inputs: Sequence[Path | str] = (),
    *,
    kind: str = "a text file",
    own: Callable[[Path], bool] | None = None,
) -> None:
    """Refuse an ``--output`` for a text report or figure that would replace an input, a model file, or an
    existing file of another kind than ``kind`` (:func:`repmlp.commands._common.file_kind`: a training
    state, a run's report, ...); see :func:`check_output_file` (``own``: what this command wrote)."""
    if output is None:
        return
    if output.suffix.lower() in _MODEL_SUFFIXES:
        check_not_input(output, inputs)
        raise UserError(
            f"--output {output}: refusing to write a report over a model file name ({output.suffix})"
        )
    check_output_file(output, inputs, writes=kind, same=(kind,), own=own)


def check_not_input(output: Path, inputs: Sequence[Path | str]) -> None:
    """:class:`UserError` when ``output`` is one of the files ``inputs`` (symlinks and hard links seen
    through: ``os.path.samefile``), which writing it would destroy."""
    for src in inputs:
        try:
            same = os.path.samefile(output, src)
        except (OSError, ValueError):  # one of them missing or unreadable: not the same file
            same = False
        if same:
            what = "the checkpoint being read" if str(src).endswith(".safetensors") else f"its input {src}"
            raise UserError(f"--output {output} would overwrite {what}: write it under another name")


def file_kind(path: str | os.PathLike) -> str | None:
    """What an existing file is: ``"a training state"``, ``"a training-time model file"``, ``"a deployed model
    file"``, ``"a safetensors file"``, ``"an ONNX model"``, ``"a zip archive (TorchScript, .pt2 or a PyTorch
    checkpoint)"``, ``"a PNG image"``, ``"a run report"``, ``"a text file"``, ``"a binary file"``, ``"an
    empty file"``; ``"a folder"``, ``"a FIFO (named pipe)"``, ... for what is not a regular file; ``None``
    when nothing is there. Only a regular file's first bytes are read."""
    from repmlp.data.inputs import not_regular  # start-up time: the models load only once a command runs
    from repmlp.io.model_file import FORMAT, STATE_FORMAT, CheckpointError, read_metadata

    kind = not_regular(path)
    if kind is not None:
        return None if kind == "missing" else kind
    try:
        meta = read_metadata(path)
        if meta.get("format") == STATE_FORMAT:
            return "a training state"
        if meta.get("format") == FORMAT:
            return "a deployed model file" if meta.get("form") == "deploy" else "a training-time model file"
        return "a safetensors file"
    except CheckpointError:
        pass
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return "an unreadable file"
    if not head:
        return "an empty file"
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (TorchScript, .pt2 or a PyTorch checkpoint)"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "a PNG image"
    if str(path).lower().endswith(".onnx") and head[:1] == b"\x08":  # ModelProto's field 1, ir_version
        return "an ONNX model"
    try:  # incremental: a multi-byte character cut at the end of the 4096 bytes still reads as text
        text = codecs.getincrementaldecoder("utf-8")().decode(head)
    except UnicodeDecodeError:
        return "a binary file"
    if text.startswith("# repmlp run:"):
        return "a run report"
    return "a text file" if "\x00" not in text else "a binary file"


def check_output_kind(
    path: str | os.PathLike, writes: str, same: tuple[str, ...], flag: str = "--output"
) -> None:
    """Refuse an output ``path`` that holds a file of another kind than the command writes: ``writes`` names
    what it writes, ``same`` the :func:`file_kind` values it may replace (its own earlier output). A missing
    path is fine; a folder, a FIFO or a device never is. One-line :class:`UserError`."""
    kind = file_kind(path)
    if kind is not None and kind not in same:
        raise UserError(f"{flag} {path} is {kind}, not {writes}: refusing to replace it (choose another name, "
                        "or remove the file first)")  # fmt: skip


def check_output_file(
    output: Path,
    inputs: Sequence[Path | str] = (),
    *,
    writes: str,
    same: tuple[str, ...],
    own: Callable[[Path], bool] | None = None,
    flag: str = "--output",
    new_in_run: bool = False,
) -> None:
    """The one rule for the files that commands other than ``train`` write: nothing the user owns is replaced.

    Refused (one line, before any work): an ``output`` that is one of the command's ``inputs``; a folder
    or special file; an existing file of another kind than ``same`` (``writes`` names what the command
    writes); one of that kind that this command did not write itself (``own(path)`` is false: the marks
    repmlp's files carry, see :func:`repmlp_mark`); and any ``output`` inside a finished run's folder
    (one holding ``report.md``: the run's record, whose files are the run's; ``new_in_run``: a new file
    there is fine, an existing one is still refused). An empty file holds nothing to lose and may be
    replaced."""
    from repmlp.engine.state import REPORT_FILE, is_finished_run

    check_not_input(output, inputs)
    check_output_kind(output, writes, (*same, "an empty file"), flag=flag)
    found = file_kind(output)
    if found not in (None, "an empty file") and own is not None and not own(output):
        raise UserError(
            f"{flag} {output} is {found} that this command did not write: refusing to replace it (choose "
            "another name, or remove the file first)"
        )
    folder = output.parent
    if (found is not None or not new_in_run) and is_finished_run(folder):
        raise UserError(
            f"{flag} {output}: {folder} holds a finished run ({REPORT_FILE} written), whose files are left as "
            "they are: write into another folder"
        )


def first_line_starts(*prefixes: str) -> Callable[[Path], bool]:
    """An ``own`` test for :func:`check_output_file`: the file's first line starts with one of
    ``prefixes`` (the header a command's text output always begins with)."""

    def test(path: Path) -> bool:
        from repmlp.data.inputs import InputError, read_bytes

        try:
            head = read_bytes(path, 1 << 30, "output")[:4096].decode("utf-8", "replace")
        except InputError:
            return False
        return head.startswith(prefixes)

    return test


# --------------------------------------------------------------- the marks repmlp's own files carry
_PNG = b"\x89PNG\r\n\x1a\n"


def png_is_ours(path: Path) -> bool:
    """A PNG whose ``tEXt`` chunk ``Software`` (before the image data) says ``repmlp``
    (:func:`repmlp.engine.report.save_figure` writes it)."""
    try:
        with open(path, "rb") as f:
            if f.read(8) != _PNG:
                return False
            for _ in range(64):  # the text chunks come first; a damaged file ends the search
                head = f.read(8)
                if len(head) < 8:
                    return False
                size, name = int.from_bytes(head[:4], "big"), head[4:]
                if name == b"IDAT" or size > 1 << 20:
                    return False
                body = f.read(size)
                f.seek(4, os.SEEK_CUR)  # the CRC
                if name == b"tEXt" and body.startswith(b"Software\x00repmlp"):
                    return True
    except OSError:
        return False
    return False


def onnx_is_ours(path: Path) -> bool:
    """An ONNX file whose ``metadata_props`` hold the key ``repmlp`` (:mod:`repmlp.deploy.export` writes
    it). Reads the top-level protobuf fields only, skipping the graph unread."""
    from repmlp.deploy.export import MARK

    def varint(f) -> int | None:  # noqa: ANN001 - a binary file
        value = shift = 0
        for _ in range(10):
            b = f.read(1)
            if not b:
                return None
            value |= (b[0] & 0x7F) << shift
            if b[0] < 0x80:
                return value
            shift += 7
        return None

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            while f.tell() < size:
                tag = varint(f)
                if tag is None:
                    return False
                field, wire = tag >> 3, tag & 7
                if wire == 0:
                    if varint(f) is None:
                        return False
                    continue
                if wire != 2:
                    return False
                length = varint(f)
                if length is None or f.tell() + length > size:
                    return False
                if field == 14 and length < 1 << 20:  # ModelProto.metadata_props: {1: key, 2: value}
                    entry = f.read(length)
                    if entry[:1] == b"\x0a" and entry[2 : 2 + entry[1]] == MARK.encode():
                        return True
                else:
                    f.seek(length, os.SEEK_CUR)
    except OSError:
        return False
    return False


def archive_is_ours(path: Path) -> bool:
    """A TorchScript or ``.pt2`` archive holding the extra file that :mod:`repmlp.deploy.export` adds."""
    import zipfile

    from repmlp.deploy.export import MARK_FILE

    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("/extra/" + MARK_FILE) or n == "extra/" + MARK_FILE for n in z.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


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


def runtime_version(runtime: str) -> str:
    """``"onnxruntime 1.32.0"``: the runtime and its installed version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{runtime} {version(runtime)}"
    except PackageNotFoundError:
        return runtime


def load_checkpoint(path: str | Path, *, form: str | None = None) -> nn.Module:
    """:func:`repmlp.io.model_file.load_model` on the CPU: the model with its ``metadata`` (its errors
    are already one-line UserErrors)."""
    from repmlp.io.model_file import load_model

    return load_model(path, device="cpu", form=form)
