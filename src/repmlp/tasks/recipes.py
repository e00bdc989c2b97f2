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

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Recipe", "PRESETS", "DEFAULT_PRESET", "preset_for_model", "folder_batch_size", "folder_lr"]


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

# The preset a data set gets when --preset is not given (an image folder's run of a known model, or with
# --init, takes that model's own instead: preset_for_model).
DEFAULT_PRESET = {"fashion-mnist": "fmnist", "cifar10": "cifar", "imagefolder": "imagenet"}

# An image folder's run without --batch-size: the preset's batch, halved until an epoch has at least this
# many steps (a small folder would otherwise get one or two steps an epoch: no training to speak of) ...
FOLDER_MIN_STEPS = 10
# ... but not below this (BatchNorm's statistics need a few images).
FOLDER_MIN_BATCH = 8


def preset_for_model(
    model: str, input_size: Sequence[int] | None, dataset: str | None = None
) -> tuple[str, str]:
    """``(preset, why)``: the recipe of a model that an image folder's run starts from without ``--preset``.

    The preset built for ``model`` (``repmlp_fmnist_patch2``: ``fmnist``, ``repmlp_res50``: ``imagenet``);
    else that of the in-memory data set it was trained on (``dataset``, an ``--init`` file's); else the
    one for inputs like its ``input_size`` ``(C, H, W)``: small greyscale ones ``fmnist``, small ones
    ``cifar``, others ``imagenet``. ``why`` says which, for the log.
    """
    for name, recipe in PRESETS.items():
        if recipe.model == model:
            return name, f"{model}'s recipe"
    if dataset in DEFAULT_PRESET and dataset != "imagefolder":
        return DEFAULT_PRESET[dataset], f"the recipe of {dataset}, which {model} was trained on"
    if input_size:
        c, h, w = input_size
        side = "x".join(str(s) for s in input_size)
        if c == 1 and max(h, w) <= 32:
            return "fmnist", f"the recipe for {side} inputs like {model}'s"
        if max(h, w) <= 64:
            return "cifar", f"the recipe for {side} inputs like {model}'s"
    return "imagenet", f"the recipe for {model}"


def folder_batch_size(batch: int, n_train: int) -> int:
    """The batch of a run on ``n_train`` images whose recipe says ``batch``: ``batch`` halved until an epoch
    has :data:`FOLDER_MIN_STEPS` steps, not below :data:`FOLDER_MIN_BATCH` (nor above ``batch``)."""
    fitted = batch
    while fitted > FOLDER_MIN_BATCH and n_train // fitted < FOLDER_MIN_STEPS:
        fitted //= 2
    return max(min(fitted, batch), min(batch, FOLDER_MIN_BATCH))


def folder_lr(lr: float, batch: int, fitted: int) -> float:
    """The peak learning rate for a batch fitted down from the recipe's ``batch`` to ``fitted``
    (:func:`folder_batch_size`): ``lr`` scaled by ``sqrt(fitted / batch)``, the square-root rule that keeps
    the gradient noise of the smaller batch in check (the linear rule slows a short fine-tuning run down:
    on 400 Fashion-MNIST PNGs of 4 classes, batch 32, 5 epochs, 90.5% top-1 at lr 0.1 against 81.5% at the
    recipe's 0.2 and 38% at the linear rule's 0.025 after 2 epochs; docs/using.md)."""
    return round(lr * math.sqrt(fitted / batch), 6) if fitted < batch else lr
