"""ImageNet-style image folders: ``<root>/train/<class>/*.jpg`` and ``<root>/val/<class>/*.jpg``.

The folders are the user's: a class folder is walked once even when symlinks loop back into it, files
that are not regular (FIFOs, devices, sockets) are named and left out, and an image is decoded only when
its file and its pixel count are within bounds (:mod:`repmlp.data.inputs`). Images of any mode are converted
to the channels the model takes (:func:`image_to_channels`). A limit on the number of examples takes a
seeded subset that keeps every class's share (:func:`stratified_subset`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from repmlp.data.inputs import InputError, not_regular, open_image, walk_files
from repmlp.errors import UserError

__all__ = ["ImageFolderData", "scan_image_folder", "IMG_EXTENSIONS", "image_to_channels", "stratified_subset"]

log = logging.getLogger(__name__)

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Pillow's ``I;16`` family holds 16-bit samples: scaled to 8 bits (65535 -> 255) like any image viewer.
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")


def image_to_channels(img: Any, channels: int) -> Any:
    """A PIL image of any mode as ``L`` (``channels == 1``) or ``RGB``: what the model takes.

    16-bit greyscale is scaled to 8 bits, 32-bit integer and float images are clipped to 0..255, a
    palette image with transparency goes through RGBA (alpha is dropped, as ``convert("RGB")`` does).
    """
    from PIL import Image

    if img.mode in _SIXTEEN_BIT or img.mode in ("I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        arr = arr / 257.0 if img.mode in _SIXTEEN_BIT else arr
        img = Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L")
    elif img.mode in ("P", "PA") and "transparency" in img.info or img.mode == "PA":
        img = img.convert("RGBA")
    mode = "L" if channels == 1 else "RGB"
    return img if img.mode == mode else img.convert(mode)  # convert() would copy even then


def stratified_subset(labels: Sequence[int], n: int, seed: int) -> list[int]:
    """``n`` indices of ``labels`` (in their order) drawn so that every class keeps its share: each class
    contributes about ``n * its size / len(labels)`` examples, and at least one while ``n`` allows, drawn
    at random within the class (seeded by ``seed``). The first ``n`` of a class-sorted folder would be one
    or two classes only."""
    if n >= len(labels):
        return list(range(len(labels)))
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
    by_class: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        by_class.setdefault(int(label), []).append(i)
    # An example's rank: its position in a random order of its class, over the class size. Every class's
    # first draw ranks 0 (ties broken at random), so the first len(classes) picks cover the classes; after
    # that the classes are drawn in proportion to their sizes.
    keys: list[tuple[float, float, int]] = []
    for members in by_class.values():
        order = rng.permutation(len(members))
        for pos, j in enumerate(order):
            keys.append((pos / len(members), float(rng.random()), members[j]))
    keys.sort()
    return sorted(i for _, _, i in keys[:n])


def scan_image_folder(root: str | os.PathLike, split: str, classes: list[str] | None = None):
    """``(samples [(path, class_index)], classes)`` of ``root/split``; errors name what is wrong, and
    files of the class folders that are not regular files are logged and left out."""
    folder = Path(root) / split
    if not_regular(root) != "a folder":
        raise UserError(f"data folder not found: {root}")
    if not_regular(folder) != "a folder":
        raise UserError(
            f"image folder {root} has no '{split}' sub-folder (expected {root}/{split}/<class>/<image>)"
        )
    found = sorted(
        d.name for d in folder.iterdir() if not_regular(d) == "a folder" and not d.name.startswith(".")
    )
    if not found:
        raise UserError(f"{folder} has no class sub-folders (expected {folder}/<class>/<image>)")
    if classes is not None and found != classes:
        raise UserError(f"{folder} has classes {found[:5]}... which differ from the train split's")
    samples = []
    for i, name in enumerate(found):
        files, skipped = walk_files(folder / name, IMG_EXTENSIONS)
        for path, reason in skipped:
            log.warning("%s: skipped (%s)", path, reason)
        samples.extend((p, i) for p in files)
    if not samples:
        raise UserError(f"{folder} holds no images ({', '.join(IMG_EXTENSIONS)})")
    return samples, found


class ImageFolderData(torch.utils.data.Dataset):
    """Decodes one image per item; items are ``(index, epoch)`` so augmentation is seeded per sample.

    Seeding each sample's transform from ``(seed, epoch, index)`` makes the augmented batch independent of
    worker count and process history, which is what makes a resumed run identical to an uninterrupted one.
    Images are converted to ``channels`` (1: greyscale, 3: RGB) whatever their mode.
    Returns ``(image (C, H, W) float, label)``.
    """

    def __init__(
        self, samples: list[tuple[str, int]], transform: Callable, seed: int, train: bool, channels: int = 3
    ) -> None:
        self.samples, self.transform, self.seed, self.train = samples, transform, seed, train
        self.channels = channels

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, epoch = item
        path, label = self.samples[index]
        try:
            with open_image(path) as im:
                img = image_to_channels(im, self.channels)
        except InputError as exc:
            raise UserError(f"cannot read image {path}: {exc}") from None
        seed = int(np.random.SeedSequence([self.seed, epoch, index, int(self.train)]).generate_state(1)[0])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.transform(img), label
