"""repmlp: RepMLP (Ding et al.), re-parameterizing convolutions into fully-connected layers.

``import repmlp`` imports the public names, and with them what their modules register: the models with timm
(``import repmlp, timm; timm.create_model("repmlp_res50")``, in any import order), the reduced precisions'
loaders with the model files. It costs what importing torch and timm costs.
"""

from repmlp._version import __version__ as __version__  # repmlp.__version__
from repmlp.bench.counts import profile
from repmlp.deploy.precision import PRECISIONS, to_precision
from repmlp.deploy.predict import Prediction, Predictor
from repmlp.io import ModelMetadata, load_model, save_model
from repmlp.models import create_model, list_models
from repmlp.nn.block import GlobalPerceptron, LocalPerceptron, PartitionPerceptron, RepMLPBlock, RepMLPBlock1d
from repmlp.nn.convert import fuse_conv_bn, reparameterize_model
from repmlp.nn.layers import ConvBN, GroupwiseLinear
from repmlp.nn.reparam import absorb_bn_into_fc, conv_to_fc, conv_to_fc_identity, fuse_bn

__all__ = ["RepMLPBlock", "RepMLPBlock1d", "GlobalPerceptron", "PartitionPerceptron", "LocalPerceptron",
           "ConvBN", "GroupwiseLinear", "fuse_bn", "conv_to_fc", "conv_to_fc_identity", "absorb_bn_into_fc",
           "reparameterize_model", "fuse_conv_bn", "to_precision", "PRECISIONS", "create_model", "list_models",
           "profile", "load_model", "save_model", "Predictor", "Prediction",
           "ModelMetadata"]  # fmt: skip
