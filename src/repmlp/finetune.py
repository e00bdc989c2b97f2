"""Starting a run from the weights of a model file (``repmlp train --init FILE``), as timm's
``--initial-checkpoint`` / mmpretrain's ``load_from`` do.

Every weight of the file whose name and shape fit the new model is loaded. The head (the classifier, or
a face model's embedding head) is the one part allowed to differ: a classifier with another number of
classes keeps the new model's fresh initialisation (timm's ``load_pretrained`` drops it the same way);
a face run always starts its embedding head fresh. Any other missing, unexpected or mis-shaped key is a
one-line :class:`~repmlp.errors.UserError` naming the keys. A deployed (converted) file is refused: the
converted model has no Local Perceptron (nor BatchNorm) left to train.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from .checkpoint import FORMAT, STATE_FORMAT, CheckpointError, _read_tensors
from .errors import UserError

__all__ = ["InitReport", "init_from_file", "init_model_options", "head_prefixes", "file_sha256"]

# Options the new run's data decide, not the file: the classes, the channels and the input size.
DATA_OPTIONS = ("num_classes", "in_chans", "img_size")


@dataclass
class InitReport:
    """What :func:`init_from_file` did (JSON-serialisable via :meth:`to_dict`, kept in the run's state)."""

    path: str
    sha256: str
    model: str
    loaded: int
    reinitialised: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for logs and reports."""
        fresh = ", ".join(self.reinitialised) if self.reinitialised else "none"
        return (
            f"initialised from `{self.path}` ({self.model}, sha256 `{self.sha256}`): {self.loaded} tensors "
            f"loaded; re-initialised: {fresh}"
        )


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_model_file(path: str | os.PathLike, flag: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Tensors and metadata of a training-time repmlp model file; one-line errors for anything else."""
    try:
        tensors, meta = _read_tensors(Path(path))
    except CheckpointError as exc:
        raise UserError(f"{flag}: {exc}") from None
    if meta.get("format") != FORMAT:
        hint = (
            " (a training state: use model.safetensors of the run)" if meta.get("format") == STATE_FORMAT else ""
        )
        raise UserError(f"{flag} {path} is not a repmlp model file{hint}")
    if meta.get("form") == "deploy":
        run_file = Path(path).with_name("model.safetensors")
        raise UserError(
            f"{flag} {path} holds the deployed (converted) form of {meta.get('model')}: the converted model "
            f"has no Local Perceptron (nor BatchNorm) left to train; use the training-time model.safetensors "
            f"of its run instead ({run_file})"
        )
    return tensors, meta


def init_model_options(path: str | os.PathLike, flag: str = "--init") -> tuple[str, dict[str, Any]]:
    """``(model name, options)`` of a model file, without the options the new data decide
    (:data:`DATA_OPTIONS`): what a fine-tuning run builds when no ``--model`` is given."""
    import json

    _, meta = _read_model_file(path, flag)
    try:
        kwargs = json.loads(meta.get("model_kwargs", "{}"))
    except ValueError:
        raise UserError(f"{flag} {path} has malformed metadata") from None
    return str(meta.get("model")), {k: v for k, v in kwargs.items() if k not in DATA_OPTIONS}


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
    for name in [cfg.get("classifier")] if isinstance(cfg.get("classifier"), str) else cfg.get("classifier") or []:
        if name and name not in names:
            names.append(name)
    return [n + "." for n in names]


def _file_head(meta: dict[str, str]) -> list[str]:
    """The head prefixes of the file's own model (its registered cfg), to drop a differing classifier."""
    from .models import is_model, model_default_cfg

    name = meta.get("model", "")
    if not is_model(name):
        return []
    cls = model_default_cfg(name).get("classifier")
    return [c + "." for c in ([cls] if isinstance(cls, str) else cls or []) if c]


def _listed(keys: Sequence[str], n: int = 6) -> str:
    return ", ".join(keys[:n]) + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")


def init_from_file(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    fresh_head: bool = False,
    head: Sequence[str] | None = None,
    flag: str = "--init",
) -> InitReport:
    """Load the weights of model file ``path`` into ``model`` (see the module docstring).

    ``head``: state-dict prefixes of the new model's head (default :func:`head_prefixes`); with
    ``fresh_head`` the head is never loaded, else only where it differs (another number of classes).
    Returns what was loaded and re-initialised; raises :class:`UserError` when the rest does not fit.
    """
    tensors, meta = _read_model_file(path, flag)
    own = model.state_dict()
    prefixes = tuple(head if head is not None else head_prefixes(model))
    file_prefixes = prefixes + tuple(_file_head(meta))

    def in_head(key: str, where: tuple[str, ...]) -> bool:
        return key.startswith(where)

    head_own = [k for k in own if in_head(k, prefixes)]
    head_fits = all(k in tensors and tuple(tensors[k].shape) == tuple(own[k].shape) for k in head_own)
    load_head = bool(head_own) and head_fits and not fresh_head
    reinit = [] if load_head else [k for k in head_own if not k.endswith("num_batches_tracked")]
    ignored = sorted(k for k in tensors if in_head(k, file_prefixes) and not (load_head and k in own))
    body_own = [k for k in own if not in_head(k, prefixes)]
    missing = [k for k in body_own if k not in tensors]
    unexpected = [k for k in tensors if k not in own and k not in ignored]
    shapes = [
        f"{k} {tuple(tensors[k].shape)} vs {tuple(own[k].shape)}"
        for k in body_own
        if k in tensors and tuple(tensors[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or shapes:
        parts = [
            f"{len(keys)} {what}: {_listed(keys)}"
            for what, keys in (
                ("missing from the file", missing),
                ("not in the model", unexpected),
                ("with other shapes (file vs model)", shapes),
            )
            if keys
        ]
        raise UserError(f"{flag} {path} ({meta.get('model')}) does not fit the model: " + "; ".join(parts))
    loadable = {k: tensors[k] for k in body_own} | ({k: tensors[k] for k in head_own} if load_head else {})
    model.load_state_dict(loadable, strict=False)
    return InitReport(
        path=str(path),
        sha256=file_sha256(path),
        model=str(meta.get("model")),
        loaded=len(loadable),
        reinitialised=reinit,
        ignored=ignored,
    )
