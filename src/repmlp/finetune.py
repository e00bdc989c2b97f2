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

from .errors import UserError
from .files import FORMAT, STATE_FORMAT, CheckpointError, head_prefixes, load_matching, read_tensors

__all__ = [
    "InitReport",
    "init_from_file",
    "init_model_options",
    "head_prefixes",
    "file_sha256",
    "report_lines",
]

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
        tensors, meta = read_tensors(Path(path))
    except CheckpointError as exc:
        raise UserError(f"{flag}: {exc}") from None
    if meta.get("format") != FORMAT:
        hint = (
            " (a training state: use model.safetensors of the run)"
            if meta.get("format") == STATE_FORMAT
            else ""
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
    from .models.registry import file_head_prefixes

    fit = load_matching(model, tensors, meta, head=head, file_head=file_head_prefixes(str(meta.get("model"))),
                        fresh_head=fresh_head, what=f"{flag} {path}")  # fmt: skip
    return InitReport(
        path=str(path),
        sha256=file_sha256(path),
        model=str(meta.get("model")),
        loaded=fit["loaded"],
        reinitialised=fit["reinitialised"],
        ignored=fit["ignored"],
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
