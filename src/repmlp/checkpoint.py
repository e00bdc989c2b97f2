"""Checkpoints in safetensors, written atomically and loaded without unpickling anything.

Two kinds of files:

- **model files** (:func:`save_model` / :func:`load_model`): a model's ``state_dict`` plus string metadata
  ``{"format": "repmlp", "model": name, "model_kwargs": JSON, "form": "train"|"deploy", ...}`` that is
  enough to rebuild the model with :func:`repmlp.create_model` and load it strictly.
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

import json
import os
import struct
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save as st_save
from torch import Tensor, nn

from .errors import UserError

__all__ = [
    "CheckpointError",
    "atomic_write_bytes",
    "atomic_write_text",
    "save_model",
    "load_model",
    "read_metadata",
    "save_state",
    "load_state",
    "load_matching",
    "head_prefixes",
]

FORMAT = "repmlp"
STATE_FORMAT = "repmlp-state"
Form = Literal["train", "deploy"]
_FORMS = ("train", "deploy")
# safetensors' own header limit; a larger claimed header means the file is not safetensors.
_MAX_HEADER = 100_000_000


class CheckpointError(UserError, ValueError):
    """A checkpoint file that cannot be used (missing, malformed, truncated, wrong model or form)."""


# ----------------------------------------------------------------------------------------- writing
def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same folder, fsync, ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates the file 0600; give it the permissions a plain open() would (0666 & ~umask).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    # Make the rename itself durable (POSIX); harmless where directories cannot be opened.
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


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

    ``precision`` (``repmlp.deploy.PRECISIONS``) is recorded for reduced-precision deployed models
    (``bf16``/``fp16`` weights, or an int8 ONNX graph); float32 files carry no such key.

    ``model_kwargs`` (JSON-serialisable) are passed back to ``create_model(name, deploy=..., **kwargs)``;
    ``extra`` (JSON-serialisable) is stored under the ``"extra"`` metadata key.
    """
    if form not in _FORMS:
        raise ValueError(f"form must be one of {_FORMS}, got {form!r}")
    from . import __version__

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
def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """Parse and validate a safetensors header; return it and the expected file size."""
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint is not a file: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path} is not a safetensors file or is truncated (bad header length)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a safetensors file (unreadable header: {exc})") from None
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            end = max(end, int(entry["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise CheckpointError(f"{path} has a malformed safetensors header (tensor {key!r})") from None
    expected = 8 + n + end
    if size < expected:
        raise CheckpointError(f"{path} is truncated ({size} bytes, header needs {expected})")
    return header, expected


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The string metadata of a safetensors file (validated header, body not read)."""
    header, _ = _read_header(Path(path))
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} has malformed metadata")
    return {str(k): str(v) for k, v in meta.items()}


def _read_tensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    header, _ = _read_header(path)
    try:
        # Memory-mapped: a large checkpoint is not read whole into memory first.
        tensors = st_load_file(path)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(
            f"{path} is corrupted: {str(exc).splitlines()[0] if str(exc) else exc}"
        ) from None
    meta = header.get("__metadata__") or {}
    return tensors, {str(k): str(v) for k, v in meta.items()}


def load_model(
    path: str | os.PathLike, *, device: str | torch.device = "cpu", form: Form | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the model saved by :func:`save_model` and load its weights strictly.

    Returns ``(model, info)`` with ``info = {"model", "model_kwargs", "form", "extra", "path"}``; the model
    is on ``device`` in eval mode. ``form`` (if given) must match the file's form.
    """
    path = Path(path)
    tensors, meta = _read_tensors(path)
    if meta.get("format") != FORMAT:
        what = "a training state" if meta.get("format") == STATE_FORMAT else "not a repmlp model checkpoint"
        raise CheckpointError(f"{path} is {what} (metadata format={meta.get('format')!r})")
    name, file_form = meta.get("model"), meta.get("form")
    if not name or file_form not in _FORMS:
        raise CheckpointError(f"{path} has incomplete metadata (model={name!r}, form={file_form!r})")
    if form is not None and form != file_form:
        raise CheckpointError(f"{path} holds the {file_form!r} form of {name}, expected the {form!r} form")
    try:
        model_kwargs = json.loads(meta.get("model_kwargs", "{}"))
        extra = json.loads(meta["extra"]) if "extra" in meta else {}
    except ValueError:
        raise CheckpointError(f"{path} has malformed JSON metadata") from None
    model = _build_for(path, name, model_kwargs, file_form, meta.get("precision", "fp32"), tensors)
    _load_strict(model, tensors, path, name, file_form)
    model.to(device).eval()
    info = {"model": name, "model_kwargs": model_kwargs, "form": file_form, "extra": extra, "path": str(path)}
    info["precision"] = meta.get("precision", "fp32")
    return model, info


def _build_for(
    path: Path, name: str, model_kwargs: dict[str, Any], form: str, precision: str, tensors: dict[str, Tensor]
) -> nn.Module:
    """The empty model a file's weights load into: ``create_model`` in the file's form and precision."""
    from . import create_model
    from .deploy import PRECISIONS, Int8OnnxModel, to_precision

    if precision not in PRECISIONS or (precision != "fp32" and form != "deploy"):
        raise CheckpointError(f"{path} has unsupported precision {precision!r} for the {form!r} form")
    if precision == "int8":
        if "onnx" not in tensors:
            raise CheckpointError(f"{path} is marked int8 but holds no ONNX graph")
        return Int8OnnxModel(tensors["onnx"])
    try:
        model = create_model(name, deploy=form == "deploy", **model_kwargs)
    except Exception as exc:  # noqa: BLE001 - unknown name, bad kwargs: the file does not fit this install
        raise CheckpointError(f"{path}: cannot build model {name!r} ({exc})") from None
    return model if precision == "fp32" else to_precision(model, precision)


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


def _module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    return next((name for name, m in model.named_modules() if m is module and name), None)


def head_prefixes(model: nn.Module, *, embedding_head: bool = False) -> list[str]:
    """State-dict prefixes of ``model``'s head: its classifier (``get_classifier()``, else the timm cfg's
    ``classifier``); with ``embedding_head``, a face model's whole ``head`` module (BN-FC-BN)."""
    if embedding_head and isinstance(getattr(model, "head", None), nn.Module):
        return ["head."]
    names: list[str] = []
    if hasattr(model, "get_classifier"):
        name = _module_name(model, model.get_classifier())
        if name:
            names.append(name)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    for name in (
        [cfg.get("classifier")] if isinstance(cfg.get("classifier"), str) else cfg.get("classifier") or []
    ):
        if name and name not in names:
            names.append(name)
    return [n + "." for n in names]


def _listed(keys: Sequence[str], n: int = 6) -> str:
    return ", ".join(keys[:n]) + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")


def load_matching(
    model: nn.Module,
    tensors: Mapping[str, Tensor],
    meta: Mapping[str, str],
    *,
    head: Sequence[str] | None = None,
    file_head: Sequence[str] = (),
    fresh_head: bool = False,
    what: str = "checkpoint",
) -> dict[str, Any]:
    """Load ``tensors`` (a model file's, ``meta`` its metadata) into ``model``: strictly, except its head.

    ``head``: state-dict prefixes of the model's head (default :func:`head_prefixes`). The head is loaded
    only when every one of its tensors fits and not ``fresh_head``; otherwise it keeps the model's own
    initialisation (timm's ``load_pretrained`` drops a classifier of another size the same way), and the
    file's head tensors (also those under ``file_head``, its own model's head prefixes) are ignored. Any other missing,
    unexpected or mis-shaped key raises :class:`CheckpointError` naming them. Returns ``{"loaded": count,
    "reinitialised": [model keys], "ignored": [file keys]}``.
    """
    own = model.state_dict()
    prefixes = tuple(head if head is not None else head_prefixes(model))
    file_prefixes = prefixes + tuple(file_head)
    head_own = [k for k in own if k.startswith(prefixes)]
    head_fits = all(k in tensors and tuple(tensors[k].shape) == tuple(own[k].shape) for k in head_own)
    load_head = bool(head_own) and head_fits and not fresh_head
    reinit = [] if load_head else [k for k in head_own if not k.endswith("num_batches_tracked")]
    ignored = sorted(k for k in tensors if k.startswith(file_prefixes) and not (load_head and k in own))
    body_own = [k for k in own if not k.startswith(prefixes)]
    missing = [k for k in body_own if k not in tensors]
    unexpected = [k for k in tensors if k not in own and k not in ignored]
    shapes = [
        f"{k} {tuple(tensors[k].shape)} vs {tuple(own[k].shape)}"
        for k in body_own
        if k in tensors and tuple(tensors[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or shapes:
        parts = [
            f"{len(keys)} {label}: {_listed(keys)}"
            for label, keys in (
                ("missing from the file", missing),
                ("not in the model", unexpected),
                ("with other shapes (file vs model)", shapes),
            )
            if keys
        ]
        raise CheckpointError(f"{what} ({meta.get('model')}) does not fit the model: " + "; ".join(parts))
    loadable = {k: tensors[k] for k in body_own} | ({k: tensors[k] for k in head_own} if load_head else {})
    model.load_state_dict(loadable, strict=False)
    return {"loaded": len(loadable), "reinitialised": reinit, "ignored": ignored}


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
    tensors, meta = _read_tensors(path)
    if meta.get("format") != STATE_FORMAT or "state" not in meta:
        raise CheckpointError(
            f"{path} is not a repmlp training state (metadata format={meta.get('format')!r})"
        )
    try:
        tree = json.loads(meta["state"])
        state = _decode(tree, tensors)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} has a malformed training state ({exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} has a malformed training state (root is not a mapping)")
    return state
