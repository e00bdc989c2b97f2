"""ImageNet-style image folders: ``<root>/train/<class>/*.jpg`` and ``<root>/val/<class>/*.jpg``.

Each class folder is walked once (symlink loops end), special files are named and left out, and an image is
decoded only within bounds (:mod:`.inputs`). Items are uint8 ``(C, H, W)``; the loader normalises them on
the device. JPEGs are decoded by ``torchvision.io.decode_jpeg`` (Pillow's pixels: both are libjpeg-turbo),
everything else by Pillow. The training crop and flip are a pure function of ``(seed, epoch, index)`` and
the image size, so the GPU pipeline (:class:`GpuTrainBatch`) applies the same boxes.
"""

from __future__ import annotations

import io
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as F

from repmlp.data.inputs import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    InputError,
    not_regular,
    open_image,
    read_bytes,
    walk_files,
)
from repmlp.errors import UserError

__all__ = ["ImageFolderData", "scan_image_folder", "IMG_EXTENSIONS", "image_to_channels", "stratified_subset",
           "decode_pixels", "CropParams", "TrainCrop", "EvalPixels", "GpuTrainBatch", "sample_seed",
           "train_crop_params", "device_crop_batch"]  # fmt: skip

log = logging.getLogger(__name__)

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_JPEG_MAGIC = b"\xff\xd8\xff"
SCALE, RATIO = (0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0)  # RandomResizedCrop's defaults (the paper's recipe)


def image_to_channels(img: Image.Image, channels: int) -> Image.Image:
    """A PIL image of any mode as ``L`` (``channels == 1``) or ``RGB``: 16-bit grey scaled to 8 bits, 32-bit
    integer and float clipped to 0..255, a palette with transparency through RGBA."""
    if img.mode in _SIXTEEN_BIT or img.mode in ("I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        arr = arr / 257.0 if img.mode in _SIXTEEN_BIT else arr
        img = Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L")
    elif img.mode in ("P", "PA") and "transparency" in img.info or img.mode == "PA":
        img = img.convert("RGBA")
    mode = "L" if channels == 1 else "RGB"
    return img if img.mode == mode else img.convert(mode)  # convert() would copy even then


def stratified_subset(labels: Sequence[int], n: int, seed: int) -> list[int]:
    """``n`` indices of ``labels`` (in order), seeded, every class keeping its share (at least one while ``n``
    allows): the first ``n`` of a sorted folder would be one class."""
    if n >= len(labels):
        return list(range(len(labels)))
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
    by_class: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        by_class.setdefault(int(label), []).append(i)
    # An example's rank: its place in a random order of its class over the class size (ties at random).
    keys: list[tuple[float, float, int]] = []
    for members in by_class.values():
        order = rng.permutation(len(members))
        for pos, j in enumerate(order):
            keys.append((pos / len(members), float(rng.random()), members[j]))
    keys.sort()
    return sorted(i for _, _, i in keys[:n])


def scan_image_folder(root: str | os.PathLike, split: str, classes: list[str] | None = None):
    """``(samples [(path, class_index)], classes)`` of ``root/split``; special files are logged and left out."""
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


def _jpeg_header(path: str, channels: int) -> tuple[bytes, int, int] | None:
    """``(file bytes, height, width)`` of a JPEG that ``decode_jpeg`` decodes to Pillow's pixels, else ``None``
    (not a JPEG, CMYK, RGB to one channel, no end marker, unreadable: Pillow then decodes it or says why)."""
    try:
        data = read_bytes(path, MAX_IMAGE_BYTES)
        if not data.startswith(_JPEG_MAGIC) or not data.rstrip(b"\0\r\n ").endswith(b"\xff\xd9"):
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a decompression bomb: Pillow's turn (it says so)
            with Image.open(io.BytesIO(data)) as im:  # the header only
                (width, height), mode = im.size, im.mode
    except Exception:  # noqa: BLE001 - whatever failed here, Pillow decodes the file or says why not
        return None
    if width * height > MAX_IMAGE_PIXELS or mode not in (("L",) if channels == 1 else ("RGB", "L")):
        return None
    return data, height, width


def _fast_jpeg(path: str, channels: int) -> torch.Tensor | None:
    """``path`` decoded by ``decode_jpeg`` as uint8 ``(channels, H, W)``, or ``None`` (a warning counts)."""
    header = _jpeg_header(path, channels)
    if header is None:
        return None
    data, height, width = header
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # libjpeg's warnings of corrupt data
            warnings.simplefilter("ignore", DeprecationWarning)  # torchvision's notes on its decoders
            read = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
            x = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=read)
    except Exception:  # noqa: BLE001 - Pillow decodes the file or says why not
        return None
    return x if tuple(x.shape) == (channels, height, width) else None


def decode_pixels(path: str, channels: int) -> torch.Tensor:
    """The image file ``path`` as uint8 ``(channels, H, W)`` (:func:`_fast_jpeg`, else Pillow)."""
    x = _fast_jpeg(path, channels)
    if x is not None:
        return x
    try:
        with open_image(path) as im:
            img = image_to_channels(im, channels)
    except InputError as exc:
        raise UserError(f"cannot read image {path}: {exc}") from None
    return pil_to_pixels(img)


def pil_to_pixels(img: Image.Image) -> torch.Tensor:
    """A PIL ``L`` or ``RGB`` image -> uint8 ``(C, H, W)`` (a writable copy, no numpy array interface)."""
    w, h = img.size
    return torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(h, w, -1).permute(2, 0, 1)


def sample_seed(seed: int, epoch: int, index: int, train: bool) -> int:
    """The seed of one example's augmentation."""
    return int(np.random.SeedSequence([seed, epoch, index, int(train)]).generate_state(1)[0])


@dataclass(frozen=True)
class CropParams:
    """One training example's random crop box (in the decoded image's pixels) and flip."""

    top: int
    left: int
    height: int
    width: int
    flip: bool


def draw_crop(height: int, width: int, flip: bool) -> CropParams:
    """A crop box and flip from the global torch RNG, as ``RandomResizedCrop`` and ``RandomHorizontalFlip``
    draw them (an expanded 1-element tensor stands for the image)."""
    shape = torch.empty(1, 1, 1).expand(1, height, width)
    top, left, h, w = T.RandomResizedCrop.get_params(shape, list(SCALE), list(RATIO))
    return CropParams(top, left, h, w, bool(torch.rand(1) < 0.5) if flip else False)


def train_crop_params(seed: int, epoch: int, index: int, height: int, width: int, flip: bool) -> CropParams:
    """Example ``index``'s crop box and flip in ``epoch``, as :class:`ImageFolderData` draws them."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sample_seed(seed, epoch, index, True))
        return draw_crop(height, width, flip)


class TrainCrop:
    """Training augmentation, uint8 ``(C, H, W)`` -> ``(C, size, size)``: random resized crop (bilinear,
    antialiased), flip, ImageNet AutoAugment; from the torch RNG, seeded per example. Picklable."""

    def __init__(self, size: int, flip: bool, autoaugment: bool = False) -> None:
        self.size, self.flip, self.autoaugment = size, flip, autoaugment

    def apply(self, x: torch.Tensor, p: CropParams) -> torch.Tensor:
        """``x`` cropped to ``p``'s box, resized to ``size`` and flipped as ``p`` says (no AutoAugment)."""
        x = F.resized_crop(x, p.top, p.left, p.height, p.width, [self.size, self.size], antialias=True)
        return x.flip(-1) if p.flip else x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self.apply(x, draw_crop(x.shape[-2], x.shape[-1], self.flip))
        return T.AutoAugment(T.AutoAugmentPolicy.IMAGENET)(x) if self.autoaugment else x


class EvalPixels:
    """A PIL evaluation transform (resize, centre crop) of uint8 ``(C, H, W)``. Picklable."""

    def __init__(self, pil_transform: Callable) -> None:
        self.pil_transform = pil_transform

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        c, h, w = x.shape
        arr = x.permute(1, 2, 0).numpy()
        img = Image.fromarray(arr[:, :, 0] if c == 1 else arr, "L" if c == 1 else "RGB")
        return pil_to_pixels(self.pil_transform(img))


def device_crop_batch(
    images: Sequence[torch.Tensor], params: Sequence[CropParams], size: int
) -> torch.Tensor:
    """Uint8 ``[(C, H_i, W_i)]`` -> float ``(B, C, size, size)`` in 0..255, each cropped, resized and flipped
    as :meth:`TrainCrop.apply` does in uint8 (within 1)."""
    out = []
    for x, p in zip(images, params, strict=True):
        crop = x[None, :, p.top : p.top + p.height, p.left : p.left + p.width].float()
        crop = torch.nn.functional.interpolate(
            crop, size=(size, size), mode="bilinear", align_corners=False, antialias=True
        )
        out.append(crop.flip(-1) if p.flip else crop)
    return torch.cat(out)


class ImageFolderData(torch.utils.data.Dataset):
    """Item ``(index, epoch)`` -> ``(pixels (C, size, size) uint8, label)``: the image in ``channels``,
    ``transform`` seeded from ``(seed, epoch, index)`` (batches do not depend on the workers; a resumed run
    equals an uninterrupted one). With ``raw_jpeg`` (the device pipeline) a JPEG comes undecoded:
    ``((bytes uint8 (N,), CropParams, index, epoch), label)``."""

    def __init__(self, samples: list[tuple[str, int]], transform: Callable, seed: int, train: bool,
                 channels: int = 3) -> None:  # fmt: skip
        self.samples, self.transform, self.seed, self.train = samples, transform, seed, train
        self.channels = channels
        self.raw_jpeg = False

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: tuple[int, int]) -> tuple[Any, int]:
        index, epoch = item
        path, label = self.samples[index]
        if self.raw_jpeg and (header := _jpeg_header(path, self.channels)) is not None:
            data, height, width = header
            params = train_crop_params(self.seed, epoch, index, height, width, self.transform.flip)
            return (torch.frombuffer(bytearray(data), dtype=torch.uint8), params, index, epoch), label
        x = decode_pixels(path, self.channels)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, epoch, index, self.train))
            return self.transform(x), label

    def cpu_item(self, index: int, epoch: int) -> torch.Tensor:
        """Example ``index`` of ``epoch`` by the CPU path (a file the device decoder refused)."""
        raw, self.raw_jpeg = self.raw_jpeg, False
        try:
            return self[(index, epoch)][0]
        finally:
            self.raw_jpeg = raw


class GpuTrainBatch:
    """The GPU training pipeline (``FolderLoader``'s ``on_device``): the batch's raw JPEGs decoded together on
    the device (nvJPEG), cropped and flipped there with the workers' boxes; a batch the device refuses is
    decoded file by file, a refused file by the CPU path. Returns float ``(B, C, size, size)`` in 0..255."""

    def __init__(self, dataset: ImageFolderData) -> None:
        self.dataset, self.size = dataset, dataset.transform.size

    def _decode(self, raws: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
        mode = ImageReadMode.GRAY if self.dataset.channels == 1 else ImageReadMode.RGB
        try:
            return list(decode_jpeg(raws, mode=mode, device=device))
        except RuntimeError:
            out: list[torch.Tensor | None] = []
            for raw in raws:
                try:
                    out.append(decode_jpeg(raw, mode=mode, device=device))
                except RuntimeError:
                    out.append(None)
            return out

    def __call__(self, payloads: list, labels: torch.Tensor, device: torch.device) -> torch.Tensor:
        jpeg = [i for i, p in enumerate(payloads) if isinstance(p, tuple)]
        decoded = self._decode([payloads[i][0] for i in jpeg], device) if jpeg else []
        good = [(i, img) for i, img in zip(jpeg, decoded, strict=True) if img is not None]
        out: list[torch.Tensor | None] = [None] * len(payloads)
        if good:
            crops = device_crop_batch([img for _, img in good], [payloads[i][1] for i, _ in good], self.size)
            for (i, _), crop in zip(good, crops, strict=True):
                out[i] = crop
        for i, p in enumerate(payloads):
            if out[i] is None:  # decoded by a worker, or refused by the device decoder: the CPU path
                pixels = self.dataset.cpu_item(p[2], p[3]) if isinstance(p, tuple) else p
                out[i] = pixels.to(device, non_blocking=True).float()
        return torch.stack(out)  # type: ignore[arg-type]
