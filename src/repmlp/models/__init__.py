"""repmlp's model zoo: the paper's models by name (``repmlp.create_model``), registered with timm.

- :mod:`.registry`: ``register_model`` (timm's registry), ``create_model`` and ``build_model`` (a model sized
  for a run); :mod:`.layers`: what the families share;
- one module a family: :mod:`.resnet` (RepMLP-Res50, its blocks and the baselines), :mod:`.pure_mlp` (the
  pure MLP and its ablations on CIFAR-10 and Fashion-MNIST), :mod:`.sequence` (1-D), :mod:`.face`,
  :mod:`.pspnet`, :mod:`.repmlpnet`.

Model files (``save_model`` / ``load_model``) live in :mod:`repmlp.io`, above the models. May import
:mod:`repmlp.data`, :mod:`repmlp.nn` and :mod:`repmlp.errors`; nothing above.
"""

from repmlp.models import face, pspnet, pure_mlp, repmlpnet, resnet, sequence
from repmlp.models.layers import ConvBNReLU
from repmlp.models.registry import create_model, is_model, list_models, register_model
from repmlp.models.resnet import (
    Bottleneck,
    GlobalContextBlock,
    NonLocalBlock,
    RepMLPBottleneck,
    RepMLPLightBlock,
    ResNet,
)

__all__ = ["create_model", "list_models", "register_model", "is_model", "Bottleneck", "ConvBNReLU",
           "RepMLPBottleneck", "RepMLPLightBlock", "NonLocalBlock", "GlobalContextBlock", "ResNet", "pure_mlp",
           "resnet", "face", "pspnet", "repmlpnet", "sequence"]  # fmt: skip
