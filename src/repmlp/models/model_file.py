"""Checkpoints in safetensors, written atomically and loaded without unpickling anything.

Two kinds of files:

- **model files** (:func:`save_model` / :func:`load_model`): a model's ``state_dict`` plus string metadata
  ``{"format": "repmlp", "model": name, "model_kwargs": JSON, "form": "train"|"deploy", ...}`` that is
  enough to rebuild the model with :func:`repmlp.create_model` and load it strictly. The loaded model
  carries what the file says besides its weights as ``model.metadata`` (:class:`ModelMetadata`).
- **state files** (:func:`save_state` / :func:`load_state`): any nested structure of dicts, lists, tuples,
  numbers, strings, tensors and numpy arrays (a training state: model, optimizer, scheduler, RNG states,
  data position). Tensors and arrays go into the safetensors body, the rest into a JSON tree kept in the
  file's metadata, so one file holds one consistent state.

Every write goes to a temporary file in the same folder, is fsync'ed, then ``os.replace``'d over the
target: a crash leaves either the old file or the new one, never half of one. Every problem while reading
(missing, not safetensors, truncated, another model or form, mismatched keys) raises
:class:`CheckpointError` with a one-line message.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors.torch import save as st_save
from torch import Tensor, nn

from repmlp.errors import UserError, first_line
from repmlp.models.file_format import (
    FORMAT,
    STATE_FORMAT,
    CheckpointError,
    read_tensors,
)
from repmlp.models.file_metadata import FORMS
from repmlp.models.input_size import model_input_size

__all__ = [
    "staged",
    "atomic_write_bytes",
    "atomic_write_text",
    "save_model",
    "load_model",
    "check_finite",
    "device_of",
    "ModelMetadata",
    "model_metadata",
    "read_model_file",
    "register_precision_loader",
    "save_state",
    "load_state",
]

Form = Literal["train", "deploy"]


# ----------------------------------------------------------------------------------------- writing
@contextlib.contextmanager
def staged(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path in ``path``'s folder that replaces ``path`` (``os.replace``: atomic) when the ``with``
    block ends without an error, and is removed otherwise, leaving ``path`` as it was. Files the writer puts
    beside it (ONNX external data) are moved first. A failed move or a folder that cannot be written is a
    :class:`UserError` naming ``path``, not the temporary one."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    except OSError as exc:  # a read-only folder, a file in the way
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    tmp = folder / path.name
    try:
        yield tmp
        try:
            for extra in sorted(folder.iterdir()):
                if extra != tmp:
                    os.replace(extra, path.parent / extra.name)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:  # disk full, a folder in the way
            raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    # Make the rename itself durable (POSIX); harmless where folders cannot be opened.
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`staged`)."""
    with staged(path) as tmp:
        try:
            tmp.write_bytes(data)
        except OSError as exc:  # disk full: one line naming the user's path
            raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _cpu_tensors(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    # safetensors refuses tensors that share storage (tied weights, views); cloning makes each
    # entry its own contiguous CPU buffer, which is what goes on disk anyway.
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def save_model(
    path: str | os.PathLike,
    model: nn.Module,
    *,
    name: str,
    model_kwargs: dict[str, Any],
    form: Form,
    extra: dict[str, Any] | None = None,
    precision: str = "fp32",
) -> None:
    """Save ``model.state_dict()`` to ``path`` (safetensors) with what :func:`load_model` needs.

    ``precision`` (``repmlp.deploy.precision.PRECISIONS``) is recorded for reduced-precision deployed models
    (``bf16``/``fp16`` weights, or an int8 ONNX graph); float32 files carry no such key.

    ``model_kwargs`` (JSON-serialisable) are passed back to ``create_model(name, deploy=..., **kwargs)``;
    ``extra`` (JSON-serialisable) is stored under the ``"extra"`` metadata key.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    from repmlp._version import __version__

    metadata = {
        "format": FORMAT,
        "model": name,
        "model_kwargs": json.dumps(model_kwargs, sort_keys=True),
        "form": form,
        "repmlp_version": __version__,
    }
    if extra:
        metadata["extra"] = json.dumps(extra, sort_keys=True)
    if precision != "fp32":
        metadata["precision"] = precision
    atomic_write_bytes(path, st_save(_cpu_tensors(model.state_dict()), metadata=metadata))


# ----------------------------------------------------------------------------------------- reading
@dataclass
class ModelMetadata:
    """What a model file says besides its weights (``model.metadata`` of :func:`load_model`'s models).

    ``input_size``: ``(C, H, W)`` the model takes; ``preprocessing``: ``{"dataset", "input_size" [C, H, W],
    "eval_preprocessing"}`` (JSON), the inputs of :func:`repmlp.deploy.predict.eval_image_transform`;
    ``classes``: the class names (``None`` when the file has none); ``extra``: the file's ``extra``
    record as it is (the run's data set and folder, its task, ...).
    """

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
        c, h, w = self.input_size
        return (c, h, w) if img_size is None else (c, img_size, img_size)


def device_of(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a model without parameters, e.g. an ONNX
    graph's wrapper)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def load_model(
    path: str | os.PathLike, *, device: str | torch.device = "cpu", form: Form | None = None
) -> nn.Module:
    """Rebuild the model saved by :func:`save_model` (any form and precision) and load its weights strictly.

    The model is on ``device`` in eval mode, with
    ``model.metadata`` (:class:`ModelMetadata`): its name and options, form, precision, input size, class
    names and preprocessing. ``form`` (if given) must match the file's form. The metadata is checked field
    by field and the model it describes is built on the ``meta`` device and compared with the file's
    tensors before the real one is built (:mod:`repmlp.models.file_metadata`): a file from elsewhere cannot
    make this allocate more than it holds. Every problem is a one-line :class:`CheckpointError`.
    """
    path = Path(path)
    tensors, fm = _checked_metadata(path, form)
    model = _build_for(fm, tensors)
    check_finite(path, tensors)
    _load_strict(model, tensors, path, fm.model, fm.form)
    model.to(device).eval()
    try:
        model.metadata = model_metadata(model, name=fm.model, form=fm.form, model_kwargs=fm.model_kwargs,
                                        precision=fm.precision, extra=fm.extra, path=str(path))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - torch's or onnxruntime's errors of the class-count probe
        # (model_metadata runs the model only then): a file whose model does not take the input size it
        # records is a bad file like any other, said in one line.
        if type(exc).__name__ == "OutOfMemoryError":
            raise
        raise CheckpointError(f"{path}: {fm.model} does not run on the input its file records "
                              f"({first_line(exc)[:200]})") from None  # fmt: skip
    return model


def model_metadata(
    model: nn.Module,
    *,
    name: str,
    form: str,
    model_kwargs: Mapping[str, Any] | None = None,
    precision: str = "fp32",
    extra: Mapping[str, Any] | None = None,
    path: str | None = None,
) -> ModelMetadata:
    """The :class:`ModelMetadata` of ``model`` (eval mode) as a file records it: ``extra`` and
    ``model_kwargs`` are the file's. A model with no recorded input size, class names or preprocessing
    (e.g. one built in memory) gets its timm config's; the class count is the recorded ``num_classes``,
    else the model's, else the width of its output on one zero image ``(1, C, H, W)``."""
    extra = dict(extra or {})
    kwargs = dict(model_kwargs or {})
    size = model_input_size(model, extra, kwargs)
    classes = extra.get("classes")
    return ModelMetadata(
        name=name,
        model_kwargs=kwargs,
        form=form,
        precision=precision,
        num_classes=_num_classes(model, kwargs, size),
        input_size=size,
        classes=[str(c) for c in classes] if isinstance(classes, list) and classes else None,
        preprocessing=_preprocessing(model, extra, size),
        path=path,
        extra=extra,
    )


def _num_classes(model: nn.Module, kwargs: Mapping[str, Any], input_size: tuple[int, int, int]) -> int:
    n = kwargs.get("num_classes") or getattr(model, "num_classes", None)
    if isinstance(n, int) and n > 0:
        return n
    from repmlp.nn.numerics import full_float32

    # e.g. a torchvision model or an int8 graph: ask the model itself (in full float32, as every check runs)
    with torch.inference_mode(), full_float32():
        return int(model(torch.zeros(1, *input_size, device=device_of(model))).shape[-1])


def _preprocessing(
    model: nn.Module, extra: Mapping[str, Any], input_size: tuple[int, int, int]
) -> dict[str, Any]:
    """The evaluation preprocessing of a file (see :class:`ModelMetadata`); without a recorded data set
    or published preprocessing, the model's own timm config (mean/std/crop) at its input size."""
    from repmlp.data import NATIVE_SIZE

    dataset = extra.get("dataset")
    pre = extra.get("eval_preprocessing")
    if dataset not in NATIVE_SIZE and not pre:
        cfg = getattr(model, "pretrained_cfg", None) or {}
        keys = ("crop_pct", "crop_mode", "interpolation", "mean", "std")
        pre = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items() if k in keys} or None
    return {"dataset": dataset, "input_size": list(input_size), "eval_preprocessing": pre}


def _checked_metadata(path: Path, form: Form | None) -> tuple[dict[str, Tensor], Any]:
    """The tensors of the model file ``path`` and its metadata, checked field by field
    (:func:`repmlp.models.file_metadata.parse_metadata`); ``form`` (if given) must be the file's."""
    from repmlp.models.file_metadata import parse_metadata
    from repmlp.models.registry import model_options

    tensors, meta = read_tensors(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(_not_a_model_file(path, meta))
    fm = parse_metadata(path, meta, model_options)
    if form is not None and form != fm.form:
        raise CheckpointError(f"{path} holds the {fm.form!r} form of {fm.model}, expected the {form!r} form")
    return tensors, fm


def read_model_file(path: str | os.PathLike, *, form: Form | None = None) -> tuple[dict[str, Tensor], Any]:
    """The tensors and checked metadata (:class:`repmlp.models.file_metadata.ModelFileMeta`) of a float model file,
    the model its metadata describes checked against the tensors on the ``meta`` device: what
    ``--init`` and the backbone loaders read, which build a model of their own. ``form`` (if given) must
    be the file's."""
    from repmlp.models.file_metadata import check_fit
    from repmlp.models.registry import create_model

    path = Path(path)
    tensors, fm = _checked_metadata(path, form)
    if fm.precision == "int8":
        raise CheckpointError(f"{path} is an int8 (ONNX) file: it holds a graph, not weights to train")
    check_fit(fm, tensors, create_model)
    check_finite(path, tensors)
    return tensors, fm


def check_finite(path: object, tensors: Mapping[str, Tensor]) -> None:
    """Every floating-point tensor of a model file holds finite numbers only: a NaN or infinite weight
    makes every output NaN (a prediction of ``nan%``, an accuracy of chance), so a file holding one is of
    no use to any command. Raises :class:`CheckpointError` naming the first such tensor."""
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(
                f"{path}: tensor {key!r} holds {bad} NaN or infinite value(s) of {t.numel()}: the weights are "
                "broken (a run that diverged?); use an earlier or another model file"
            )


def _not_a_model_file(path: Path, meta: dict[str, str]) -> str:
    """Why a safetensors file is no model file; a training state gets the hint to use the run's model."""
    if meta.get("format") == STATE_FORMAT:
        return (
            f"{path} is a training state (for `repmlp train --resume`), not a model file: use the run's "
            f"model.safetensors ({path.with_name('model.safetensors')}) or deploy.safetensors"
        )
    return f"{path} is not a repmlp model file (metadata format={meta.get('format')!r})"


# How a model file's reduced precision is rebuilt: ``precision -> loader``. The loaders belong to
# :mod:`repmlp.deploy.precision`, which fills this table when it is imported (``import repmlp`` does): this
# room reads the files, the deployment room knows how a bf16 model casts its input or an int8 graph runs.
# A bf16/fp16 loader takes the float model built from the file; the int8 loader the file's ONNX bytes and
# the input size the file records (``extra.input_size``, or ``None``), which the graph must take.
PRECISION_LOADERS: dict[str, Callable[..., nn.Module]] = {}


def register_precision_loader(precision: str, loader: Callable[..., nn.Module]) -> None:
    """Let model files in ``precision`` (one of :data:`~repmlp.models.file_metadata.PRECISIONS` but fp32)
    be loaded by ``loader``."""
    PRECISION_LOADERS[precision] = loader


def _precision_loader(fm: Any) -> Callable[..., nn.Module]:
    loader = PRECISION_LOADERS.get(fm.precision)
    if loader is None:  # only when repmlp.deploy.precision was never imported
        raise CheckpointError(f"{fm.path}: no loader for {fm.precision} files (import repmlp first)")
    return loader


def _build_for(fm: Any, tensors: dict[str, Tensor]) -> nn.Module:
    """The empty model a file's weights load into, in the file's form and precision (checked first:
    :func:`repmlp.models.file_metadata.build_checked`)."""
    from repmlp.models.file_metadata import build_checked
    from repmlp.models.registry import create_model

    if fm.precision == "int8":
        onnx = tensors.get("onnx")
        if onnx is None or onnx.dtype != torch.uint8 or onnx.dim() != 1 or len(tensors) != 1:
            raise CheckpointError(
                f"{fm.path} is marked int8 but holds no ONNX graph (one uint8 tensor 'onnx')"
            )
        try:
            # The graph is checked against the input size the file records (repmlp.deploy.precision).
            return _precision_loader(fm)(onnx, fm.extra.get("input_size"))
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - onnxruntime's parse errors: the bytes are not a graph
            raise CheckpointError(
                f"{fm.path}: tensor 'onnx' is not a usable ONNX graph ({first_line(exc)[:200]})"
            ) from None
    model = build_checked(fm, tensors, create_model)
    return model if fm.precision == "fp32" else _precision_loader(fm)(model)


def _load_strict(model: nn.Module, tensors: dict[str, Tensor], path: Path, name: str, form: str) -> None:
    """``load_state_dict(strict=True)`` with a one-line error that names the first mismatches."""
    own = model.state_dict()
    missing = [k for k in own if k not in tensors]
    unexpected = [k for k in tensors if k not in own]
    shapes = [k for k in own if k in tensors and tuple(own[k].shape) != tuple(tensors[k].shape)]
    if missing or unexpected or shapes:
        parts = []
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
            if keys:
                parts.append(f"{label}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}")
        raise CheckpointError(f"{path} does not fit {name} ({form} form): {'; '.join(parts)}")
    model.load_state_dict(tensors, strict=True)


# -------------------------------------------------------------------------------- training states
def _encode(obj: Any, tensors: dict[str, Tensor], prefix: str) -> Any:
    """JSON tree for ``obj``; tensors and arrays are moved into ``tensors`` and referenced by key."""
    if isinstance(obj, Tensor):
        key = f"t{len(tensors)}:{prefix}"
        tensors[key] = obj
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}:{prefix}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj))
        return {"__ndarray__": key}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        if isinstance(obj, float) and not np.isfinite(obj):
            return {"__float__": repr(obj)}
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj) and not any(k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{prefix}.{k}") for k, v in obj.items()}
        # Non-string keys (optimizer state is keyed by parameter index) keep their type.
        return {
            "__items__": [
                [_encode(k, tensors, prefix), _encode(v, tensors, f"{prefix}.{k}")] for k, v in obj.items()
            ]
        }
    raise TypeError(f"cannot store {type(obj).__name__} at {prefix or '<root>'} in a training state")


def _decode(obj: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy()
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def save_state(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Save a nested training state (see module docstring) to one safetensors file, atomically."""
    tensors: dict[str, Tensor] = {}
    tree = _encode(dict(state), tensors, "")
    metadata = {"format": STATE_FORMAT, "state": json.dumps(tree, allow_nan=False)}
    atomic_write_bytes(path, st_save(_cpu_tensors(tensors), metadata=metadata))


def load_state(path: str | os.PathLike) -> dict[str, Any]:
    """Inverse of :func:`save_state` (tensors come back on the CPU)."""
    path = Path(path)
    tensors, meta = read_tensors(path)
    if meta.get("format") != STATE_FORMAT or "state" not in meta:
        raise CheckpointError(
            f"{path} is not a repmlp training state (metadata format={meta.get('format')!r})"
        )
    try:
        tree = json.loads(meta["state"])
        state = _decode(tree, tensors)
    except RecursionError:  # JSON nested deeper than Python recurses: no state repmlp writes
        raise CheckpointError(f"{path} has a malformed training state (nested too deep)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} has a malformed training state ({exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} has a malformed training state (root is not a mapping)")
    return state
