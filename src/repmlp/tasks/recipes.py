"""Training recipes (presets): the paper's CIFAR and ImageNet settings and the fast Fashion-MNIST default.

A preset fills every training option the user did not give; each value stays overridable on the command
line. The paper's settings (Sec. 4.1, 4.2):

- CIFAR-10: batch 128, cosine learning rate 0.2 -> 0 over 100 epochs, padding to 40x40 + random 32x32
  crop + left-right flip (SGD; momentum and weight decay are not stated, we use 0.9 and 1e-4).
- ImageNet: global batch 256, SGD momentum 0.9, weight decay 1e-4, cosine 0.1 -> 0 over 100 epochs,
  mixup, AutoAugment, random (resized) crop + flip; single centre crop for evaluation.
- fmnist (ours): the 5-minute CPU job that ``repmlp train`` runs by default.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Recipe", "PRESETS", "DEFAULT_PRESET"]


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """The training options a preset sets (each overridable on the command line); the classification
    run's :class:`~repmlp.tasks.classification.TrainConfig` takes its defaults from ``PRESETS["fmnist"]``.

    The defaults are what the paper's two recipes share (SGD with momentum 0.9 and weight decay 1e-4, a
    cosine schedule to zero, flips, no warm-up, label smoothing, mixup or padding); a preset states the rest.
    """

    model: str
    epochs: int
    batch_size: int
    optimizer: str = "sgd"
    lr: float
    min_lr: float = 0.0
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    schedule: str = "cosine"
    warmup_epochs: float = 0.0
    label_smoothing: float = 0.0
    mixup: float = 0.0
    pad: int = 0
    flip: bool = True
    autoaugment: bool = False
    img_size: int | None = None
    channels_last: bool | None = None  # None: on for CUDA

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, Recipe] = {
    "fmnist": Recipe(
        # The patch stem (rather than repmlp_fmnist's) halves the stages' resolution, so that five epochs fit
        # in five minutes on the slowest 2-core CPU, at the same accuracy (docs/main-job.md).
        model="repmlp_fmnist_patch2",
        epochs=5,
        batch_size=256,
        lr=0.2,
        nesterov=True,
        weight_decay=5e-5,
        warmup_epochs=0.5,
        label_smoothing=0.1,
        # The stem's matmul and the 1x1 FCs run channels_last; the Local Perceptron's convs pick their own
        # layout (layers.LayoutConv2d).
        channels_last=True,
    ),
    "cifar": Recipe(model="repmlp_cifar", epochs=100, batch_size=128, lr=0.2, pad=4),
    "imagenet": Recipe(
        model="repmlp_res50", epochs=100, batch_size=256, lr=0.1, mixup=0.2, autoaugment=True, img_size=224
    ),
}

# The preset a data set gets when --preset is not given.
DEFAULT_PRESET = {"fashion-mnist": "fmnist", "cifar10": "cifar", "imagefolder": "imagenet"}
