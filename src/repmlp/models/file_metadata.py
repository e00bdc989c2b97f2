"""What a model file says about its model, checked before anything is built.

A model file (``.safetensors`` with repmlp's metadata, see :mod:`repmlp.models.model_file`) may come from anyone,
so its metadata is input like any other: a few edited bytes must not make the program build a model of
terabytes or fail deep inside with a traceback. Before a real tensor is allocated:

1. :func:`parse_metadata` checks every field's type and range: ``model`` (a model name), ``form``,
   ``precision``, ``model_kwargs`` (a JSON object of plain values, the keys options of the registered
   model: :func:`repmlp.models.registry.model_options`) and ``extra`` (the class names, the input size,
   the preprocessing, ...: :data:`EXTRA_FIELDS`).
2. :func:`build_checked` builds the described model on the ``meta`` device (no memory; the build stops
   once it holds more parameters than the file could fit), compares its state-dict keys and shapes with
   the file's tensors and the input size the file records with the model's, and only then builds the
   real model.

Every problem is one :class:`~repmlp.models.file_format.CheckpointError` line naming the file and the field (e.g.
``model_kwargs.num_classes``), which the command line prints as ``repmlp: error: ...`` with exit status 2.
The same checks serve training states resumed with ``--resume`` (their ``model_args``) and checkpoints
given to ``repmlp import`` (the options of ``--model-arg``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from repmlp.models.file_format import CheckpointError, listed

__all__ = [
    "FORMS",
    "PRECISIONS",
    "ModelFileMeta",
    "EXTRA_FIELDS",
    "MAX_SIDE",
    "MAX_CHANNELS",
    "parse_metadata",
    "check_model_kwargs",
    "check_json_value",
    "check_tensors",
    "check_fit",
    "build_checked",
    "meta_model",
    "ModelTooLarge",
    "build_error",
    "compare_state",
]

FORMS = ("train", "deploy")  # a model file holds the training-time or the deployed form
# The precisions a deployed model file may hold (repmlp.deploy.precision builds them).
PRECISIONS = ("fp32", "bf16", "fp16", "int8")
# Bounds of plain values in metadata: far beyond any real model, far below what could exhaust memory.
MAX_INT = 2**31 - 1
MAX_FLOAT = 1e12
MAX_TEXT = 4096
MAX_ITEMS = 100_000
MAX_DEPTH = 8
# A model file's recorded input size: at most what --img-size takes (4096 pixels per side) and 64 channels
# (no model of the zoo takes more than 3). A model that takes any size runs on the size its file records, so
# a few edited bytes must not ask every command for an 8192x8192 input of thousands of channels (gigabytes).
MAX_SIDE = 4096
MAX_CHANNELS = 64
# Options ``create_model`` sets itself, or that would load or place something: never from a file.
RESERVED_OPTIONS = (
    "deploy",
    "pretrained",
    "pretrained_cfg",
    "pretrained_cfg_overlay",
    "checkpoint_path",
    "cache_dir",
    "features_only",
    "device",
    "dtype",
    "weights",
)
_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,200}")


@dataclass
class ModelFileMeta:
    """A model file's metadata, checked: the model's name and options, its form and precision, and
    ``extra`` (class names, input size, preprocessing, the run's data set, ...)."""

    path: str
    model: str
    model_kwargs: dict[str, Any]
    form: str
    precision: str = "fp32"
    extra: dict[str, Any] = field(default_factory=dict)


def _bad(path: object, name: str, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: metadata field {name!r} {why}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_json_value(value: Any, where: str, *, path: object, depth: int = 0) -> None:
    """A JSON value of bounded size: ``None``, a bool, an int in +-2**31, a finite float, a string of at
    most :data:`MAX_TEXT` characters, a list or an object of such (string keys), nested at most
    :data:`MAX_DEPTH` deep. ``where`` names the field in the error."""
    if depth > MAX_DEPTH:
        raise _bad(path, where, f"is nested more than {MAX_DEPTH} levels deep")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise _bad(path, where, f"is {value}, out of range (at most {MAX_INT} in size)")
    elif isinstance(value, float):
        if not math.isfinite(value) or abs(value) > MAX_FLOAT:
            raise _bad(path, where, f"is {value}, out of range")
    elif isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise _bad(path, where, f"is a text of {len(value)} characters (at most {MAX_TEXT})")
    elif isinstance(value, list):
        if len(value) > MAX_ITEMS:
            raise _bad(path, where, f"is a list of {len(value)} items (at most {MAX_ITEMS})")
        for i, item in enumerate(value):
            check_json_value(item, f"{where}[{i}]", path=path, depth=depth + 1)
    elif isinstance(value, dict):
        if len(value) > MAX_ITEMS:
            raise _bad(path, where, f"has {len(value)} keys (at most {MAX_ITEMS})")
        for key, item in value.items():
            check_json_value(item, f"{where}.{key}", path=path, depth=depth + 1)
    else:
        raise _bad(path, where, f"is a {type(value).__name__}, not a JSON value")


def _json_object(path: object, name: str, text: str | None) -> dict[str, Any]:
    """A metadata field holding a JSON object (``{}`` when absent)."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise _bad(path, name, f"is not JSON ({_short(text)})") from None
    if not isinstance(value, dict):
        raise _bad(path, name, f"must be a JSON object, got {type(value).__name__} {_short(value)}")
    check_json_value(value, name, path=path)
    return value


def check_model_kwargs(
    path: object, model: str, kwargs: Any, options: set[str] | None = None, field_name: str = "model_kwargs"
) -> None:
    """Model options from a file (or a training state, or ``--model-arg``): a JSON object with identifier
    keys, none of :data:`RESERVED_OPTIONS`, each one of ``options`` (the registered model's, from its
    builder's signature: :func:`repmlp.models.registry.model_options`; ``None`` where the signature cannot
    tell: the model is then checked by building it, see :func:`build_checked`)."""
    if not isinstance(kwargs, dict):
        raise _bad(path, field_name, f"must be a JSON object, got {type(kwargs).__name__}")
    check_json_value(kwargs, field_name, path=path)
    for key in kwargs:
        where = f"{field_name}.{key}"
        if not isinstance(key, str) or not key.isidentifier():
            raise _bad(path, where, "is not an option name")
        if key in RESERVED_OPTIONS:
            raise _bad(path, where, "is not a model option a file may set")
        if options is not None and key not in options:
            shown = ", ".join(sorted(options))
            raise _bad(path, where, f"is not an option of {model} (its options: {shown})")


def _int_in(path: object, name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, str) and value.strip().isdigit():  # older files stored some counts as text
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(path, name, f"must be an integer in {lo}..{hi}, got {_short(value)}")
    return value


def _input_size(path: object, name: str, value: Any) -> None:
    if not isinstance(value, list) or len(value) != 3:
        raise _bad(path, name, f"must be [channels, height, width], got {_short(value)}")
    _int_in(path, f"{name}[0]", value[0], 1, MAX_CHANNELS)
    for i in (1, 2):
        _int_in(path, f"{name}[{i}]", value[i], 1, MAX_SIDE)


def _text(path: object, name: str, value: Any, choices: tuple[str, ...] | None = None) -> None:
    if value is None and choices is None:
        return
    if not isinstance(value, str) or (choices is not None and value not in choices):
        expected = f"one of {', '.join(choices)}" if choices else "a text"
        raise _bad(path, name, f"must be {expected}, got {_short(value)}")


def _classes(path: object, name: str, value: Any) -> None:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise _bad(path, name, f"must be a non-empty list of class names, got {_short(value)}")


def _numbers(path: object, name: str, value: Any, positive: bool) -> None:
    """1 to 4 numbers: a std (``positive``) in [1e-4, 1e4], far enough from 0 to divide by (a std of 1e-300
    would turn every pixel into inf); a mean in [-1e4, 1e4] (pixels are in [0, 1])."""
    items = value if isinstance(value, list) else [value]
    lo, hi = (1e-4, 1e4) if positive else (-1e4, 1e4)
    ok = 1 <= len(items) <= 4 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi for v in items
    )
    if not ok:
        raise _bad(path, name, f"must be 1 to 4 numbers in [{lo:g}, {hi:g}], got {_short(value)}")


_INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")


def _preprocessing(path: object, name: str, value: Any) -> None:
    """``eval_preprocessing``: timm's cfg keys (``crop_pct``, ``crop_mode``, ``interpolation``, ``mean``,
    ``std``, ``input_size``) that the evaluation transform takes."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise _bad(path, name, f"must be a JSON object, got {_short(value)}")
    for key, item in value.items():
        where = f"{name}.{key}"
        if key == "crop_pct":
            if isinstance(item, bool) or not isinstance(item, (int, float)) or not 0.05 <= item <= 4:
                raise _bad(path, where, f"must be a number in 0.05..4, got {_short(item)}")
        elif key == "crop_mode":
            _text(path, where, item, ("center", "squash", "border"))
        elif key == "interpolation":
            _text(path, where, item, _INTERPOLATIONS)
        elif key in ("mean", "std"):
            _numbers(path, where, item, positive=key == "std")
        elif key == "input_size":
            _input_size(path, where, item)


# extra's fields that repmlp reads, each with its check (other fields are kept, not read).
EXTRA_FIELDS: dict[str, Callable[[object, str, Any], None]] = {
    "task": lambda p, n, v: _text(p, n, v, ("cls", "face", "seg")),
    "dataset": lambda p, n, v: _text(p, n, v),
    "data_dir": lambda p, n, v: _text(p, n, v),
    "imported_from": lambda p, n, v: _text(p, n, v),
    "converted_from": lambda p, n, v: _text(p, n, v),
    "layout": lambda p, n, v: _text(p, n, v),
    "classes": _classes,
    "input_size": _input_size,
    "eval_preprocessing": _preprocessing,
    "identities": lambda p, n, v: _int_in(p, n, v, 0, MAX_INT),
    "iterations": lambda p, n, v: _int_in(p, n, v, 0, MAX_INT),
    "epochs": lambda p, n, v: _int_in(p, n, v, 0, MAX_INT),
    "crop_size": lambda p, n, v: _int_in(p, n, v, 1, MAX_SIDE),
}


def parse_metadata(
    path: object, meta: Mapping[str, str], options: Callable[[str], set[str] | None] = lambda name: None
) -> ModelFileMeta:
    """The checked metadata of a repmlp model file (its ``format`` already known to be repmlp's);
    ``options(name)``: the options model ``name`` takes (:func:`repmlp.models.registry.model_options`).

    Raises :class:`CheckpointError` naming the file and the first field that is missing, of the wrong
    type or out of range."""
    name = meta.get("model")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(path, "model", f"is not a model name ({_short(name)})")
    form = meta.get("form")
    if form not in FORMS:
        raise _bad(path, "form", f"must be train or deploy, got {_short(form)}")
    precision = meta.get("precision", "fp32")
    if precision not in PRECISIONS:
        raise _bad(path, "precision", f"must be one of {', '.join(PRECISIONS)}, got {_short(precision)}")
    if precision != "fp32" and form != "deploy":
        raise _bad(path, "precision", f"is {precision}, which only a deployed (form deploy) file can be")
    kwargs = _json_object(path, "model_kwargs", meta.get("model_kwargs"))
    check_model_kwargs(path, name, kwargs, options(name))
    extra = _json_object(path, "extra", meta.get("extra"))
    for key, check in EXTRA_FIELDS.items():
        if key in extra:
            check(path, f"extra.{key}", extra[key])
    return ModelFileMeta(str(path), name, kwargs, form, precision, extra)


# ------------------------------------------------------------------------------------------ tensors
def check_tensors(path: object, tensors: Mapping[str, Tensor]) -> None:
    """Every tensor of a model file is dense and real (complex, sparse or quantized tensors are no
    weights this project writes or reads)."""
    for key, t in tensors.items():
        if t.layout != torch.strided:
            raise CheckpointError(f"{path}: tensor {key!r} is not dense ({t.layout})")
        if t.is_complex() or t.is_quantized:
            raise CheckpointError(f"{path}: tensor {key!r} is {t.dtype}, not a real-valued weight")


class ModelTooLarge(Exception):
    """Raised from a registration hook: the model being built outgrew its budget."""


def meta_model(build: Callable[[], nn.Module], max_elements: int, max_tensors: int) -> nn.Module:
    """``build()`` on the ``meta`` device (no memory), stopped with :class:`ModelTooLarge` once its parameters
    and buffers exceed ``max_elements`` elements or ``max_tensors`` tensors (so that a hostile option
    such as ``depths=[10**6]`` does not build for hours)."""
    from torch.nn.modules import module as module_hooks

    count = {"elements": 0, "tensors": 0}

    def registered(_module: nn.Module, _name: str, tensor: Tensor | None) -> None:
        if tensor is None:
            return
        count["elements"] += tensor.numel()
        count["tensors"] += 1
        if count["elements"] > max_elements or count["tensors"] > max_tensors:
            raise ModelTooLarge(f"{count['tensors']} tensors, {count['elements']} elements")

    handles = [
        module_hooks.register_module_parameter_registration_hook(registered),
        module_hooks.register_module_buffer_registration_hook(registered),
    ]
    try:
        with torch.device("meta"):
            return build()
    finally:
        for handle in handles:
            handle.remove()


def build_error(
    path: object,
    model: str,
    kwargs: dict[str, Any],
    held: int,
    exc: BaseException,
    where: str = "model_kwargs",
) -> CheckpointError:
    """The error for a meta-device build of a file's model that failed: too large (:class:`ModelTooLarge`), an
    option the model does not take, an unknown model, or any other error of the builder; ``where`` names
    the field of the options (``model_kwargs`` of a model file, ``config.model_args`` of a state)."""
    text = str(exc).strip().splitlines()
    unknown = re.search(r"unexpected keyword argument '(\w+)'", text[0] if text else "")
    if isinstance(exc, ModelTooLarge):
        why = f"describes a {model} far larger than the {held} weights the file holds ({_short(kwargs)})"
        return _bad(path, where, why)
    if isinstance(exc, TypeError) and unknown:
        return _bad(path, f"{where}.{unknown.group(1)}", f"is not an option of {model}")
    if isinstance(exc, ValueError) and text and text[0].startswith("unknown model"):
        return _bad(path, "model", f"names no model this installation knows ({text[0][:200]})")
    reason = f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
    return _bad(path, where, f"does not build a {model} ({reason})")


def compare_state(path: object, what: str, own: Mapping[str, Tensor], tensors: Mapping[str, Tensor]) -> None:
    """The keys and shapes of ``own`` (a model's state dict, on any device) must be the file's."""
    missing = [k for k in own if k not in tensors]
    unexpected = [k for k in tensors if k not in own]
    shapes = [
        f"{k} (file {tuple(tensors[k].shape)}, model {tuple(own[k].shape)})"
        for k in own
        if k in tensors and tuple(own[k].shape) != tuple(tensors[k].shape)
    ]
    parts = [
        f"{label}: {listed(keys, 3)}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes))
        if keys
    ]
    if parts:
        raise CheckpointError(f"{path} does not fit {what}: {'; '.join(parts)}")


# The channels of the data sets whose models are read with their own pixel preprocessing.
_DATASET_CHANNELS = {"fashion-mnist": 1, "cifar10": 3}


def _check_input_size(fm: ModelFileMeta, model: nn.Module) -> None:
    """The input size the file records must be one the model takes (channels, and a fixed size), and a
    data set it names must have the model's channels (its images are fed as they are)."""
    chans = getattr(model, "in_chans", None)
    dataset = fm.extra.get("dataset")
    if isinstance(chans, int) and dataset in _DATASET_CHANNELS and _DATASET_CHANNELS[dataset] != chans:
        raise _bad(
            fm.path,
            "extra.dataset",
            f"is {dataset}, whose images do not have the {chans} channels of {fm.model}",
        )
    recorded = fm.extra.get("input_size")
    if not recorded:
        return
    if isinstance(chans, int) and chans != recorded[0]:
        raise _bad(fm.path, "extra.input_size", f"says {recorded[0]} channels, but {fm.model} takes {chans}")
    size = getattr(model, "img_size", None)
    size = (size, size) if isinstance(size, int) else tuple(size) if isinstance(size, (tuple, list)) else None
    if size is not None and len(size) == 2 and tuple(recorded[1:]) != tuple(size):
        raise _bad(
            fm.path,
            "extra.input_size",
            f"says {recorded[1]}x{recorded[2]} inputs, but {fm.model} is built for {size[0]}x{size[1]}",
        )


def check_fit(fm: ModelFileMeta, tensors: Mapping[str, Tensor], create: Callable[..., nn.Module]) -> None:
    """The model ``fm`` describes, built on the ``meta`` device, must match the file: the same state-dict
    keys and shapes, no more memory in buffers than the file holds, an input size and class names that
    fit what the file records. ``create``: :func:`repmlp.models.create_model` (passed in: this module
    sits below the models). Nothing real is allocated."""
    check_tensors(fm.path, tensors)
    deploy = fm.form == "deploy"
    held = sum(t.numel() for t in tensors.values())
    budget = 4 * held + (1 << 20)

    def build() -> nn.Module:
        return create(fm.model, deploy=deploy, **fm.model_kwargs)

    try:
        ghost = meta_model(build, budget, 4 * len(tensors) + 10_000)
    except Exception as exc:  # noqa: BLE001 - whatever a builder raises on these options, the file caused it
        raise build_error(fm.path, fm.model, fm.model_kwargs, held, exc) from None
    own = ghost.state_dict()
    compare_state(fm.path, f"{fm.model} ({fm.form} form) as its metadata describes it", own, tensors)
    extra_elements = sum(b.numel() for n, b in ghost.named_buffers() if n not in own)
    if extra_elements > budget:
        raise _bad(
            fm.path,
            "model_kwargs",
            f"describes a {fm.model} with {extra_elements} elements of buffers, far beyond the {held} weights "
            "the file holds",
        )
    _check_input_size(fm, ghost)
    classes = fm.extra.get("classes")
    n = getattr(ghost, "num_classes", None)
    if classes and isinstance(n, int) and n > 0 and len(classes) != n:
        raise _bad(fm.path, "extra.classes", f"names {len(classes)} classes, but the model has {n}")


def build_checked(
    fm: ModelFileMeta, tensors: Mapping[str, Tensor], create: Callable[..., nn.Module]
) -> nn.Module:
    """The empty model a file's weights load into (its form; float32), built for real only after
    :func:`check_fit` passed."""
    check_fit(fm, tensors, create)
    return create(fm.model, deploy=fm.form == "deploy", **fm.model_kwargs)
