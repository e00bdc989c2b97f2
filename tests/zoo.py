"""Shallow builds of the registered models, for the tests that trace or export every model.

Tracing (torch.fx, dynamo, torch.export) costs time in proportion to the number of blocks, and a
check that a model traces whole does not depend on how many blocks of each kind it stacks. These
keyword arguments keep every block kind of each family (a ResNet stage's first block is a plain
Bottleneck, the others RepMLP / Non-local / GC blocks) but build one or two blocks per stage.
"""

from __future__ import annotations

from typing import Any

_UNSTACKED = ("mobilefacenet", "repmlp_cifar", "repmlp_fmnist", "wide_convnet", "repmlp1d_", "conv1d_")


def shallow(name: str) -> dict[str, Any]:
    """Keyword arguments that build ``name`` with the fewest blocks that still hold each block kind."""
    if name.startswith("repmlpnet_"):
        return dict(depths=(1, 1, 1, 1))
    if name.startswith(_UNSTACKED):
        return {}
    return dict(layers=(2, 2, 2, 2))  # every ResNet-based model: the face ResNets, PSPNets, Res50s


# Small builds of every registered model that keep each block kind (narrower, shallower; the face and
# segmentation tests' widths): a forward of each costs milliseconds, and exercises the same code paths.
_QUARTER = {"widths": (64, 128, 256, 512), "layers": (2, 2, 2, 2)}
_REPMLPNET = {"channels": (16, 32, 64, 128), "depths": (1, 1, 1, 1), "sharesets": (1, 4, 16, 32)}
_FACE = {"widths": (16, 32, 64, 128), "embedding_dim": 24, "stem_channels": 8}
_SEG = {"head_channels": 16, "aux_channels": 16, "num_classes": 3}
SMALL_BUILDS: dict[str, dict[str, Any]] = {
    "repmlp_cifar": {"widths": (4, 8, 16)},
    "repmlp_cifar_no_local": {"widths": (4, 8, 16)},
    "repmlp_cifar_no_global": {"widths": (4, 8, 16)},
    "repmlp_cifar_fc3_conv9": {"widths": (4, 8, 16)},
    "repmlp_cifar_conv9": {"widths": (4, 8, 16)},
    "wide_convnet_cifar": {"widths": (8, 16, 32)},
    "repmlp_fmnist": {},
    "repmlp_fmnist_patch2": {},
    "repmlp1d_fmnist": {"widths": (8, 16, 32)},
    "conv1d_fmnist": {"widths": (8, 16, 32)},
    "repmlp_res50": {**_QUARTER, "img_size": 96},
    "repmlp_res50_g8_16": {**_QUARTER, "img_size": 160},
    "repmlp_res50_g8_8": {**_QUARTER, "img_size": 160},
    "repmlp_res50_g4_8": {**_QUARTER, "img_size": 160},
    "repmlp_res50_light": {**_QUARTER, "img_size": 96},
    "nl_res50": {**_QUARTER, "img_size": 64},
    "gc_res50": {**_QUARTER, "img_size": 64},
    "pspnet_res50": {**_QUARTER, **_SEG, "img_size": 64},
    "pspnet_repmlp_res50": {**_QUARTER, **_SEG, "img_size": 160},
    "mobilefacenet": {"width": 16, "embedding_dim": 24, "img_size": 32},
    "face_resnet": {**_FACE, "img_size": 32},
    "repmlp_face_resnet": {**_FACE, "partition": 4, "kernel_sizes": (1, 3), "groups": 2, "img_size": 64},
    **{f"repmlpnet_{arch}": _REPMLPNET for arch in ("t224", "t256", "b224", "b256", "d256", "l256")},
}
