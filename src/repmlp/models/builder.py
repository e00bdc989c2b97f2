"""Building a model by name for a run, and the input size a built model takes.

:func:`build_model` is ``create_model`` sized for the data (what training, evaluation and benchmarks call);
:func:`model_input_size` / :func:`default_input_size` (from :mod:`repmlp.models.input_size`) read the
``(C, H, W)`` a model (or a model file's metadata) expects, and :func:`check_forward` turns a size the
model rejects into one line for the user.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from repmlp.errors import UserError, first_line
from repmlp.models.input_size import default_input_size, model_input_size

__all__ = ["build_model", "takes_img_size", "default_input_size", "model_input_size", "check_forward"]


def build_model(
    name: str,
    model_args: dict[str, Any] | None = None,
    *,
    num_classes: int | None = None,
    in_chans: int | None = None,
    img_size: int | None = None,
    expect: Mapping[str, Any] | None = None,
    where: object = "the training state",
) -> tuple[nn.Module, dict[str, Any]]:
    """``create_model(name, **model_args)`` sized for the data; returns ``(model, kwargs used)``.

    ``img_size`` is passed only to models built for one input size (:func:`takes_img_size`); other CNNs
    take any size. An unknown name or an option the model rejects (``ValueError``/``TypeError`` from its
    constructor) is a :class:`UserError`; any other exception is a bug and propagates with its traceback.
    ``expect``: a state dict the model must fit (a resumed run's saved weights, read from ``where``): the
    model is built on the ``meta`` device and compared with it first, so that a state whose options
    describe a huge model is refused before anything is allocated.
    """
    from repmlp.models import create_model

    kwargs = dict(model_args or {})
    kwargs.update({k: v for k, v in (("num_classes", num_classes), ("in_chans", in_chans)) if v is not None})
    if img_size is not None and takes_img_size(name):
        kwargs = {"img_size": img_size, **kwargs}
    if expect is not None:
        _check_expected(name, kwargs, expect, where)
    try:
        return create_model(name, **kwargs), kwargs
    except (TypeError, ValueError) as exc:
        # The message as the model gave it (stripping quotes off it would cut '1,3' to '1).
        first = first_line(exc)
        raise UserError(f"cannot build model {name!r}: {first}") from exc


def _check_expected(name: str, kwargs: dict[str, Any], expect: Mapping[str, Any], where: object) -> None:
    """The model ``create_model(name, **kwargs)`` would build, on the ``meta`` device, must hold the keys
    and shapes of ``expect`` (a state dict of tensors)."""
    from repmlp.models import create_model
    from repmlp.models.file_format import CheckpointError
    from repmlp.models.file_metadata import build_error, compare_state, meta_model

    if not all(isinstance(v, torch.Tensor) for v in expect.values()):
        raise CheckpointError(f"{where}: its model weights are not all tensors")
    held = sum(v.numel() for v in expect.values())
    try:
        ghost = meta_model(
            lambda: create_model(name, **kwargs), 4 * held + (1 << 20), 4 * len(expect) + 10_000
        )
    except Exception as exc:  # noqa: BLE001 - the options come from the state file
        raise build_error(where, name, kwargs, held, exc, "config.model_args") from None
    compare_state(where, f"this run ({name} with {kwargs})", ghost.state_dict(), expect)


def takes_img_size(name: str) -> bool:
    """Whether model ``name`` is built for one input size: every repmlp model (FC3 and the partitions
    depend on it), and timm models whose config says ``fixed_input_size`` (vision transformers...)."""
    from repmlp.models import is_model

    source, _, bare = name.rpartition(":")
    if source in ("", "repmlp") and is_model(bare):
        return True
    if source in ("", "timm"):
        import timm

        if timm.is_model(bare):
            cfg = timm.models.get_pretrained_cfg(bare)
            return bool(cfg is not None and getattr(cfg, "fixed_input_size", False))
    return False


def check_forward(model: nn.Module, input_size: Sequence[int], what: str) -> None:
    """Run one example through ``model`` (in full float32); a shape the model rejects is a :class:`UserError`."""
    from repmlp.nn.numerics import full_float32

    try:
        with torch.inference_mode(), full_float32():
            model(torch.zeros(1, *input_size))
    except (RuntimeError, ValueError) as exc:
        if type(exc).__name__ == "OutOfMemoryError":  # the device's limit, not the input's shape
            raise
        size = "x".join(str(s) for s in input_size)
        first = first_line(exc)
        raise UserError(f"{what} does not take {size} inputs ({first}); pass the right --img-size") from None
