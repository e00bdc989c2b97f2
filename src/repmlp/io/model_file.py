"""Model files: a model's weights in safetensors with the metadata that rebuilds it, read as untrusted input.

:func:`save_model` writes ``state_dict()`` and string metadata atomically. :func:`load_model` reads a file from
anywhere: nothing is unpickled, each field is checked against :data:`FIELDS`, the model the metadata describes
is built on the ``meta`` device within a budget of the file's size and compared with its tensors, NaN weights
are refused, and only then is the model built. Every problem is one :class:`CheckpointError` line naming the
file and the field.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks

from repmlp._version import __version__
from repmlp.data import PREPROCESSING_KEYS, eval_preprocessing
from repmlp.data.inputs import MAX_IMAGE_PIXELS, not_regular
from repmlp.errors import UserError, first_line
from repmlp.models import create_model, takes_img_size
from repmlp.models.layers import FILE_LOADER
from repmlp.models.registry import resolve_model
from repmlp.numerics import full_float32

__all__ = ["CheckpointError", "staged", "atomic_write_bytes", "atomic_write_text", "save_model", "load_model",
           "read_model_file", "read_tensors", "read_metadata", "ModelMetadata", "model_metadata", "FIELDS",
           "check_field", "check_model_kwargs", "check_fit", "meta_build", "ModelTooLarge", "check_finite",
           "PRECISION_LOADERS", "check_weights", "resolve_device"]  # fmt: skip

FORMAT, STATE_FORMAT = "repmlp", "repmlp-state"
FORMS = ("train", "deploy")  # a model file holds the training-time or the deployed form
PRECISIONS = ("fp32", "bf16", "fp16", "int8")  # what a deployed file may hold (repmlp.deploy.precision)
# Bounds of plain values in metadata: far beyond any real model, far below what could exhaust memory.
MAX_INT, MAX_FLOAT, MAX_DEPTH = 2**31, 1e12, 8
# A recorded input size: at most what --img-size takes per side and 64 channels (the zoo takes 3).
MAX_SIDE, MAX_CHANNELS = 4096, 64
# Options create_model sets itself, or that would load or place something: never from a file.
RESERVED_OPTIONS = ("deploy", "pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path",
                    "cache_dir", "features_only", "device", "dtype", "weights")  # fmt: skip
Form = Literal["train", "deploy"]
# What a float weight may be held in (not float8, whose arithmetic torch lacks, nor an integer dtype).
WEIGHT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class CheckpointError(UserError, ValueError):
    """A model or state file that cannot be used (missing, malformed, truncated, wrong model or form)."""


# ------------------------------------------------------------------------------------------ writing
_STAGING: set[Path] = set()  # the temporary paths of the staged() blocks running now


@contextlib.contextmanager
def staged(path: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """A temporary path in ``path``'s folder that atomically replaces ``path`` when the ``with`` block ends without
    an error, and is removed otherwise; files the writer puts beside it (ONNX external data) are moved first, and
    one whose name exists there already is a :class:`UserError` (nothing moved) unless ``force``. An
    ``OSError`` of the block or the move (a folder that cannot be written, a full disk, a name too long) is a
    :class:`UserError` naming ``path``. A ``path`` that is itself a staged temporary path is written directly."""
    path = Path(path)
    if path in _STAGING:
        yield path
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name[:32]}.tmp-"))  # fits NAME_MAX
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    tmp = folder / path.name
    _STAGING.add(tmp)
    try:
        yield tmp
        extras = [p for p in sorted(folder.iterdir()) if p != tmp]
        if not force and (taken := [p.name for p in extras if os.path.lexists(path.parent / p.name)]):
            raise UserError(f"cannot write {path}: {path.parent / taken[0]}, a file written with it, exists already: "
                            "add --force to replace it, or choose another name")  # fmt: skip
        for extra in extras:
            os.replace(extra, path.parent / extra.name)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        _STAGING.discard(tmp)
        shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):  # make the rename itself durable where folders can be opened
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def staging_leftovers(folder: Path) -> list[Path]:
    """The temporary folders :func:`staged` left in ``folder`` (its process killed while writing): this package's
    own, to clear before the folder is written again."""
    ours = re.compile(r"\..{1,32}\.tmp-[a-z0-9_]{8}", re.DOTALL)  # staged()'s prefix, mkdtemp's 8 characters
    try:
        return [p for p in folder.iterdir() if ours.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    except OSError:
        return []


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`staged`)."""
    with staged(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def cpu_tensors(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Each tensor its own contiguous CPU copy (safetensors refuses tensors that share storage)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def with_own_preprocessing(model: nn.Module, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``extra`` (a file's, :data:`FIELDS`), with ``model``'s own evaluation preprocessing (its timm config's)
    when it names neither a data set nor an evaluation preprocessing."""
    extra = dict(extra or {})
    if not {"dataset", "eval_preprocessing"} & set(extra):
        cfg = getattr(model, "pretrained_cfg", None) or {}
        own = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items() if k in PREPROCESSING_KEYS}
        extra.update({"eval_preprocessing": own} if own else {})
    return extra


def save_model(path: str | os.PathLike, model: nn.Module, *, name: str, model_kwargs: dict[str, Any],
               form: Form, extra: dict[str, Any] | None = None, precision: str = "fp32",
               check: bool = True) -> None:  # fmt: skip
    """Save ``model.state_dict()`` to ``path`` with what :func:`load_model` needs: the options of
    ``create_model(name, deploy=form == "deploy", **model_kwargs)``, ``extra`` (classes, input size,
    preprocessing, the run's data set: :data:`FIELDS`) and a deployed file's reduced ``precision``. An
    ``extra`` that names neither a data set nor an evaluation preprocessing gets the model's own (its timm
    config's), and one without an input size that of a model built for one: the file says how to read images
    for it. What :func:`load_model` would refuse (a ``name`` repmlp cannot build, metadata that does not
    describe these weights, NaN weights) is refused here, with nothing written: a :class:`CheckpointError`
    (``check=False``: written as given, as the damaged files tests hand to ``load_model``)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    extra = with_own_preprocessing(model, extra)
    if takes_img_size(name):  # a model built for one input size: the file says which (eval reads images so)
        extra.setdefault("input_size", list(input_size_of(model, model_kwargs, extra)))
    meta = {"format": FORMAT, "model": name, "model_kwargs": json.dumps(model_kwargs, sort_keys=True),
            "form": form, "repmlp_version": __version__}  # fmt: skip
    if extra:
        meta["extra"] = json.dumps(extra, sort_keys=True)
    if precision != "fp32":
        meta["precision"] = precision
    tensors, where = cpu_tensors(model.state_dict()), f"save_model({os.fspath(path)!r})"
    if check:  # load_model's checks, before anything is written
        try:
            resolve_model(name)
        except ValueError:
            raise CheckpointError(
                f"save_model: {name!r} is not a model repmlp.create_model builds, so load_model could not rebuild "
                "it; save your own network's state dict instead (torch.save(model.state_dict(), path) or "
                "safetensors.torch.save_file) and load it into your module (docs/using.md, Python)"
            ) from None
        fm = parse_metadata(where, meta)
        if precision != "int8":
            check_weights(where, tensors, fm)
    atomic_write_bytes(path, st_save(tensors, metadata=meta))


# ------------------------------------------------------------------------------------------ reading
def read_tensors(path: str | os.PathLike, *, body: bool = True) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors (none unless ``body``) and string metadata of safetensors file ``path``; safetensors
    validates the header, the offsets and the size. What is not a regular file (a FIFO) is never opened."""
    path = Path(path)
    kind = not_regular(path)
    if kind is not None:
        raise CheckpointError(f"checkpoint not found: {path}" if kind == "missing"
                              else f"checkpoint {path} is {kind}, not a regular file")  # fmt: skip
    try:
        with safe_open(path, "pt") as f:
            return ({k: f.get_tensor(k) for k in f.keys()} if body else {}), dict(f.metadata() or {})
    except Exception as exc:  # noqa: BLE001 - safetensors' own errors: not safetensors, a bad header, truncated
        why = f"{path} is not a safetensors file, or is truncated or damaged ({first_line(exc)[:200]})"
        raise CheckpointError(why) from None


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The string metadata of a safetensors file (its header only)."""
    return read_tensors(path, body=False)[1]


# ------------------------------------------------------------------- metadata: what each field may hold
def _bad(path: object, name: str, why: str) -> CheckpointError:
    """The error of a metadata field ``name`` (or of a command-line option, ``--model-arg``) of file ``path``."""
    return CheckpointError(f"{path}: {name if name.startswith('--') else f'metadata field {name!r}'} {why}")


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


Numbers = namedtuple("Numbers", "lo hi most", defaults=(4,))  # 1 to ``most`` numbers in [lo, hi]
_SIZE = [range(1, MAX_CHANNELS + 1), range(1, MAX_SIDE + 1), range(1, MAX_SIDE + 1)]  # [C, H, W]
_PRE = "extra.eval_preprocessing"
# Every metadata value repmlp reads, with what it may hold: one of a tuple's texts; a text (``str``; or null);
# a text matching a pattern; an integer in a range; 1 to n numbers in [lo, hi] (a std far enough from 0 to
# divide by); a non-empty list of texts (``[str]``); ``[C, H, W]`` in :data:`_SIZE`; a JSON object (``dict``)
# whose entries named here are checked too (others are kept, not read). ``model_kwargs``:
# :func:`check_model_kwargs`.
FIELDS: dict[str, Any] = {
    "model": re.compile(r"[A-Za-z0-9_.:\-]{1,200}"),
    "form": FORMS,
    "precision": PRECISIONS,
    "extra": dict,
    "extra.task": ("cls", "face", "seg"),
    **{f"extra.{k}": str for k in ("dataset", "data_dir", "imported_from", "converted_from", "layout")},
    "extra.classes": [str],
    "extra.input_size": _SIZE,
    **{f"extra.{k}": range(MAX_INT + 1) for k in ("identities", "iterations", "epochs")},
    "extra.crop_size": range(1, MAX_SIDE + 1),
    _PRE: dict,
    f"{_PRE}.crop_pct": Numbers(0.05, 4, most=1),
    f"{_PRE}.crop_mode": ("center", "squash", "border"),
    f"{_PRE}.interpolation": ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos"),
    f"{_PRE}.mean": Numbers(-1e4, 1e4),
    f"{_PRE}.std": Numbers(1e-4, 1e4),
    f"{_PRE}.input_size": _SIZE,
}


def check_field(path: object, key: str, value: Any, name: str | None = None, rule: Any = None) -> None:
    """``value`` of metadata field ``key`` against its rule in :data:`FIELDS` (or ``rule``); ``name``: the
    field in the error, a :class:`CheckpointError`."""
    rule, name = FIELDS[key] if rule is None else rule, name or key
    if isinstance(value, str) and isinstance(rule, range) and value.strip().isdigit():
        value = int(value)  # older files stored some counts as text
    if isinstance(rule, Numbers):
        items = value if isinstance(value, list) and rule.most > 1 else [value]
        ok = 1 <= len(items) <= rule.most and all(_is_number(v) and rule.lo <= v <= rule.hi for v in items)
        many = f"1 to {rule.most} numbers" if rule.most > 1 else "a number"
        why = f"must be {many} in [{rule.lo:g}, {rule.hi:g}]"
    elif isinstance(rule, range):
        ok = isinstance(value, int) and not isinstance(value, bool) and value in rule
        why = f"must be an integer in {rule.start}..{rule.stop - 1}"
    elif isinstance(rule, tuple):
        ok, why = value in rule, f"must be one of {', '.join(rule)}"
    elif isinstance(rule, re.Pattern):
        ok, why = isinstance(value, str) and bool(rule.fullmatch(value)), "must be a model name"
    elif rule in (str, dict):
        ok = value is None or isinstance(value, rule)
        why = "must be a text" if rule is str else "must be a JSON object"
    elif rule is _SIZE:
        ok, why = isinstance(value, list) and len(value) == 3, "must be [channels, height, width]"
    else:  # [str]: class names
        ok = isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)
        why = "must be a non-empty list of class names"
    if not ok:
        raise _bad(path, name, f"{why}, got {_short(value)}")
    for i, item in enumerate(value if rule is _SIZE else []):
        check_field(path, key, item, f"{name}[{i}]", rule[i])
    for k, item in (value or {}).items() if rule is dict else ():
        if f"{key}.{k}" in FIELDS:
            check_field(path, f"{key}.{k}", item, f"{name}.{k}")


def check_json_value(value: Any, where: str, *, path: object, depth: int = 0) -> None:
    """A JSON value of bounded size: null, a bool, a text, an int in +-2**31, a finite float of at most 1e12,
    or a list or an object of such, nested at most :data:`MAX_DEPTH` deep."""
    if depth > MAX_DEPTH:
        raise _bad(path, where, f"is nested more than {MAX_DEPTH} levels deep")
    items = enumerate(value) if isinstance(value, list) else value.items() if isinstance(value, dict) else ()
    for key, item in items:
        inner = f"{where}[{key}]" if isinstance(value, list) else f"{where}.{key}"
        check_json_value(item, inner, path=path, depth=depth + 1)
    if _is_number(value) and not (
        math.isfinite(value) and abs(value) <= (MAX_INT if isinstance(value, int) else MAX_FLOAT)
    ):
        raise _bad(path, where, f"is {value}, out of range")
    if not isinstance(value, (type(None), bool, str, int, float, list, dict)):
        raise _bad(path, where, f"is a {type(value).__name__}, not a JSON value")


def _parse(path: object, name: str, text: str | None) -> Any:
    """The JSON value of a metadata field (``{}`` when absent)."""
    try:
        return json.loads(text) if text is not None else {}
    except (ValueError, RecursionError):
        raise _bad(path, name, f"is not JSON ({_short(text)})") from None


def _json_object(path: object, name: str, value: Any) -> dict[str, Any]:
    """``value`` if it is a bounded JSON object (:func:`check_json_value`)."""
    if not isinstance(value, dict):
        raise _bad(path, name, f"must be a JSON object, got {type(value).__name__} {_short(value)}")
    check_json_value(value, name, path=path)
    return value


def check_model_kwargs(path: object, kwargs: Any, field_name: str = "model_kwargs") -> None:
    """Model options from a file or a training state: a bounded JSON object with identifier keys, none of
    :data:`RESERVED_OPTIONS` (whether the model takes each one is checked by building it: :func:`check_fit`)."""
    for key in _json_object(path, field_name, kwargs):
        if key in RESERVED_OPTIONS:
            raise _bad(path, f"{field_name}.{key}", "is not a model option a file may set")
        if not key.isidentifier():
            raise _bad(path, f"{field_name}.{key}", "is not an option name")


@dataclass
class ModelFileMeta:
    """A model file's metadata, checked (:func:`parse_metadata`)."""

    path: str
    model: str
    model_kwargs: dict[str, Any]
    form: str
    precision: str = "fp32"
    extra: dict[str, Any] = field(default_factory=dict)


def parse_metadata(path: object, meta: Mapping[str, str]) -> ModelFileMeta:
    """The checked metadata of a repmlp model file; a :class:`CheckpointError` naming the file and the first
    field that is missing, of the wrong type or out of range."""
    if meta.get("format") != FORMAT:
        why = f"{path} is not a repmlp model file (metadata format={meta.get('format')!r})"
        if meta.get("format") == STATE_FORMAT:  # the run's other file: say which one to use
            why = (
                f"{path} is a training state (for `repmlp train --resume`), not a model file: use the run's "
                f"model.safetensors ({Path(str(path)).with_name('model.safetensors')}) or deploy.safetensors"
            )
        raise CheckpointError(why)
    name, form, precision = meta.get("model"), meta.get("form"), meta.get("precision", "fp32")
    for key, value in (("model", name), ("form", form), ("precision", precision)):
        check_field(path, key, value)
    if precision != "fp32" and form != "deploy":
        raise _bad(path, "precision", f"is {precision}, which only a deployed (form deploy) file can be")
    kwargs = _parse(path, "model_kwargs", meta.get("model_kwargs"))
    check_model_kwargs(path, kwargs)
    extra = _json_object(path, "extra", _parse(path, "extra", meta.get("extra")))
    check_field(path, "extra", extra)
    return ModelFileMeta(str(path), name, kwargs, form, precision, extra)


# ------------------------------------------------------------ sizes: the described model, on the meta device
class ModelTooLarge(Exception):
    """Raised from a registration hook: the model being built outgrew its budget."""


def meta_build(build: Callable[[], nn.Module], tensors: Mapping, floor: tuple = (0, 0)) -> nn.Module:
    """``build()`` on the ``meta`` device, stopped with :class:`ModelTooLarge` once its parameters and buffers
    exceed four times the elements of ``tensors`` (the file's weights) plus 2**20, or four times their count
    plus 10,000 (never less than ``floor``): ``depths=[10**6]`` is refused in milliseconds, not hours."""
    held = sum(t.numel() for t in tensors.values())
    limit = (max(4 * held + (1 << 20), floor[0]), max(4 * len(tensors) + 10_000, floor[1]))
    count = [0, 0]

    def registered(_module: nn.Module, _name: str, tensor: Tensor | None) -> None:
        if tensor is not None:
            count[0], count[1] = count[0] + tensor.numel(), count[1] + 1
            if count[0] > limit[0] or count[1] > limit[1]:
                raise ModelTooLarge(f"{count[1]} tensors, {count[0]} elements")

    handles = [module_hooks.register_module_parameter_registration_hook(registered),
               module_hooks.register_module_buffer_registration_hook(registered)]  # fmt: skip
    try:
        with torch.device("meta"):
            return build()
    finally:
        for handle in handles:
            handle.remove()


def meta_model(where: object, name: str, kwargs: dict[str, Any], tensors: Mapping[str, Tensor], *,
               deploy: bool = False, field_name: str = "model_kwargs", floor: tuple = (0, 0)) -> nn.Module:  # fmt: skip
    """``create_model(name, deploy=deploy, **kwargs)`` on the ``meta`` device within the budget of ``tensors``
    (:func:`meta_build`); whatever stops it is one :class:`CheckpointError` naming ``where`` and the options'
    ``field_name`` (a file's ``model_kwargs``, a state's ``config.model_args``, ``--model-arg``)."""
    try:
        return meta_build(lambda: create_model(name, deploy=deploy, **kwargs), tensors, floor)
    except Exception as exc:  # noqa: BLE001 - whatever a builder raises on these options, they caused it
        text = first_line(exc)
        unknown = re.search(r"unexpected keyword argument '(\w+)'", text)
        if isinstance(exc, ModelTooLarge):
            held = sum(t.numel() for t in tensors.values())
            why = f"describes a {name} far larger than the file's {held} weights ({_short(kwargs)})"
        elif isinstance(exc, TypeError) and unknown:
            sep = " " if field_name.startswith("--") else "."
            field_name, why = f"{field_name}{sep}{unknown.group(1)}", f"is not an option of {name}"
        elif isinstance(exc, ValueError) and text.startswith("unknown model"):
            field_name, why = "model", f"names no model this installation knows ({text[:200]})"
        else:
            why = f"does not build a {name} ({type(exc).__name__}: {text[:200]})"
        raise _bad(where, field_name, why) from None


def _listed(keys: Sequence[str], n: int = 6) -> str:
    return ", ".join(keys[:n]) + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")


def compare_state(where: object, what: str, own: Mapping[str, Tensor], tensors: Mapping[str, Tensor]) -> None:
    """The keys, shapes and dtype kinds of ``own`` (a model's state dict, on any device) must be those of
    ``tensors`` (a file's: a float in :data:`WEIGHT_DTYPES`, an integer buffer in no float dtype): else one
    :class:`CheckpointError` that counts and names the differences."""
    shapes = [f"{k} {tuple(tensors[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
              if k in tensors and v.shape != tensors[k].shape]  # fmt: skip
    dtypes = [f"{k} {tensors[k].dtype}" for k, v in own.items() if k in tensors and (tensors[k].dtype not in
              WEIGHT_DTYPES if v.is_floating_point() else tensors[k].is_floating_point())]  # fmt: skip
    missing, unexpected = [k for k in own if k not in tensors], [k for k in tensors if k not in own]
    parts = [f"{len(keys)} {label}: {_listed(keys)}" for label, keys in (("missing from the file", missing),
             ("not in the model", unexpected), ("with other shapes (file vs model)", shapes),
             ("in a dtype no weight has (float32, float64, float16, bfloat16)", dtypes)) if keys]  # fmt: skip
    if parts:
        raise CheckpointError(f"{where} does not fit {what}: {'; '.join(parts)}")


def check_fit(where: object, name: str, kwargs: dict[str, Any], tensors: Mapping[str, Any], *, deploy: bool = False,
              field_name: str = "model_kwargs", what: str | None = None) -> nn.Module:  # fmt: skip
    """The model ``create_model(name, deploy=deploy, **kwargs)``, built on the ``meta`` device within the
    budget of ``tensors`` (:func:`meta_build`), must hold their keys and shapes; returns it. Nothing real is
    allocated; a failure is one :class:`CheckpointError` naming ``where`` and ``field_name``."""
    if not all(isinstance(v, Tensor) for v in tensors.values()):
        raise CheckpointError(f"{where}: its model weights are not all tensors")
    ghost = meta_model(where, name, kwargs, tensors, deploy=deploy, field_name=field_name)
    what = what or f"{name} ({'deploy' if deploy else 'train'} form) as its metadata describes it"
    compare_state(where, what, ghost.state_dict(), tensors)
    return ghost


def check_normalisation(where: object, recorded: Mapping[str, Any] | None, channels: int) -> None:
    """A recorded ``mean``/``std`` holds one value (every channel) or one per channel (RGB's three on a
    one-channel model: the first, as for a timm config's); else a :class:`CheckpointError`, not values cut."""
    for key in ("mean", "std"):
        n = len(v) if isinstance(v := (recorded or {}).get(key), (list, tuple)) else 1
        if n not in (1, channels) and (n, channels) != (3, 1):
            why = f"holds {n} values for a {channels}-channel model (give one, or one per channel)"
            raise _bad(where, f"{_PRE}.{key}", why)


def _check_described(fm: ModelFileMeta, ghost: nn.Module) -> None:
    """What the file records besides its weights must fit the model (``ghost``, on the ``meta`` device): the
    input size (its channels, and the size of a model built for one), the number of class names, the
    normalisation's values (:func:`check_normalisation`) and the resize the crop asks for (the input side over
    ``crop_pct``, its square within the decoding limit of an image, ``MAX_IMAGE_PIXELS``)."""
    chans, size, n = (getattr(ghost, k, None) for k in ("in_chans", "img_size", "num_classes"))
    recorded, classes = fm.extra.get("input_size"), fm.extra.get("classes")
    size = (size, size) if isinstance(size, int) else tuple(size) if isinstance(size, (tuple, list)) else None
    if recorded and isinstance(chans, int) and chans != recorded[0]:
        raise _bad(fm.path, "extra.input_size", f"says {recorded[0]} channels, but {fm.model} takes {chans}")
    if recorded and size is not None and len(size) == 2 and tuple(recorded[1:]) != size:
        raise _bad(fm.path, "extra.input_size", f"says {recorded[1]}x{recorded[2]} inputs, but {fm.model} "
                                                f"is built for {size[0]}x{size[1]}")  # fmt: skip
    if classes and isinstance(n, int) and n > 0 and len(classes) != n:
        raise _bad(fm.path, "extra.classes", f"names {len(classes)} classes, but the model has {n}")
    c, h, w = input_size_of(ghost, fm.model_kwargs, fm.extra)
    pre = eval_preprocessing(fm.extra.get("eval_preprocessing"), fm.extra.get("dataset"), c)
    check_normalisation(fm.path, fm.extra.get("eval_preprocessing"), c)
    if (side := max(h, w) / pre["crop_pct"]) ** 2 > MAX_IMAGE_PIXELS:
        raise _bad(fm.path, f"{_PRE}.crop_pct", f"{pre['crop_pct']:g} of a {h}x{w} input resizes every image to "
                   f"{side:.0f} pixels a side, more than the {MAX_IMAGE_PIXELS}-pixel limit of an image")  # fmt: skip


def check_finite(path: object, tensors: Mapping[str, Tensor]) -> None:
    """Every floating-point tensor holds finite numbers only: a NaN weight makes every output NaN."""
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(
                f"{path}: tensor {key!r} holds {int((~torch.isfinite(t)).sum())} NaN or infinite value(s) of "
                f"{t.numel()}: the weights are broken (a run that diverged?); use an earlier or another model file"
            )


def read_model_file(path: str | os.PathLike, *, form: Form | None = None,
                    int8: bool = False) -> tuple[dict[str, Tensor], ModelFileMeta]:  # fmt: skip
    """The tensors and checked metadata of a model file: the fields (:data:`FIELDS`), the model they describe
    against the tensors (:func:`check_fit`), finite weights. ``form`` (if given) must be the file's; an int8
    file (an ONNX graph, checked by its loader) only where ``int8``."""
    tensors, meta = read_tensors(path)
    fm = parse_metadata(path, meta)
    if form is not None and form != fm.form:
        raise CheckpointError(f"{path} holds the {fm.form!r} form of {fm.model}, expected the {form!r} form")
    if fm.precision == "int8":
        if not int8:
            raise CheckpointError(f"{path} is an int8 (ONNX) file: it holds a graph, not weights to train")
        return tensors, fm
    check_weights(path, tensors, fm)
    return tensors, fm


def check_weights(where: object, tensors: Mapping[str, Tensor], fm: ModelFileMeta) -> None:
    """The float weights of a model file (``where``) with checked metadata ``fm``: real dense tensors, those
    of the model ``fm`` describes (:func:`check_fit`, :func:`_check_described`), finite (what :func:`load_model`
    checks when it reads a file and :func:`save_model` before it writes one)."""
    for key, t in tensors.items():  # complex, sparse or quantized tensors are no weights repmlp writes
        if t.layout != torch.strided or t.is_complex() or t.is_quantized:
            raise CheckpointError(
                f"{where}: tensor {key!r} is {t.dtype} ({t.layout}), not a real dense weight"
            )
    _check_described(fm, check_fit(where, fm.model, fm.model_kwargs, tensors, deploy=fm.form == "deploy"))
    check_finite(where, tensors)


# ------------------------------------------------------------------------------------------ loading
# How a reduced-precision file is rebuilt, filled by repmlp.deploy.precision (``import repmlp`` imports it): a
# bf16/fp16 loader takes the float model; the int8 one the ONNX bytes and the recorded input size.
PRECISION_LOADERS: dict[str, Callable[..., nn.Module]] = {}


@dataclass
class ModelMetadata:
    """What a model file says besides its weights (``model.metadata`` of :func:`load_model`'s models):
    ``input_size`` ``(C, H, W)``; ``preprocessing`` ``{"dataset", "input_size", "eval_preprocessing"}``;
    ``classes`` or ``None``; ``extra`` as it is."""

    name: str
    model_kwargs: dict[str, Any]
    form: str
    precision: str
    num_classes: int
    input_size: tuple[int, int, int]
    classes: list[str] | None = None
    preprocessing: dict[str, Any] = field(default_factory=dict)
    path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def input_size_at(self, img_size: int | None = None) -> tuple[int, int, int]:
        """:attr:`input_size` ``(C, H, W)``, with ``H = W = img_size`` when given (an ``--img-size``)."""
        return self.input_size if img_size is None else (self.input_size[0], img_size, img_size)


def input_size_of(
    model: nn.Module, kwargs: Mapping[str, Any], extra: Mapping[str, Any]
) -> tuple[int, int, int]:
    """``(C, H, W)`` of ``model``'s inputs: ``extra``'s ``input_size`` (a file's), else its options' ``in_chans``
    and ``img_size`` over its timm config's (``(3, 224, 224)`` without one)."""
    size = extra.get("input_size")
    if not (isinstance(size, Sequence) and len(size) == 3):
        c, h, w = (getattr(model, "pretrained_cfg", None) or {}).get("input_size") or (3, 224, 224)
        given = kwargs.get("img_size")
        h, w = (given, given) if isinstance(given, int) else given if isinstance(given, Sequence) else (h, w)
        size = (kwargs.get("in_chans", c), h, w)
    return tuple(int(s) for s in size)


def resolve_device(device: str | torch.device, what: str = "device") -> torch.device:
    """``device`` (``"auto"``: CUDA when available) as a ``torch.device`` this machine has; an unknown or missing
    one is a :class:`UserError` naming ``what`` (the argument or option it came from), not torch's error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise UserError(
            f"{what}: unknown device {str(device)!r} (use cpu, cuda, cuda:N, mps or auto)"
        ) from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dev.type == "cuda" and (dev.index or 0) >= count:
        raise UserError(f"{what} {dev}: " + (f"this machine has {count} CUDA device(s)" if count else
                                             "CUDA is not available on this machine"))  # fmt: skip
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"{what} {dev}: Apple's MPS is not available on this machine")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"{what} {dev}: only cpu, cuda and mps are supported")
    return dev


def device_of(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a model without parameters)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def model_metadata(model: nn.Module, *, name: str, form: str, model_kwargs: Mapping[str, Any] | None = None,
                   precision: str = "fp32", extra: Mapping[str, Any] | None = None,
                   path: str | None = None) -> ModelMetadata:  # fmt: skip
    """The :class:`ModelMetadata` of ``model`` (eval mode) as a file records it. What the file does not
    record comes from the model: the input size from ``model_kwargs`` or its timm config, the class count
    from the model (else the width of its output on one zero image); the preprocessing is
    :func:`~repmlp.data.eval_preprocessing`'s, whatever the precision (``extra=None``, a model read from no
    file: its own timm config's)."""
    extra, kwargs = with_own_preprocessing(model) if extra is None else dict(extra), dict(model_kwargs or {})
    size = input_size_of(model, kwargs, extra)
    if takes_img_size(name):  # a file saved before files recorded it: eval reads images at the built size
        extra.setdefault("input_size", list(size))
    check_normalisation(path or name, extra.get("eval_preprocessing"), size[0])
    n = kwargs.get("num_classes") or getattr(model, "num_classes", None)
    if not (isinstance(n, int) and n > 0):  # a torchvision model or an int8 graph: ask the model itself
        with torch.inference_mode(), full_float32():
            n = int(model(torch.zeros(1, *size, device=device_of(model))).shape[-1])
    pre = eval_preprocessing(extra.get("eval_preprocessing"), extra.get("dataset"), size[0])
    classes = extra.get("classes")
    return ModelMetadata(name=name, model_kwargs=kwargs, form=form, precision=precision, num_classes=n,
                         input_size=size, classes=[str(c) for c in classes] if classes else None,
                         preprocessing={"dataset": extra.get("dataset"), "input_size": list(size),
                                        "eval_preprocessing": pre}, path=path, extra=extra)  # fmt: skip


def _int8_model(fm: ModelFileMeta, tensors: Mapping[str, Tensor]) -> nn.Module:
    onnx = tensors.get("onnx")
    if onnx is None or onnx.dtype != torch.uint8 or onnx.dim() != 1 or len(tensors) != 1:
        raise CheckpointError(f"{fm.path} is marked int8 but holds no ONNX graph (one uint8 tensor 'onnx')")
    try:  # the graph is checked against the input size the file records (repmlp.deploy.precision)
        return PRECISION_LOADERS["int8"](onnx, fm.extra.get("input_size"))
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - onnxruntime's parse errors: the bytes are not a graph
        why = f"{fm.path}: tensor 'onnx' is not a usable ONNX graph ({first_line(exc)[:200]})"
        raise CheckpointError(why) from None


def load_model(
    path: str | os.PathLike, *, device: str | torch.device = "cpu", form: Form | None = None
) -> nn.Module:
    """The model of a :func:`save_model` file (any form and precision, ``form`` if given the file's), loaded
    strictly, on ``device`` in eval mode, with ``model.metadata`` (:class:`ModelMetadata`); everything checked
    before it is built (:func:`read_model_file`). Every problem is one :class:`CheckpointError` (a device
    this machine lacks a :class:`UserError`: :func:`resolve_device`)."""
    device = resolve_device(device)
    tensors, fm = read_model_file(path, form=form, int8=True)
    if fm.precision == "int8":
        model = _int8_model(fm, tensors)
    else:
        model = create_model(fm.model, deploy=fm.form == "deploy", **fm.model_kwargs)
        model.load_state_dict(tensors)  # strict; keys and shapes already compared (bf16 copied to float32)
        model = model if fm.precision == "fp32" else PRECISION_LOADERS[fm.precision](model)
    model = model.to(device).eval()
    try:
        model.metadata = model_metadata(model, name=fm.model, form=fm.form, model_kwargs=fm.model_kwargs,
                                        precision=fm.precision, extra=fm.extra, path=str(path))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the class-count probe runs the model on the recorded input size
        if type(exc).__name__ == "OutOfMemoryError":
            raise
        raise CheckpointError(f"{path}: {fm.model} does not run on the input its file records "
                              f"({first_line(exc)[:200]})") from None  # fmt: skip
    return model


def _load_pretrained(name: str, kwargs: dict[str, Any]) -> nn.Module:
    """timm's ``pretrained=True, pretrained_cfg_overlay=dict(file=path)`` for repmlp model ``name``
    (:data:`repmlp.models.layers.FILE_LOADER`): the model with the file's options (``kwargs`` take precedence),
    loaded strictly; a classifier for another number of classes starts fresh (``reset_classifier``), as timm's
    ``load_pretrained`` drops it."""
    path = (kwargs.get("pretrained_cfg_overlay") or {}).get("file")
    if not path:
        raise ValueError(f"no pretrained weights are distributed for {name!r}; train one with `repmlp train` (or "
                         "`repmlp import` released ones) and load the file with repmlp.load_model, or with "
                         "pretrained=True, pretrained_cfg_overlay=dict(file=PATH)")  # fmt: skip
    if kwargs.get("features_only"):
        raise ValueError("features_only with a pretrained file: load the model, then wrap it")
    skip = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir", "feature_cfg")
    kwargs = {k: v for k, v in kwargs.items() if k not in skip}
    tensors, fm = read_model_file(path)
    if fm.model != name:
        raise CheckpointError(f"pretrained file {path} does not hold {name} ({fm.model})")
    if (fm.form == "deploy") != bool(kwargs.get("deploy", False)):
        hint = "leave deploy out" if fm.form == "train" else "pass deploy=True"
        raise CheckpointError(f"{path} holds the {fm.form} form of {name}: {hint}")
    classes = kwargs.pop("num_classes", None)
    model = create_model(name, **{**fm.model_kwargs, **kwargs})
    compare_state(f"pretrained file {path}", f"{name} with {kwargs}", model.state_dict(), tensors)
    model.load_state_dict(tensors)
    if classes is not None and classes != getattr(model, "num_classes", None):
        if not hasattr(model, "reset_classifier"):
            raise ValueError(f"{name} has no classifier to resize: leave num_classes out")
        model.reset_classifier(classes)
    return model


FILE_LOADER["file"] = _load_pretrained
