"""Training recipes (presets): the paper's CIFAR and ImageNet settings and the fast Fashion-MNIST default.

A preset fills every training option the user did not give; each value stays overridable on the command
line. The paper's settings (Sec. 4.1, 4.2):

- CIFAR-10: batch 128, cosine learning rate 0.2 -> 0 over 100 epochs, padding to 40x40 + random 32x32
  crop + left-right flip (SGD; momentum and weight decay are not stated, we use 0.9 and 1e-4).
- ImageNet: global batch 256, SGD momentum 0.9, weight decay 1e-4, cosine 0.1 -> 0 over 100 epochs,
  mixup, AutoAugment, random (resized) crop + flip; single centre crop for evaluation.
- fmnist (ours): the 10-minute CPU job that ``repmlp train`` runs by default.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "DEFAULT_PRESET"]

PRESETS: dict[str, dict[str, Any]] = {
    "fmnist": {
        "model": "repmlp_fmnist",
        "epochs": 5,
        "batch_size": 256,
        "optimizer": "sgd",
        "lr": 0.2,
        "min_lr": 0.0,
        "momentum": 0.9,
        "nesterov": True,
        "weight_decay": 5e-5,
        "schedule": "cosine",
        "warmup_epochs": 0.5,
        "label_smoothing": 0.1,
        "mixup": 0.0,
        "pad": 0,
        "flip": True,
        "autoaugment": False,
        "img_size": None,
        # Measured on a 2-core CPU: the Local Perceptron's convs train ~1.7x faster channels-last.
        "channels_last": True,
    },
    "cifar": {
        "model": "repmlp_cifar",
        "epochs": 100,
        "batch_size": 128,
        "optimizer": "sgd",
        "lr": 0.2,
        "min_lr": 0.0,
        "momentum": 0.9,
        "nesterov": False,
        "weight_decay": 1e-4,
        "schedule": "cosine",
        "warmup_epochs": 0.0,
        "label_smoothing": 0.0,
        "mixup": 0.0,
        "pad": 4,
        "flip": True,
        "autoaugment": False,
        "img_size": None,
        "channels_last": None,  # on CUDA
    },
    "imagenet": {
        "model": "repmlp_res50",
        "epochs": 100,
        "batch_size": 256,
        "optimizer": "sgd",
        "lr": 0.1,
        "min_lr": 0.0,
        "momentum": 0.9,
        "nesterov": False,
        "weight_decay": 1e-4,
        "schedule": "cosine",
        "warmup_epochs": 0.0,
        "label_smoothing": 0.0,
        "mixup": 0.2,
        "pad": 0,
        "flip": True,
        "autoaugment": True,
        "img_size": 224,
        "channels_last": None,
    },
}

# The preset a data set gets when --preset is not given.
DEFAULT_PRESET = {"fashion-mnist": "fmnist", "cifar10": "cifar", "imagefolder": "imagenet"}
