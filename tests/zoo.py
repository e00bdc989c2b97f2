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
