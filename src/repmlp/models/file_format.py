"""The file format of repmlp's model and state files: safetensors with string metadata.

Reading primitives that know nothing of the models (:mod:`repmlp.models.model_file` builds models from files,
and the models' own loaders read files with these): a validated header (:func:`read_metadata`), the
tensors (:func:`read_tensors`), and :func:`load_matching`, which loads a file's tensors into a model
strictly except for its head. Every problem raises :class:`CheckpointError` with a one-line message.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import load_file as st_load_file
from torch import Tensor, nn

from repmlp.errors import UserError, first_line

__all__ = [
    "FORMAT",
    "STATE_FORMAT",
    "CheckpointError",
    "read_metadata",
    "read_tensors",
    "head_prefixes",
    "load_matching",
    "file_kind",
]

FORMAT = "repmlp"
STATE_FORMAT = "repmlp-state"
# safetensors' own header limit; a larger claimed header means the file is not safetensors.
_MAX_HEADER = 100_000_000


class CheckpointError(UserError, ValueError):
    """A checkpoint file that cannot be used (missing, malformed, truncated, wrong model or form)."""


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """Parse and validate a safetensors header; return it and the expected file size."""
    from repmlp.data.inputs import not_regular

    kind = not_regular(path)
    if kind == "missing":
        raise CheckpointError(f"checkpoint not found: {path}")
    if kind is not None:
        raise CheckpointError(f"checkpoint {path} is {kind}, not a regular file")
    size = path.stat().st_size
    # Non-blocking: the path was a regular file a moment ago, but a reader must never wait on a FIFO.
    with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path} is not a safetensors file or is truncated (bad header length)")
        raw = f.read(n)
    try:
        # JSON's NaN/Infinity are no safetensors header values (an offset of Infinity would fail int()).
        header = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} is not a safetensors file (unreadable header: {exc})") from None
    meta = header.get("__metadata__")
    if meta is not None and not isinstance(meta, dict):
        raise CheckpointError(f"{path} has malformed metadata (not an object of texts)")
    for key, value in (meta or {}).items():
        if not isinstance(value, str):
            raise CheckpointError(f"{path}: metadata field {key!r} is a {type(value).__name__}, not a text")
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not _offsets_ok(offsets):
            raise CheckpointError(
                f"{path} has a malformed safetensors header (tensor {key!r}: data_offsets must be two "
                f"integers 0 <= begin <= end, got {str(offsets)[:60]})"
            )
        end = max(end, offsets[1])
    expected = 8 + n + end
    if size < expected:
        raise CheckpointError(f"{path} is truncated ({size} bytes, header needs {expected})")
    return header, expected


def _no_constant(name: str) -> None:
    """``json.loads``' ``parse_constant``: ``NaN``, ``Infinity`` and ``-Infinity`` are refused."""
    raise ValueError(f"{name} is not a JSON value")


def _offsets_ok(offsets: object) -> bool:
    """Whether a header entry's ``data_offsets`` are ``[begin, end]``, integers with ``0 <= begin <= end``
    (floats, booleans and texts are not: the body's size is computed from them before anything is read)."""
    return (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(v) is int for v in offsets)
        and 0 <= offsets[0] <= offsets[1]
    )


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The string metadata of a safetensors file (validated header, body not read)."""
    header, _ = _read_header(Path(path))
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} has malformed metadata")
    return {str(k): str(v) for k, v in meta.items()}


def read_tensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors (memory-mapped) and string metadata of a safetensors file, its header validated."""
    header, _ = _read_header(path)
    try:
        # Memory-mapped: a large checkpoint is not read whole into memory first.
        tensors = st_load_file(path)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{path} is corrupted: {first_line(exc)}") from None
    meta = header.get("__metadata__") or {}
    return tensors, {str(k): str(v) for k, v in meta.items()}


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


def listed(keys: Sequence[str], n: int = 6) -> str:
    """The first ``n`` of ``keys`` and how many more, for one-line messages."""
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
            f"{len(keys)} {label}: {listed(keys)}"
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


# ---------------------------------------------------------------------------------- file kinds
_ZIP = b"PK\x03\x04"


def _safetensors_kind(path: Path) -> str | None:
    """``"a training-time model file"``, ``"a deployed model file"``, ``"a training state"``, or another
    safetensors file; ``None`` when ``path`` is not safetensors."""
    try:
        header, _ = _read_header(path)
    except CheckpointError:
        return None
    meta = header.get("__metadata__")
    meta = meta if isinstance(meta, dict) else {}
    if meta.get("format") == STATE_FORMAT:
        return "a training state"
    if meta.get("format") == FORMAT:
        return "a deployed model file" if meta.get("form") == "deploy" else "a training-time model file"
    return "a safetensors file"


def file_kind(path: str | os.PathLike) -> str | None:
    """What an existing file is, from its first bytes (what :mod:`repmlp.models.importer` tells apart):
    ``"a training state"``, ``"a training-time model file"``, ``"a deployed model file"``, ``"a safetensors
    file"``, ``"an empty file"``, ``"a zip archive (TorchScript, .pt2 or a PyTorch checkpoint)"``, ``"a text
    file"`` or ``"a binary file"``; ``"a folder"``, ``"a FIFO (named pipe)"``, ... for what is not a regular
    file; ``None`` when nothing is there."""
    from repmlp.data.inputs import not_regular

    path = Path(path)
    kind = not_regular(path)
    if kind == "missing":
        return None
    if kind is not None:
        return kind
    found = _safetensors_kind(path)
    if found is not None:
        return found
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
            head = f.read(4096)
    except OSError:
        return "an unreadable file"
    if not head:
        return "an empty file"
    if head.startswith(_ZIP):
        return "a zip archive (TorchScript, .pt2 or a PyTorch checkpoint)"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        # A cut in the middle of a multi-byte character at the end of the 4096 bytes still reads as text.
        try:
            text = head[:-3].decode("utf-8")
        except UnicodeDecodeError:
            return "a binary file"
    return "a text file" if "\x00" not in text else "a binary file"
