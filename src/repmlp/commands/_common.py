"""What several commands share: the rule of their output files, the types of their options and options built
from a task's config (their types from the one table of ranges, :data:`repmlp.tasks.limits.OPTIONS`)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import timm
import torch
import torchvision

from repmlp.data.inputs import not_regular
from repmlp.deploy.runtimes import RUNTIMES, missing_runtime
from repmlp.errors import UserError
from repmlp.models.registry import list_models, resolve_model
from repmlp.tasks.config import TaskConfig
from repmlp.tasks.limits import OPTIONS, Range


def model_name(text: str) -> str:
    """argparse type of ``--model``: a name :func:`repmlp.create_model` knows (repmlp's, timm's, torchvision's);
    an unknown one is refused before any work, with the closest names of all three."""
    try:
        resolve_model(text)
    except ValueError as exc:
        names = dict.fromkeys(
            [*list_models(), *timm.list_models(), *torchvision.models.list_models(module=torchvision.models)]
        )
        close = difflib.get_close_matches(text.rpartition(":")[2], list(names), n=5, cutoff=0.6)
        raise argparse.ArgumentTypeError(
            f"{exc}" + (f"; did you mean: {', '.join(close)}." if close else "")
        ) from None
    return text


def add_force_argument(parser: argparse.ArgumentParser, flag: str = "--output") -> None:
    """``--force``: what lets a command replace an existing ``flag`` file (see :func:`check_output_file`)."""
    parser.add_argument("--force", action="store_true", help=f"replace an existing {flag} file (never one of the "
                        "command's inputs)")  # fmt: skip


def check_output_file(
    output: Path | None, inputs: Sequence[Path | str] = (), *, force: bool, flag: str = "--output"
) -> None:
    """The rule of every command's output file but ``train``'s run folder: nothing the user owns is replaced
    unasked. Refused with one line, before any work: an ``output`` that is one of the command's ``inputs``
    (links seen through: ``os.path.samefile``; also with ``--force``), a folder or special file, and an
    existing non-empty file unless ``force``. The commands then write it atomically
    (:func:`repmlp.io.model_file.staged`): a failed write leaves the old file. ``None``: no output asked for."""
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


def number_in(rng: Range | str) -> Callable[[str], int | float]:
    """The ``argparse`` type of a number in ``rng`` (or in the range of config field ``rng`` in
    :data:`OPTIONS`, so that the command line refuses what a config refuses, in the same words)."""
    rng = OPTIONS[rng] if isinstance(rng, str) else rng

    def parse(text: str) -> int | float:
        try:
            value = int(text) if rng.integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if rng.integer else 'a number'}, got {text!r}"
            ) from None
        if not rng.contains(value):
            raise argparse.ArgumentTypeError(f"must be in {rng.describe()}, got {text}")
        return value

    parse.__name__ = "integer" if rng.integer else "number"
    return parse


_BARE_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def model_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE as JSON (``kernel_sizes=[3]``, ``img_size=64``, ``mixer="conv"``); a bare word
    (``mixer=conv``) is taken as that string. Anything else (``kernel_sizes=1,3``) is refused as given."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        if _BARE_WORD.fullmatch(value) and value not in ("True", "False", "None", "NaN", "Infinity"):
            return key, value
        raise argparse.ArgumentTypeError(f'{key}={value}: the value is not JSON (write a list as [1,3], a text as '
                                         '"text", true/false/null in lower case)') from None  # fmt: skip
    if isinstance(parsed, float) and not math.isfinite(parsed):
        raise argparse.ArgumentTypeError(f"{key}={value}: the value must be a finite number")
    return key, parsed


class _ModelArgs(argparse.Action):
    """``--model-arg KEY=VALUE`` (repeatable) into one mapping: the config's ``model_args``."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:  # noqa: ANN001
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, {**(current if isinstance(current, dict) else {}), value[0]: value[1]})


def add_model_options(group: Any, model: str | None, example: str) -> None:
    """``--model`` (default ``model``) and ``--model-arg``."""
    group.add_argument("--model", default=model, type=model_name,
                       help="registered repmlp model, or a timm / torchvision model name")  # fmt: skip
    group.add_argument("--model-arg", dest="model_args", type=model_arg, action=_ModelArgs, default={},
                       metavar="KEY=VALUE", help=f"extra model option, VALUE as JSON (e.g. {example}); "
                       "repeatable")  # fmt: skip


def add_option(
    group: Any, flag: str, help: str | None = None, config: type[TaskConfig] | None = None, **kwargs: Any
) -> None:
    """``flag`` for the config field of its name: its type the field's range (:data:`OPTIONS`), its choices
    the config's, its default the field's in ``config``, a ``bool`` field a switch; ``kwargs`` win."""
    name = flag[2:].replace("-", "_")
    field = (config.__dataclass_fields__ if config else {}).get(name)
    if field is not None and field.default is not dataclasses.MISSING:
        kwargs.setdefault("default", field.default)
    choices = (config or TaskConfig).CHOICES
    if field is not None and str(field.type).startswith("bool"):
        switch = kwargs.get("default") is False
        kwargs.setdefault("action", "store_true" if switch else argparse.BooleanOptionalAction)
    elif name in OPTIONS:
        kwargs.setdefault("type", number_in(name))
    elif name in choices:
        kwargs.setdefault("choices", choices[name])
    group.add_argument(flag, help=help, **kwargs)


def add_options(
    group: Any, config: type[TaskConfig] | None, helps: dict[str, str | None], **kwargs: Any
) -> None:
    """:func:`add_option` of each ``flag: help`` of ``helps``."""
    for flag, help in helps.items():
        add_option(group, flag, help, config, **kwargs)


def add_limit_argument(group: Any, flag: str, what: str) -> None:
    """``--train-limit`` / ``--val-limit N``: use N examples of ``what`` only (an in-memory data set's first N,
    already in random order; of an image folder a seeded stratified subset)."""
    add_option(group, flag, f"use N {what} only: the first N of an in-memory data set, a seeded subset of an image "
               "folder that keeps every class's share", metavar="N", default=None)  # fmt: skip


def add_device_argument(parser: Any, default: str = "cpu") -> None:
    parser.add_argument("--device", default=default, help=f"cpu, cuda, cuda:N, or auto (cuda when available) "
                        f"(default: {default})")  # fmt: skip


def add_runtime_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--runtime", choices=RUNTIMES, default="torch", help=f"run {what} in PyTorch, or export to "
                        "ONNX and run in ONNX Runtime or OpenVINO (CPU; onnxruntime comes with repmlp[export], "
                        "openvino with repmlp[openvino])")  # fmt: skip


def check_runtime(runtime: str, device: torch.device) -> None:
    """A runtime that is not installed, or an ONNX runtime asked for a GPU, is a one-line error."""
    reason = missing_runtime(runtime)
    if reason is not None:
        raise UserError(reason)
    if runtime != "torch" and device.type != "cpu":
        raise UserError(f"--runtime {runtime} runs on the CPU: leave out --device {device}")
