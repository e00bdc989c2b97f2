"""ImageNet-style image folders: ``<root>/train/<class>/*.jpg`` and ``<root>/val/<class>/*.jpg``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from ..errors import UserError

__all__ = ["ImageFolderData", "scan_image_folder", "IMG_EXTENSIONS"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def scan_image_folder(root: str | os.PathLike, split: str, classes: list[str] | None = None):
    """``(samples [(path, class_index)], classes)`` of ``root/split``; errors name what is wrong."""
    folder = Path(root) / split
    if not Path(root).is_dir():
        raise UserError(f"data folder not found: {root}")
    if not folder.is_dir():
        raise UserError(
            f"image folder {root} has no '{split}' sub-folder (expected {root}/{split}/<class>/<image>)"
        )
    found = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not found:
        raise UserError(f"{folder} has no class sub-folders (expected {folder}/<class>/<image>)")
    if classes is not None and found != classes:
        raise UserError(f"{folder} has classes {found[:5]}... which differ from the train split's")
    samples = []
    for i, name in enumerate(found):
        files = sorted(
            p for p in (folder / name).rglob("*") if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS
        )
        samples.extend((str(p), i) for p in files)
    if not samples:
        raise UserError(f"{folder} holds no images ({', '.join(IMG_EXTENSIONS)})")
    return samples, found


class ImageFolderData(torch.utils.data.Dataset):
    """Decodes one image per item; items are ``(index, epoch)`` so augmentation is seeded per sample.

    Seeding each sample's transform from ``(seed, epoch, index)`` makes the augmented batch independent of
    worker count and process history, which is what makes a resumed run identical to an uninterrupted one.
    Returns ``(image (C, H, W) float, label)``.
    """

    def __init__(self, samples: list[tuple[str, int]], transform: Callable, seed: int, train: bool) -> None:
        self.samples, self.transform, self.seed, self.train = samples, transform, seed, train

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, epoch = item
        path, label = self.samples[index]
        try:
            with Image.open(path) as im:
                img = im.convert("RGB")
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            raise UserError(f"cannot read image {path}: {exc}") from None
        seed = int(np.random.SeedSequence([self.seed, epoch, index, int(self.train)]).generate_state(1)[0])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.transform(img), label
