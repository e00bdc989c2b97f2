"""repmlp's model zoo: the paper's models by name (``repmlp.create_model``), registered with timm.

- :mod:`.registry`: ``register_model`` (timm's registry), ``create_model`` and ``build_model`` (a model sized
  for a run);
- one module a family: :mod:`.resnet` and :mod:`.blocks` (RepMLP-Res50 and its blocks), :mod:`.cifar`
  (the pure MLP and its ablations), :mod:`.sequence` (1-D), :mod:`.face`, :mod:`.pspnet`,
  :mod:`.repmlpnet`, :mod:`.head`.

Model files (``save_model`` / ``load_model``) live in :mod:`repmlp.io`, above the models. May import
:mod:`repmlp.data`, :mod:`repmlp.nn` and :mod:`repmlp.errors`; nothing above.
"""

from repmlp.models import cifar, face, pspnet, repmlpnet, resnet, sequence
from repmlp.models.blocks import (
    Bottleneck,
    ConvBNReLU,
    GlobalContextBlock,
    NonLocalBlock,
    RepMLPBottleneck,
    RepMLPLightBlock,
    ResNet,
)
from repmlp.models.registry import create_model, is_model, list_models, register_model

__all__ = [
    "create_model",
    "list_models",
    "register_model",
    "is_model",
    "Bottleneck",
    "ConvBNReLU",
    "RepMLPBottleneck",
    "RepMLPLightBlock",
    "NonLocalBlock",
    "GlobalContextBlock",
    "ResNet",
    "cifar",
    "resnet",
    "face",
    "pspnet",
    "repmlpnet",
    "sequence",
]
