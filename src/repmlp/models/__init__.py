"""repmlp's model zoo: the paper's models by name (:func:`create_model`; :func:`build_model` sized for a run,
:func:`check_forward` of an input size), registered with timm.

- :mod:`.registry`: which models are repmlp's (timm's registry, and the few outside its classifier contract);
  :mod:`.layers`: what the families share, their build (timm's ``build_model_with_cfg``) among it;
- one module a family, each registering its models as timm's families do: :mod:`.resnet` (RepMLP-Res50, its
  blocks and the baselines), :mod:`.pure_mlp` (the pure MLP and its ablations on CIFAR-10 and Fashion-MNIST),
  :mod:`.sequence` (1-D), :mod:`.face`, :mod:`.pspnet`, :mod:`.repmlpnet`.

Model files (``save_model`` / ``load_model``) live in :mod:`repmlp.io`, above the models. May import
:mod:`repmlp.data`, :mod:`repmlp.nn` and :mod:`repmlp.errors`; nothing above.
"""

import numbers
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import timm
import torch
import torchvision
from torch import nn

from repmlp.errors import UserError, first_line
from repmlp.models import face, pspnet, pure_mlp, repmlpnet, resnet, sequence
from repmlp.models.layers import ConvBNReLU
from repmlp.models.registry import OUTSIDE_TIMM, get_pretrained_cfg, is_model, list_models, resolve_model
from repmlp.models.resnet import (
    Bottleneck,
    NonLocalBlock,
    RepMLPBottleneck,
    RepMLPLightBlock,
    ResNet,
    gc_block,
)
from repmlp.nn.convert import reparameterize_model
from repmlp.numerics import full_float32

__all__ = ["create_model", "build_model", "takes_img_size", "check_forward", "list_models", "is_model",
           "Bottleneck", "ConvBNReLU", "RepMLPBottleneck", "RepMLPLightBlock", "NonLocalBlock", "gc_block",
           "ResNet", "pure_mlp", "resnet", "face", "pspnet", "repmlpnet", "sequence"]  # fmt: skip


def create_model(name: str, *, num_classes: int | None = None, in_chans: int | None = None,
                 deploy: bool = False, pretrained: bool = False, **kwargs: Any) -> nn.Module:  # fmt: skip
    """A model by name: repmlp's, then timm's, then torchvision's (``resolve_model``); ``num_classes`` /
    ``in_chans`` left ``None`` keep its defaults (``num_classes=0``: no classifier). ``deploy=True``: the
    inference form (repmlp's models build the converted structure, which takes
    ``reparameterize_model(model)``'s state dict; timm's and torchvision's are converted). ``pretrained``:
    repmlp's models only, from a model file (timm's ``pretrained_cfg_overlay=dict(file=PATH)``). A
    ``ValueError`` for an unknown name or an option the model does not take."""
    source, bare = resolve_model(name)
    for key, value, lowest in (("in_chans", in_chans, 1), ("num_classes", num_classes, 0)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lowest
        ):
            floor = "a positive integer" if lowest else "an integer >= 0 (0: no classifier)"
            raise ValueError(f"{key} must be {floor}, got {value!r}")
        kwargs.update({key: value} if value is not None else {})
    if source == "repmlp":  # pretrained: from a model file only (repmlp.io)
        create = OUTSIDE_TIMM[bare] if bare in OUTSIDE_TIMM else partial(timm.create_model, bare)
        return create(pretrained=pretrained, deploy=deploy, **kwargs)
    if pretrained:  # this package never downloads weights
        raise ValueError(f"no pretrained weights are distributed for {bare!r}: repmlp downloads none; load a "
                         "model file with repmlp.load_model")  # fmt: skip
    if source == "timm":
        model = timm.create_model(bare, **kwargs)
    elif kwargs.pop("in_chans", 3) != 3:
        raise ValueError(f"torchvision model {bare!r} supports only in_chans=3")
    else:
        model = torchvision.models.get_model(bare, weights=None, **kwargs)
    return reparameterize_model(model.eval(), inplace=True) if deploy else model


def takes_img_size(name: str) -> bool:
    """Whether model ``name`` is built for one input size: every repmlp model (FC3 and the partitions depend
    on it), and timm models whose config says ``fixed_input_size`` (vision transformers...)."""
    try:
        source, bare = resolve_model(name)
    except ValueError:
        return False
    return source == "repmlp" or (
        source == "timm" and bool(getattr(get_pretrained_cfg(bare), "fixed_input_size", False))
    )


def build_model(name: str, model_args: Mapping[str, Any] | None = None, *, num_classes: int | None = None,
                in_chans: int | None = None, img_size: int | None = None,
                check: Callable[[dict[str, Any]], None] | None = None) -> tuple[nn.Module, dict[str, Any]]:  # fmt: skip
    """``(create_model(name, **kwargs), kwargs)`` for a run: ``model_args`` with the data's sizes (``img_size``
    only for a model built for one: :func:`takes_img_size`), seen by ``check`` before the build (the options a
    model file records). An unknown name or an option the model rejects is a :class:`UserError`; any other
    exception is a bug and keeps its traceback."""
    kwargs = dict(model_args or {})
    kwargs.update({k: v for k, v in (("num_classes", num_classes), ("in_chans", in_chans)) if v is not None})
    if img_size is not None and takes_img_size(name):
        kwargs = {"img_size": img_size, **kwargs}
    if check is not None:
        check(kwargs)
    try:
        return create_model(name, **kwargs), kwargs
    except (TypeError, ValueError) as exc:
        raise UserError(f"cannot build model {name!r}: {first_line(exc)}") from exc


def check_forward(model: nn.Module, input_size: Sequence[int], what: str) -> None:
    """Run one zero example through ``model`` (in full float32); a shape it rejects is a :class:`UserError`."""
    try:
        with torch.inference_mode(), full_float32():
            model(torch.zeros(1, *input_size))
    except (RuntimeError, ValueError) as exc:
        if type(exc).__name__ == "OutOfMemoryError":  # the device's limit, not the input's shape
            raise
        size = "x".join(str(s) for s in input_size)
        raise UserError(
            f"{what} does not take {size} inputs ({first_line(exc)}); pass the right --img-size"
        ) from None
