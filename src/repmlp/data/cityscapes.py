"""Cityscapes in its on-disk layout (paper Sec. 4.4), with PSPNet's training augmentation.

Layout (as unpacked, after ``createTrainIdLabelImgs.py``): ``root/leftImg8bit/{train,val}/<city>/
<name>_leftImg8bit.png`` and ``root/gtFine/{train,val}/<city>/<name>_gtFine_labelTrainIds.png``, label maps
of the 19 train ids and 255 for ignored pixels. Images are normalised with ImageNet's mean and std.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import Tensor
from torch.utils.data import Dataset

from repmlp.data.inputs import InputError, open_image
from repmlp.errors import UserError

__all__ = ["NUM_CLASSES", "IGNORE_INDEX", "CLASS_NAMES", "CityscapesSegmentation", "find_pairs",
           "random_scale_crop_flip", "normalize"]  # fmt: skip

NUM_CLASSES = 19
IGNORE_INDEX = 255
CLASS_NAMES = (
    "road", "sidewalk", "building", "wall", "fence", "pole", "traffic light", "traffic sign", "vegetation",
    "terrain", "sky", "person", "rider", "car", "truck", "bus", "train", "motorcycle", "bicycle",
)  # fmt: skip
_IMAGE_SUFFIX = "_leftImg8bit.png"
_LABEL_SUFFIX = "_gtFine_labelTrainIds.png"


def find_pairs(root: str | Path, split: str) -> list[tuple[Path, Path]]:
    """``(image, label)`` paths of a split, sorted; :class:`UserError` when the layout is not Cityscapes'."""
    root = Path(root)
    images_dir, labels_dir = root / "leftImg8bit" / split, root / "gtFine" / split
    for d in (images_dir, labels_dir):
        if not d.is_dir():
            raise UserError(
                f"{root} is not a Cityscapes folder: {d} is missing "
                f"(expected leftImg8bit/{split}/<city>/*{_IMAGE_SUFFIX} and "
                f"gtFine/{split}/<city>/*{_LABEL_SUFFIX})"
            )
    images = sorted(images_dir.glob(f"*/*{_IMAGE_SUFFIX}"))
    if not images:
        raise UserError(f"{images_dir} holds no <city>/*{_IMAGE_SUFFIX} images")
    pairs, missing = [], []
    for image in images:
        name = image.name[: -len(_IMAGE_SUFFIX)]
        label = labels_dir / image.parent.name / f"{name}{_LABEL_SUFFIX}"
        if label.is_file():
            pairs.append((image, label))
        else:
            missing.append(label)
    if missing:
        raise UserError(f"{len(missing)} of {len(images)} images in {images_dir} have no train-id label map, e.g. "
                        f"{missing[0]} (run cityscapesscripts' createTrainIdLabelImgs to make them)")  # fmt: skip
    return pairs


def normalize(image: Tensor) -> Tensor:
    """``(3, H, W)`` uint8 -> float, ImageNet-normalised."""
    mean = torch.tensor(IMAGENET_DEFAULT_MEAN).view(3, 1, 1) * 255
    std = torch.tensor(IMAGENET_DEFAULT_STD).view(3, 1, 1) * 255
    return (image.float() - mean) / std


def random_scale_crop_flip(image: Tensor, label: Tensor, crop_size: tuple[int, int],
                           scale_range: tuple[float, float] = (0.5, 2.0), ignore_index: int = IGNORE_INDEX,
                           generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """PSPNet's training augmentation of a normalised image ``(3, H, W)`` and int64 labels ``(H, W)`` ->
    ``(3, ch, cw)``, ``(ch, cw)``: random scale (bilinear image, nearest labels: no label invented), padding
    to the crop (zeros, the mean colour; the ignore label), a random crop, a flip with probability 1/2."""
    lo, hi = scale_range
    scale = lo + (hi - lo) * float(torch.rand((), generator=generator))
    h, w = label.shape
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    image = F.interpolate(image[None], size=(nh, nw), mode="bilinear", align_corners=False)[0]
    label = F.interpolate(label[None, None].float(), size=(nh, nw), mode="nearest")[0, 0].long()
    ch, cw = crop_size
    ph, pw = max(ch - nh, 0), max(cw - nw, 0)
    if ph or pw:
        image = F.pad(image, (0, pw, 0, ph), value=0.0)
        label = F.pad(label, (0, pw, 0, ph), value=ignore_index)
    top = int(torch.randint(0, label.shape[0] - ch + 1, (), generator=generator))
    left = int(torch.randint(0, label.shape[1] - cw + 1, (), generator=generator))
    image = image[:, top : top + ch, left : left + cw]
    label = label[top : top + ch, left : left + cw]
    if float(torch.rand((), generator=generator)) < 0.5:
        image, label = image.flip(-1), label.flip(-1)
    return image.contiguous(), label.contiguous()


# Image modes whose pixel values are label numbers as stored (8-bit grey, palette indices, 16/32-bit grey).
_LABEL_MODES = ("L", "P", "I;16", "I")


def _read(path: Path, mode: str | None) -> np.ndarray:
    """One image in ``mode``, or (``None``) a label map's stored values, never converted (16 to 8 bits would
    clip 300 to 255, the ignore label; RGB would become luminance): other modes are refused."""
    try:
        with open_image(path) as img:
            if mode is not None:
                return np.array(img.convert(mode))
            if img.mode not in _LABEL_MODES:
                raise UserError(f"{path} is a {img.mode} image, not a label map (8-bit grey train ids)")
            return np.array(img)
    except InputError as exc:
        raise UserError(f"cannot read {path}: {exc}") from None


class CityscapesSegmentation(Dataset):
    """Cityscapes fine annotations of one split, items ``(image (3, H, W) float, labels (H, W) int64)``:
    with ``crop_size`` (training) randomly scaled, cropped and flipped, else the whole image."""

    def __init__(self, root: str | Path, split: str = "train", *, crop_size: int | Sequence[int] | None = None,
                 scale_range: tuple[float, float] = (0.5, 2.0)) -> None:  # fmt: skip
        self.pairs = find_pairs(root, split)
        self.crop_size = (
            (crop_size, crop_size) if isinstance(crop_size, int) else crop_size and tuple(crop_size)
        )
        self.scale_range = scale_range

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image_path, label_path = self.pairs[index]
        image = torch.from_numpy(_read(image_path, "RGB")).permute(2, 0, 1)
        label = torch.from_numpy(_read(label_path, None).astype(np.int64))
        if image.shape[1:] != label.shape:
            raise UserError(f"{image_path} and {label_path} differ in size")
        bad = ((label >= NUM_CLASSES) & (label != IGNORE_INDEX)) | (label < 0)
        if bool(bad.any()):
            raise UserError(
                f"{label_path} holds label {int(label[bad][0])}, not a train id (0-18) or 255: is it a "
                "labelIds map instead of labelTrainIds?"
            )
        image = normalize(image)
        if self.crop_size is not None:
            image, label = random_scale_crop_flip(image, label, self.crop_size, self.scale_range)
        return image, label
