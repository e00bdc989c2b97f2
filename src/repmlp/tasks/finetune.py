"""Starting a run from the weights of a model file (``repmlp train --init FILE``), as timm's
``--initial-checkpoint`` / mmpretrain's ``load_from`` do.

Every weight of the file is loaded into the new model but its head, the one part allowed to differ: a
classifier for another number of classes keeps its fresh initialisation (as timm's ``load_pretrained`` does),
a face run's embedding head always. Any other missing, unexpected or mis-shaped key is one
:class:`~repmlp.errors.UserError` naming the keys. A deployed file is refused: it has nothing left to train.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from repmlp.errors import UserError
from repmlp.io.model_file import CheckpointError, ModelFileMeta, compare_state, read_model_file
from repmlp.models.registry import get_pretrained_cfg

__all__ = ["InitReport", "init_from_file", "init_model_options", "init_preprocessing", "head_prefixes",
           "file_sha256", "read_training_file", "report_lines"]  # fmt: skip

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
        """One line for the log."""
        return (f"initialised from `{self.path}` ({self.model}, sha256 `{self.sha256}`): {self.loaded} tensors "
                f"loaded; re-initialised: {', '.join(self.reinitialised) or 'none'}")  # fmt: skip


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_training_file(path: str | os.PathLike, flag: str = "--init") -> tuple[dict[str, Any], ModelFileMeta]:
    """Tensors and checked metadata of a training-form model file (:func:`~repmlp.io.model_file.read_model_file`);
    anything else, a deployed file too, is a one-line :class:`UserError` naming ``flag``."""
    try:
        tensors, fm = read_model_file(path)
    except CheckpointError as exc:
        raise UserError(f"{flag}: {exc}") from None
    if fm.form == "deploy":
        raise UserError(
            f"{flag} {path} holds the deployed (converted) form of {fm.model}: the converted model has no Local "
            "Perceptron (nor BatchNorm) left to train; use the training-time model.safetensors of its run instead "
            f"({Path(path).with_name('model.safetensors')})"
        )
    return tensors, fm


def init_model_options(path: str | os.PathLike, flag: str = "--init") -> tuple[str, dict[str, Any]]:
    """``(model name, options)`` of a model file but the options the new data decide (:data:`DATA_OPTIONS`):
    what a fine-tuning run builds when no ``--model`` is given."""
    _, fm = read_training_file(path, flag)
    return fm.model, {k: v for k, v in fm.model_kwargs.items() if k not in DATA_OPTIONS}


def init_preprocessing(path: str | os.PathLike, flag: str = "--init") -> dict[str, Any]:
    """What a model file was trained on, for a fine-tuning run's defaults: ``{"model": name, "input_size":
    [C, H, W] or None, "dataset": name or None, "eval_preprocessing": {...} or None, "fixed_size": bool}``
    (``fixed_size``: the model is built for one input size, ``img_size`` among its options)."""
    _, fm = read_training_file(path, flag)
    extra, kwargs = fm.extra, fm.model_kwargs
    size = extra.get("input_size")
    if size is None and isinstance(kwargs.get("img_size"), int):
        size = [int(kwargs.get("in_chans", 3)), kwargs["img_size"], kwargs["img_size"]]
    return {"model": fm.model, "input_size": list(size) if size else None, "dataset": extra.get("dataset"),
            "eval_preprocessing": extra.get("eval_preprocessing"), "fixed_size": "img_size" in kwargs}  # fmt: skip


def head_prefixes(model: nn.Module | str, *, embedding_head: bool = False) -> list[str]:
    """State-dict prefixes of a model's head: its classifier (``get_classifier()``, else its timm config's
    ``classifier``; of a model's name, its config's); with ``embedding_head``, a face model's ``head`` module."""
    if isinstance(model, str):
        names = getattr(get_pretrained_cfg(model), "classifier", None)
        return [n + "." for n in ([names] if isinstance(names, str) else names or []) if n]
    if embedding_head and isinstance(getattr(model, "head", None), nn.Module):
        return ["head."]
    classifier = model.get_classifier() if hasattr(model, "get_classifier") else None
    names = [n for n, m in model.named_modules() if n and m is classifier][:1]
    cfg = (getattr(model, "pretrained_cfg", None) or {}).get("classifier")
    names += [n for n in ([cfg] if isinstance(cfg, str) else cfg or []) if n and n not in names]
    return [n + "." for n in names]


def load_matching(model: nn.Module, tensors: Mapping[str, Tensor], file_model: str, *,
                  head: Sequence[str] | None = None, fresh_head: bool = False,
                  what: str = "checkpoint") -> dict[str, Any]:  # fmt: skip
    """Load ``tensors`` (a model file's, of model ``file_model``) into ``model``: strictly, but its head (the
    state-dict prefixes ``head``, default :func:`head_prefixes`), loaded only when all of it fits and not
    ``fresh_head`` (else the file's head tensors are ignored). A missing, unexpected or mis-shaped key is a
    :class:`CheckpointError`. Returns ``{"loaded": count, "reinitialised": [keys], "ignored": [file keys]}``."""
    own = model.state_dict()
    prefixes = tuple(head if head is not None else head_prefixes(model))
    head_own = [k for k in own if k.startswith(prefixes)]
    fits = all(k in tensors and tensors[k].shape == own[k].shape for k in head_own)
    load_head = bool(head_own) and fits and not fresh_head
    file_head = prefixes + tuple(head_prefixes(file_model))
    ignored = sorted(k for k in tensors if k.startswith(file_head) and not (load_head and k in own))
    body = {k: v for k, v in own.items() if not k.startswith(prefixes)}
    compare_state(f"{what} ({file_model})", "the model", body,
                  {k: v for k, v in tensors.items() if not k.startswith(file_head)})  # fmt: skip
    loadable = {k: tensors[k] for k in [*body, *(head_own if load_head else [])]}
    model.load_state_dict(loadable, strict=False)
    reinit = [] if load_head else [k for k in head_own if not k.endswith("num_batches_tracked")]
    return {"loaded": len(loadable), "reinitialised": reinit, "ignored": ignored}


def init_from_file(
    model: nn.Module, path: str | os.PathLike, *, fresh_head: bool = False, head: Sequence[str] | None = None,
    flag: str = "--init",
) -> InitReport:  # fmt: skip
    """Load the weights of model file ``path`` into ``model`` (see the module docstring): what was loaded and
    re-initialised. ``head``: state-dict prefixes of the new model's head (default :func:`head_prefixes`);
    with ``fresh_head`` the head is never loaded, else only where it fits (the same number of classes)."""
    tensors, fm = read_training_file(path, flag)
    try:
        fit = load_matching(model, tensors, fm.model, head=head, fresh_head=fresh_head, what=f"{flag} {path}")
    except CheckpointError as exc:
        raise UserError(
            f"{exc} (the file holds {fm.model} with {fm.model_kwargs}: leave --model and --model-arg out to "
            "fine-tune that model, or give its options)"
        ) from None
    return InitReport(
        str(path), file_sha256(path), fm.model, fit["loaded"], fit["reinitialised"], fit["ignored"]
    )


def report_lines(init: dict[str, Any] | None) -> list[str]:
    """The ``report.md`` line of a run started with ``--init`` (an :class:`InitReport` dict; none without)."""
    if not init:
        return []
    fresh = ", ".join(f"`{k}`" for k in init.get("reinitialised", [])) or "none"
    return [
        f"- Initialised from (`--init`): `{init['path']}` ({init['model']}, sha256 `{init['sha256']}`), "
        f"{init['loaded']} tensors loaded; re-initialised: {fresh}"
    ]
