"""repmlp: RepMLP (Ding et al.), re-parameterizing convolutions into fully-connected layers.

The public names are imported on first use (PEP 562), so that ``repmlp --version`` and ``repmlp --help`` import
no torch (start-up time). The first use of one (``repmlp.create_model``, ...) imports them all, and with them
what their modules register: the models with timm, the reduced precisions' loaders with the model files. A
program that imported timm before repmlp gets the models registered at once.
"""

import importlib
import sys
from typing import Any

from repmlp._version import __version__ as __version__  # repmlp.__version__

# Each public name -> the module that defines it.
_HOMES = {
    **dict.fromkeys(
        ["RepMLPBlock", "RepMLPBlock1d", "GlobalPerceptron", "PartitionPerceptron", "LocalPerceptron"],
        "repmlp.nn.block",
    ),
    **dict.fromkeys(["ConvBN", "GroupwiseLinear"], "repmlp.nn.layers"),
    **dict.fromkeys(
        ["fuse_bn", "conv_to_fc", "conv_to_fc_identity", "absorb_bn_into_fc"], "repmlp.nn.reparam"
    ),
    **dict.fromkeys(["reparameterize_model", "fuse_conv_bn"], "repmlp.nn.convert"),
    **dict.fromkeys(["to_precision", "PRECISIONS"], "repmlp.deploy.precision"),
    **dict.fromkeys(["create_model", "list_models", "register_model"], "repmlp.models"),
    "profile": "repmlp.bench.counts",
    **dict.fromkeys(["load_model", "save_model"], "repmlp.io"),
    **dict.fromkeys(["Predictor", "Prediction"], "repmlp.deploy.predict"),
    "ModelMetadata": "repmlp.io",
}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    """A public name (all of them imported now, and kept), or a subpackage not imported yet (``repmlp.models``)."""
    if name in _HOMES:
        globals().update({n: getattr(importlib.import_module(module), n) for n, module in _HOMES.items()})
        return globals()[name]
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":  # the module exists, but something it imports does not
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if "timm" in sys.modules:  # timm is loaded already: registering the models costs no start-up time
    importlib.import_module("repmlp.models")
