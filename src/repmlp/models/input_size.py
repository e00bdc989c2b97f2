"""The ``(C, H, W)`` input a model takes: from its timm config, or from what its model file records.

A module of its own, importing nothing of the package: :mod:`repmlp.models.model_file` needs it to describe a
loaded model (:class:`~repmlp.models.model_file.ModelMetadata`), and :mod:`repmlp.models.builder`, which
re-exports it, imports the package's registry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

__all__ = ["default_input_size", "model_input_size"]


def default_input_size(model: nn.Module, fallback: Sequence[int] = (3, 224, 224)) -> tuple[int, ...]:
    """``(C, H, W)`` the model expects: its timm ``pretrained_cfg`` input size, else ``fallback``.

    repmlp's registry updates that config to the ``img_size``/``in_chans`` a model was built with.
    """
    for attr in ("pretrained_cfg", "default_cfg"):
        cfg = getattr(model, attr, None)
        if isinstance(cfg, Mapping) and cfg.get("input_size"):
            return tuple(int(s) for s in cfg["input_size"])
    return tuple(int(s) for s in fallback)


def model_input_size(
    model: nn.Module, extra: Mapping[str, Any] | None = None, model_kwargs: Mapping[str, Any] | None = None
) -> tuple[int, int, int]:
    """``(C, H, W)`` of the model in a file, from the file's ``extra`` record and ``model_kwargs``.

    Looks at, in order: ``extra["input_size"]``, ``model_kwargs`` (``in_chans``, ``img_size``), the
    model's timm config, and finally ``(3, 224, 224)``. (A loaded model has it as
    ``model.metadata.input_size``; ``metadata.input_size_at(img_size)`` applies an ``--img-size``.)
    """
    extra = extra or {}
    kwargs = model_kwargs or {}
    recorded = extra.get("input_size")
    if isinstance(recorded, Sequence) and len(recorded) == 3:
        return tuple(int(s) for s in recorded)  # type: ignore[return-value]
    c, h, w = default_input_size(model)
    c = int(kwargs.get("in_chans", c))
    size = kwargs.get("img_size")
    if isinstance(size, int):
        h = w = size
    elif isinstance(size, Sequence) and len(size) == 2:
        h, w = (int(s) for s in size)
    return c, h, w
