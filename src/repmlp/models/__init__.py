"""repmlp's model zoo: the paper's models by name (``repmlp.create_model``), also registered with timm.

- :mod:`.registry` (names, timm registration, ``create_model``) and :mod:`.builder` (a model sized for a
  run) and :mod:`.input_size` (the input size a model takes);
- one module a family: :mod:`.resnet` and :mod:`.blocks` (RepMLP-Res50 and its blocks), :mod:`.cifar`
  (the pure MLP and its ablations), :mod:`.sequence` (1-D), :mod:`.face`, :mod:`.pspnet`,
  :mod:`.repmlpnet`, :mod:`.head`;
- model files: :mod:`.file_format` (safetensors with string metadata: reading primitives, atomic writes),
  :mod:`.file_metadata` (what a file says about its model, checked before anything is built),
  :mod:`.model_file` (``save_model`` / ``load_model``, the model with its ``ModelMetadata``, re-exported
  here) and :mod:`.importer` (the authors' released weights).

May import :mod:`repmlp.data`, :mod:`repmlp.nn` and :mod:`repmlp.errors`; nothing above.
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
from repmlp.models.model_file import ModelMetadata, load_model
from repmlp.models.registry import create_model, is_model, list_models, model_default_cfg, register_model

__all__ = [
    "create_model",
    "list_models",
    "register_model",
    "is_model",
    "model_default_cfg",
    "load_model",
    "ModelMetadata",
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
