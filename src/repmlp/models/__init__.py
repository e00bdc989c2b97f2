"""repmlp's model zoo: the paper's models by name (:func:`create_model`), registered with timm.

- :mod:`.registry`: which models are repmlp's (timm's registry, and the few outside its classifier contract);
  :mod:`.layers`: what the families share, their build (timm's ``build_model_with_cfg``) among it;
- one module a family, each registering its models as timm's families do: :mod:`.resnet` (RepMLP-Res50, its
  blocks and the baselines), :mod:`.pure_mlp` (the pure MLP and its ablations on CIFAR-10 and Fashion-MNIST),
  :mod:`.sequence` (1-D), :mod:`.face`, :mod:`.pspnet`, :mod:`.repmlpnet`.

Model files (``save_model`` / ``load_model``) live in :mod:`repmlp.io`, above the models. May import
:mod:`repmlp.data`, :mod:`repmlp.nn` and :mod:`repmlp.errors`; nothing above.
"""

import numbers
from functools import partial
from typing import Any

import timm
import torchvision
from torch import nn

from repmlp.models import face, pspnet, pure_mlp, repmlpnet, resnet, sequence
from repmlp.models.layers import ConvBNReLU
from repmlp.models.registry import OUTSIDE_TIMM, is_model, list_models, resolve_model
from repmlp.models.resnet import (
    Bottleneck,
    NonLocalBlock,
    RepMLPBottleneck,
    RepMLPLightBlock,
    ResNet,
    gc_block,
)
from repmlp.nn.convert import reparameterize_model

__all__ = ["create_model", "list_models", "is_model", "Bottleneck", "ConvBNReLU", "RepMLPBottleneck",
           "RepMLPLightBlock", "NonLocalBlock", "gc_block", "ResNet", "pure_mlp", "resnet", "face",
           "pspnet", "repmlpnet", "sequence"]  # fmt: skip


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
