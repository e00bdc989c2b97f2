"""repmlp: RepMLP (Ding et al.), re-parameterizing convolutions into fully-connected layers."""

from repmlp._version import __version__ as __version__  # repmlp.__version__
from repmlp.bench.counts import profile
from repmlp.deploy.precision import PRECISIONS, to_precision
from repmlp.deploy.predict import Prediction, Predictor
from repmlp.io import ModelMetadata, load_model, save_model
from repmlp.models import create_model, list_models, register_model
from repmlp.nn.block import GlobalPerceptron, LocalPerceptron, PartitionPerceptron, RepMLPBlock, RepMLPBlock1d
from repmlp.nn.convert import fuse_conv_bn, reparameterize_model
from repmlp.nn.layers import ConvBN, GroupwiseLinear
from repmlp.nn.reparam import absorb_bn_into_fc, conv_to_fc, conv_to_fc_identity, fuse_bn

__all__ = [
    "RepMLPBlock",
    "RepMLPBlock1d",
    "GlobalPerceptron",
    "PartitionPerceptron",
    "LocalPerceptron",
    "ConvBN",
    "GroupwiseLinear",
    "fuse_bn",
    "conv_to_fc",
    "conv_to_fc_identity",
    "absorb_bn_into_fc",
    "reparameterize_model",
    "fuse_conv_bn",
    "to_precision",
    "PRECISIONS",
    "create_model",
    "list_models",
    "register_model",
    "profile",
    "load_model",
    "save_model",
    "Predictor",
    "Prediction",
    "ModelMetadata",
]
