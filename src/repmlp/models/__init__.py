"""repmlp's model zoo: the paper's models by name (``repmlp.create_model``), also registered with timm."""

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
from repmlp.models.registry import create_model, is_model, list_models, model_default_cfg, register_model

__all__ = [
    "create_model",
    "list_models",
    "register_model",
    "is_model",
    "model_default_cfg",
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
