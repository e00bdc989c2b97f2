"""ImageNet-style image folders: ``<root>/train/<class>/*.jpg`` and ``<root>/val/<class>/*.jpg``.

The folders are the user's: a class folder is walked once even when symlinks loop back into it, files
that are not regular (FIFOs, devices, sockets) are named and left out, and an image is decoded only when
its file and its pixel count are within bounds (:mod:`repmlp.data.inputs`). Images of any mode are converted
to the channels the model takes (:func:`image_to_channels`). A limit on the number of examples takes a
seeded subset that keeps every class's share (:func:`stratified_subset`).

Items are uint8 pixels ``(C, H, W)``; the loader collates, pins and moves them and normalises on the device
(:class:`~repmlp.data.loader.FolderLoader`), a quarter of the bytes of float32. Decoding takes what measured
fastest per format (docs/benchmarks.md, "The image-folder pipeline"): ``torchvision.io.decode_jpeg`` for
baseline RGB or greyscale JPEGs (the same pixels as Pillow's, both libjpeg-turbo), Pillow for the rest
and for any JPEG the fast path cannot take (:func:`decode_pixels`). The training crop box and flip are a
pure function of ``(seed, epoch, index)`` and the image size (:func:`train_crop_params`), so a batched
device-side implementation (:func:`device_crop_batch`, with nvJPEG decoding on CUDA) applies the same boxes.
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

__all__ = [
    "ImageFolderData",
    "scan_image_folder",
    "IMG_EXTENSIONS",
    "image_to_channels",
    "stratified_subset",
    "decode_pixels",
    "CropParams",
    "TrainCrop",
    "EvalPixels",
    "sample_seed",
    "train_crop_params",
    "device_crop_batch",
]

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


_JPEG_MAGIC = b"\xff\xd8\xff"


def _jpeg_header(path: str, channels: int) -> tuple[bytes, int, int] | None:
    """``(file bytes, height, width)`` of a JPEG that ``torchvision.io.decode_jpeg`` decodes to Pillow's
    pixels, or ``None`` (not a JPEG, a mode Pillow would convert otherwise: CMYK, or RGB to one channel;
    anything unreadable: the Pillow path then names the problem).

    The file size and the header's pixel count are bounded first, as :func:`~.inputs.open_image` does, and
    a file without its end marker is left to Pillow (libjpeg only warns of a truncated file, Pillow fails).
    """
    from PIL import Image

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
    """``path`` decoded by ``torchvision.io.decode_jpeg`` as uint8 ``(channels, H, W)``, or ``None`` where
    that path does not apply or fails in any way (:func:`_jpeg_header`; a libjpeg warning counts)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    header = _jpeg_header(path, channels)
    if header is None:
        return None
    data, height, width = header
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # libjpeg's warnings of corrupt data
            warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29 points to TorchCodec
            read = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
            x = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=read)
    except Exception:  # noqa: BLE001 - Pillow decodes the file or says why not
        return None
    return x if tuple(x.shape) == (channels, height, width) else None


def decode_pixels(path: str, channels: int) -> torch.Tensor:
    """The image file ``path`` as uint8 pixels ``(channels, H, W)``, by the fastest decoder that gives
    Pillow's pixels (:func:`_fast_jpeg`, else Pillow and :func:`image_to_channels`).

    A file that cannot be read is a :class:`UserError` naming it (size, pixel and format checks of
    :func:`~.inputs.open_image`)."""
    x = _fast_jpeg(path, channels)
    if x is not None:
        return x
    try:
        with open_image(path) as im:
            img = image_to_channels(im, channels)
    except InputError as exc:
        raise UserError(f"cannot read image {path}: {exc}") from None
    return pil_to_pixels(img)


def pil_to_pixels(img: Any) -> torch.Tensor:
    """A PIL ``L`` or ``RGB`` image -> uint8 ``(C, H, W)`` (a writable copy, no numpy array interface)."""
    w, h = img.size
    return torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(h, w, -1).permute(2, 0, 1)


def sample_seed(seed: int, epoch: int, index: int, train: bool) -> int:
    """The seed of one example's augmentation: a pure function of the run's seed, the epoch and the index."""
    return int(np.random.SeedSequence([seed, epoch, index, int(train)]).generate_state(1)[0])


@dataclass(frozen=True)
class CropParams:
    """One training example's random crop box (in the decoded image's pixels) and flip."""

    top: int
    left: int
    height: int
    width: int
    flip: bool


SCALE, RATIO = (0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0)  # RandomResizedCrop's defaults (the paper's recipe)


def draw_crop(height: int, width: int, flip: bool) -> CropParams:
    """A crop box and flip drawn from the global torch RNG, as ``RandomResizedCrop`` then
    ``RandomHorizontalFlip`` draw them (torchvision's own ``get_params``; an expanded 1-element tensor
    stands for an image of that size without allocating it)."""
    from torchvision import transforms as T

    shape = torch.empty(1, 1, 1).expand(1, height, width)
    top, left, h, w = T.RandomResizedCrop.get_params(shape, list(SCALE), list(RATIO))
    return CropParams(top, left, h, w, bool(torch.rand(1) < 0.5) if flip else False)


def train_crop_params(seed: int, epoch: int, index: int, height: int, width: int, flip: bool) -> CropParams:
    """Example ``index``'s crop box and flip in ``epoch`` of an image of ``height x width``: what
    :class:`ImageFolderData` with a :class:`TrainCrop` applies, for a device-side pipeline to apply too."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sample_seed(seed, epoch, index, True))
        return draw_crop(height, width, flip)


class TrainCrop:
    """The training augmentation on uint8 pixels ``(C, H, W)`` -> ``(C, size, size)`` uint8: a random
    resized crop (bilinear, antialiased), a random left-right flip when ``flip``, then ImageNet AutoAugment
    when ``autoaugment``. Random numbers come from the global torch RNG, which :class:`ImageFolderData`
    seeds per example. Picklable (DataLoader workers)."""

    def __init__(self, size: int, flip: bool, autoaugment: bool = False) -> None:
        self.size, self.flip, self.autoaugment = size, flip, autoaugment

    def apply(self, x: torch.Tensor, p: CropParams) -> torch.Tensor:
        """``x`` cropped to ``p``'s box, resized to ``size`` and flipped as ``p`` says (no AutoAugment)."""
        from torchvision.transforms.v2 import functional as F

        x = F.resized_crop(x, p.top, p.left, p.height, p.width, [self.size, self.size], antialias=True)
        return x.flip(-1) if p.flip else x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self.apply(x, draw_crop(x.shape[-2], x.shape[-1], self.flip))
        if self.autoaugment:
            from torchvision import transforms as T

            x = T.AutoAugment(T.AutoAugmentPolicy.IMAGENET)(x)
        return x


class EvalPixels:
    """An evaluation transform of PIL images (resize, centre crop) on uint8 pixels ``(C, H, W)``: the
    pixels of ``repmlp predict``'s transform before its ``ToTensor``/``Normalize`` (the loader does those
    on the device, with the same float operations). Picklable."""

    def __init__(self, pil_transform: Callable) -> None:
        self.pil_transform = pil_transform

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from PIL import Image

        c, h, w = x.shape
        arr = x.permute(1, 2, 0).numpy()
        img = Image.fromarray(arr[:, :, 0] if c == 1 else arr, "L" if c == 1 else "RGB")
        return pil_to_pixels(self.pil_transform(img))


def device_crop_batch(
    images: Sequence[torch.Tensor], params: Sequence[CropParams], size: int
) -> torch.Tensor:
    """Uint8 images ``[(C, H_i, W_i)]`` (on any device) -> float ``(B, C, size, size)`` in 0..255: each
    cropped to its box, resized (bilinear, antialiased, in float) and flipped, as :meth:`TrainCrop.apply`
    does on the CPU in uint8 (the two differ by the uint8 rounding, at most 1 per pixel)."""
    out = []
    for x, p in zip(images, params, strict=True):
        crop = x[None, :, p.top : p.top + p.height, p.left : p.left + p.width].float()
        crop = torch.nn.functional.interpolate(
            crop, size=(size, size), mode="bilinear", align_corners=False, antialias=True
        )
        out.append(crop.flip(-1) if p.flip else crop)
    return torch.cat(out)


class ImageFolderData(torch.utils.data.Dataset):
    """Decodes one image per item; items are ``(index, epoch)`` so augmentation is seeded per sample.

    Seeding each sample's transform from ``(seed, epoch, index)`` makes the augmented batch independent of
    worker count and process history, which is what makes a resumed run identical to an uninterrupted one.
    Images are decoded (:func:`decode_pixels`) to ``channels`` (1: greyscale, 3: RGB) whatever their mode,
    and ``transform`` maps those uint8 pixels ``(C, H, W)`` to the example's uint8 ``(C, size, size)``
    (:class:`TrainCrop`, :class:`EvalPixels`). Returns ``(pixels, label)``.

    With ``raw_jpeg`` (the device pipeline, training without AutoAugment), a JPEG that the fast decoder
    takes is returned undecoded: ``((file bytes uint8 (N,), CropParams, index, epoch), label)``, for
    :func:`device_crop_batch` to crop after a batched decode on the device.
    """

    def __init__(
        self, samples: list[tuple[str, int]], transform: Callable, seed: int, train: bool, channels: int = 3
    ) -> None:
        self.samples, self.transform, self.seed, self.train = samples, transform, seed, train
        self.channels = channels
        self.raw_jpeg = False

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: tuple[int, int]) -> tuple[Any, int]:
        index, epoch = item
        path, label = self.samples[index]
        if self.raw_jpeg:
            raw = self._raw_jpeg(index, epoch)
            if raw is not None:
                return raw, label
        x = decode_pixels(path, self.channels)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, epoch, index, self.train))
            return self.transform(x), label

    def _raw_jpeg(self, index: int, epoch: int) -> tuple[torch.Tensor, CropParams, int, int] | None:
        """A JPEG's bytes and crop for the device pipeline, or ``None`` for the CPU path (other formats,
        JPEGs the fast decoder would not take)."""
        header = _jpeg_header(self.samples[index][0], self.channels)
        if header is None:
            return None
        data, height, width = header
        params = train_crop_params(self.seed, epoch, index, height, width, self.transform.flip)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), params, index, epoch

    def cpu_item(self, index: int, epoch: int) -> torch.Tensor:
        """Example ``index`` of ``epoch`` by the CPU path (a file the device decoder refused)."""
        raw, self.raw_jpeg = self.raw_jpeg, False
        try:
            return self[(index, epoch)][0]
        finally:
            self.raw_jpeg = raw
