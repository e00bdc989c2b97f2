"""Classification data: Fashion-MNIST (IDX), CIFAR-10 (torchvision's layout) and ImageNet-style folders.

:func:`build_data` returns train and validation loaders (:mod:`.loader`) and what a model needs to know
(classes, channels, resolution). The folder also holds the face and Cityscapes formats and the bounded
reading of the user's files (:mod:`.inputs`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
from torchvision import transforms as T

from repmlp.data.cifar import load_cifar10
from repmlp.data.fashion_mnist import CLASSES as FMNIST_CLASSES
from repmlp.data.fashion_mnist import find_fashion_mnist, load_fashion_mnist
from repmlp.data.folder import (
    EvalPixels,
    GpuTrainBatch,
    ImageFolderData,
    TrainCrop,
    scan_image_folder,
    stratified_subset,
)
from repmlp.data.loader import FolderLoader, InMemoryLoader
from repmlp.errors import UserError

__all__ = ["DATASETS", "DataConfig", "Data", "build_data", "NORMALIZATION", "NATIVE_SIZE",
           "folder_eval_transform", "folder_eval_pixels", "GpuTrainBatch", "PixelEvalTransform", "eval_preprocessing",
           "PREPROCESSING_KEYS", "model_data_config"]  # fmt: skip

log = logging.getLogger(__name__)

DATASETS = ("fashion-mnist", "cifar10", "imagefolder")
NATIVE_SIZE = {"fashion-mnist": 28, "cifar10": 32}  # the in-memory data sets' (a model may pad to more)
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
NORMALIZATION = {
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "imagefolder": (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
}
PREPROCESSING_KEYS = ("crop_pct", "crop_mode", "interpolation", "mean", "std")  # timm cfg keys
# What a model file that records no evaluation preprocessing and no in-memory data set is read with.
FOLDER_PREPROCESSING = {"crop_pct": 0.875, "crop_mode": "center", "interpolation": "bilinear",
                        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD}  # fmt: skip
_MAX_PADDED_BYTES = 4 << 30  # an in-memory data set zero-padded to --img-size


@dataclass
class DataConfig:
    """What :func:`build_data` needs; ``batch_size`` is per process."""

    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    download: bool = False
    batch_size: int = 128
    eval_batch_size: int = 512
    train_limit: int | None = None
    val_limit: int | None = None
    seed: int = 0
    pad: int = 0  # random-crop padding (in-memory data sets)
    flip: bool = False
    autoaugment: bool = False  # image folders only
    img_size: int | None = None  # image folders: train crop / eval centre crop; in memory: zero-pad to it
    # Image folders: the evaluation preprocessing (timm cfg keys crop_pct, crop_mode, interpolation, mean,
    # std; None: size/0.875, centre crop, ImageNet's), the channels (None: 3), the training normalisation.
    eval_preprocessing: dict[str, Any] | None = None
    channels: int | None = None
    mean: Sequence[float] | None = None
    std: Sequence[float] | None = None
    workers: int | None = None  # image folders: decoding processes (None: one per usable CPU core)
    channels_last: bool = False
    need_train: bool = True
    # Image folders on CUDA: decode the training JPEGs on the GPU (nvJPEG), crop, flip and normalise there.
    gpu_decode: bool | None = None


@dataclass
class Data:
    train: InMemoryLoader | FolderLoader | None
    val: InMemoryLoader | FolderLoader
    num_classes: int
    in_chans: int
    img_size: int
    classes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how the examples were chosen, for the report
    eval_preprocessing: dict[str, Any] | None = None  # :func:`eval_preprocessing`'s (in model files)


def _limit(n: int | None, what: str, total: int) -> int:
    if n is None:
        return total
    if n < 1:
        raise UserError(f"{what} must be at least 1, got {n}")
    return min(n, total)


def build_data(cfg: DataConfig, *, rank: int = 0, world: int = 1, device: torch.device | str = "cpu") -> Data:
    """Load ``cfg.dataset`` and wrap its splits in loaders for this rank."""
    if cfg.dataset not in DATASETS:
        raise UserError(f"unknown dataset {cfg.dataset!r} (choose from {', '.join(DATASETS)})")
    if cfg.dataset == "imagefolder":
        return _build_folder(cfg, rank, world, device)
    if cfg.autoaugment:
        raise UserError("--autoaugment is supported with --dataset imagefolder only")
    wanted = (True, False) if cfg.need_train else (False,)
    if cfg.dataset == "fashion-mnist":
        folder = find_fashion_mnist(cfg.data_dir, cfg.download)
        log.info("Fashion-MNIST from %s", folder)
        splits, classes = {s: load_fashion_mnist(folder, train=s) for s in wanted}, FMNIST_CLASSES
    else:
        if cfg.data_dir is None:
            raise UserError("--dataset cifar10 needs --data-dir DIR, the folder holding cifar-10-batches-py "
                            "(--download fetches Fashion-MNIST only; torchvision.datasets.CIFAR10(DIR, "
                            "download=True) creates that folder)")  # fmt: skip
        splits, classes = {s: load_cifar10(cfg.data_dir, train=s) for s in wanted}, CIFAR10_CLASSES
    _check_in_memory(cfg, splits)
    mean, std = NORMALIZATION[cfg.dataset]

    def loader(train: bool, limit: int | None, what: str, batch: int) -> InMemoryLoader:
        images, labels = splits[train]
        n = _limit(limit, what, len(labels))
        return InMemoryLoader(pad_to(torch.from_numpy(images[:n].copy()), cfg.img_size),
                              torch.from_numpy(labels[:n].copy()), batch_size=batch, train=train,
                              pad=cfg.pad if train else 0, flip=cfg.flip and train, mean=mean, std=std,
                              seed=cfg.seed, rank=rank, world=world, device=device,
                              channels_last=cfg.channels_last)  # fmt: skip

    train = loader(True, cfg.train_limit, "--train-limit", cfg.batch_size) if cfg.need_train else None
    val = loader(False, cfg.val_limit, "--val-limit", cfg.eval_batch_size)
    c, size = val.images.shape[1:3]
    pre = eval_preprocessing(None, cfg.dataset, c)  # what a model file of the run records
    return Data(train, val, len(classes), c, size, list(classes), eval_preprocessing=pre)


def _check_in_memory(cfg: DataConfig, splits: dict[bool, tuple[Any, Any]]) -> None:
    """``--pad`` at most the image side, and an ``--img-size`` whose zero-padded copy fits in memory."""
    images = next(iter(splits.values()))[0]
    c, h, w = images.shape[1:]
    if cfg.pad > max(h, w):
        raise UserError(f"--pad {cfg.pad} is larger than the data set's {h}x{w} images (at most {max(h, w)})")
    if cfg.img_size is not None:
        n = sum(len(imgs) for imgs, _ in splits.values())
        largest = int((_MAX_PADDED_BYTES / max(1, n * c)) ** 0.5)
        if n * c * cfg.img_size**2 > _MAX_PADDED_BYTES:
            raise UserError(
                f"--img-size {cfg.img_size} would zero-pad the {n} {h}x{w} images to "
                f"{n * c * cfg.img_size**2 / 2**30:.0f} GiB in memory; at most {largest} for this data set"
            )


def folder_eval_transform(size: int, preprocessing: dict[str, Any] | None = None) -> Callable:
    """An image folder's evaluation transform (``repmlp eval`` and ``predict``), PIL image -> normalised
    ``(C, size, size)``: timm's eval transform with ``preprocessing`` (:func:`eval_preprocessing`'s keys;
    ``None``: an image folder's default): resize to ``floor(size / crop_pct)``, crop ``size``, normalise."""
    pre = preprocessing or eval_preprocessing(None, None, 3)
    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in pre.items() if k in PREPROCESSING_KEYS}
    return create_transform((3, size, size), is_training=False, **opts)


_TO_TENSOR = ("ToTensor", "MaybeToTensor")  # torchvision's and timm's


def folder_eval_pixels(size: int, preprocessing: dict[str, Any] | None = None) -> tuple[Callable, list, list]:
    """:func:`folder_eval_transform` as ``(PIL -> PIL resize and crop, mean, std)``: the loader normalises on
    the device, as ``ToTensor`` and ``Normalize`` would."""
    full = folder_eval_transform(size, preprocessing)
    steps = list(full.transforms)
    to_tensor, normalize = steps[-2:]
    if not isinstance(normalize, T.Normalize) or type(to_tensor).__name__ not in _TO_TENSOR:
        raise TypeError(f"unexpected evaluation transform (not ... ToTensor, Normalize): {full}")
    mean, std = (
        torch.as_tensor(v, dtype=torch.float32).flatten().tolist() for v in (normalize.mean, normalize.std)
    )
    return T.Compose(steps[:-2]), mean, std


class PixelEvalTransform:
    """An in-memory data set's evaluation transform of a PIL image, as its loader does it: resized (bilinear)
    to the data set's ``native`` size, zero-padded to ``img_size``, ``/ 255``, ``(x - mean) / std``. In two
    steps, so a batch is normalised at once: :meth:`pixels` and :meth:`normalize`. Picklable."""

    def __init__(self, dataset: str, img_size: int | None) -> None:
        self.native, self.img_size = NATIVE_SIZE[dataset], img_size
        mean, std = NORMALIZATION[dataset]
        self.mean = torch.tensor(mean, dtype=torch.float32).reshape(1, len(mean), 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).reshape(1, len(std), 1, 1)

    def pixels(self, img: Image.Image) -> np.ndarray:
        """A PIL image (in the model's channels) -> ``(native, native, C)`` uint8."""
        if img.size != (self.native, self.native):
            img = img.resize((self.native, self.native), Image.BILINEAR)
        return np.frombuffer(bytearray(img.tobytes()), dtype=np.uint8).reshape(img.size[1], img.size[0], -1)

    def normalize(self, batch: torch.Tensor) -> torch.Tensor:
        """``(N, C, h, w)`` uint8 -> the model's normalised float32 input ``(N, C, H, W)``."""
        return (pad_to(batch, self.img_size).float().div_(255.0) - self.mean) / self.std

    def __call__(self, img: Image.Image) -> torch.Tensor:
        return self.normalize(torch.from_numpy(self.pixels(img)).permute(2, 0, 1)[None])[0]


def pad_to(images: torch.Tensor, size: int | None) -> torch.Tensor:
    """Zero-pad ``(N, C, H, W)`` evenly to ``size x size`` (``None``: unchanged): a 32x32 model on 28x28
    Fashion-MNIST, whose black background makes the border add nothing."""
    if size is None:
        return images
    h, w = images.shape[-2:]
    if size < max(h, w):
        raise UserError(f"--img-size {size} is smaller than the data set's {h}x{w} images (it only pads)")
    top, left = (size - h) // 2, (size - w) // 2
    return torch.nn.functional.pad(images, (left, size - w - left, top, size - h - top))


def _folder_limit(samples: list[tuple[str, int]], limit: int | None, flag: str, seed: int, notes: list[str],
                  what: str) -> list[tuple[str, int]]:  # fmt: skip
    """``limit`` examples of a split: a seeded stratified subset (classes keep their shares), in ``notes``."""
    n = _limit(limit, flag, len(samples))
    if n >= len(samples):
        return samples
    keep = stratified_subset([label for _, label in samples], n, seed)
    classes = len({samples[i][1] for i in keep})
    notes.append(
        f"{what}: a seeded stratified subset ({flag} {n} of {len(samples)} images, seed {seed}, "
        f"{classes} of {len({label for _, label in samples})} classes)"
    )
    return [samples[i] for i in keep]


def _build_folder(cfg: DataConfig, rank: int, world: int, device: torch.device | str) -> Data:
    """An image folder's loaders: uint8 pixels decoded in ``cfg.workers`` processes, normalised on ``device``
    (CUDA with ``cfg.gpu_decode``: JPEGs decoded and cropped there, :class:`GpuTrainBatch`)."""
    if cfg.data_dir is None:
        raise UserError("--dataset imagefolder needs --data-dir (a folder with train/ and val/ sub-folders)")
    size, channels = cfg.img_size or 224, cfg.channels or 3
    # The evaluation normalises as the training does (one value per channel): recorded in model files.
    given = {k: v for k, v in (("mean", cfg.mean), ("std", cfg.std)) if v}
    pre = eval_preprocessing({**(cfg.eval_preprocessing or {}), **given}, None, channels)
    mean, std = pre["mean"], pre["std"]
    train_samples, classes = scan_image_folder(cfg.data_dir, "train") if cfg.need_train else (None, None)
    val_samples, val_classes = scan_image_folder(cfg.data_dir, "val", classes)
    classes = classes or val_classes
    eval_pil, eval_mean, eval_std = folder_eval_pixels(size, pre)
    common = dict(seed=cfg.seed, rank=rank, world=world, workers=cfg.workers, device=device,
                  channels_last=cfg.channels_last)  # fmt: skip
    notes: list[str] = []
    train = None
    if cfg.need_train:
        train_samples = _folder_limit(
            train_samples, cfg.train_limit, "--train-limit", cfg.seed, notes, "training"
        )
        dataset = ImageFolderData(
            train_samples, TrainCrop(size, cfg.flip, cfg.autoaugment), cfg.seed, True, channels
        )
        on_gpu = bool(cfg.gpu_decode) and torch.device(device).type == "cuda" and not cfg.autoaugment
        dataset.raw_jpeg = on_gpu
        train = FolderLoader(dataset, batch_size=cfg.batch_size, train=True, mean=mean, std=std,
                             on_device=GpuTrainBatch(dataset) if on_gpu else None, **common)  # fmt: skip
    val_samples = _folder_limit(val_samples, cfg.val_limit, "--val-limit", cfg.seed, notes, "validation")
    val_data = ImageFolderData(val_samples, EvalPixels(eval_pil), cfg.seed, False, channels)
    val = FolderLoader(val_data, batch_size=cfg.eval_batch_size, train=False, mean=eval_mean, std=eval_std,
                       **common)  # fmt: skip
    for note in notes:
        log.info("%s", note)
    return Data(train, val, len(classes), channels, size, classes, notes, pre)


def eval_preprocessing(recorded: Mapping[str, Any] | None, dataset: str | None, channels: int) -> dict:
    """The evaluation preprocessing of a model file whose ``extra`` records ``recorded`` (its
    ``eval_preprocessing``) and ``dataset``, as every command reads images for it: timm cfg keys
    (:data:`PREPROCESSING_KEYS`), each the file's own, else its in-memory data set's (the image resized to
    the input size, as ``repmlp predict`` does, and the data set's normalisation), else an image folder's
    default (:data:`FOLDER_PREPROCESSING`). ``mean``/``std`` hold ``channels`` values: the first ones, or
    one value for every channel (ImageNet's three never broadcast over a one-channel image)."""
    base = FOLDER_PREPROCESSING
    if dataset in NATIVE_SIZE:
        mean, std = NORMALIZATION[dataset]
        base = {"crop_pct": 1.0, "crop_mode": "squash", "interpolation": "bilinear", "mean": mean, "std": std}
    own = {k: v for k, v in (recorded or {}).items() if k in PREPROCESSING_KEYS and v is not None}
    out = {**base, **own}
    for key in ("mean", "std"):
        values = [float(v) for v in (out[key] if isinstance(out[key], (list, tuple)) else [out[key]])]
        out[key] = values[:channels] if len(values) >= channels else values[:1] * channels
    return out


class ModelFields(Protocol):
    """What :func:`model_data_config` reads of a model file's metadata (``load_model(path).metadata``)."""

    model_kwargs: dict[str, Any]
    input_size: tuple[int, int, int]
    extra: dict[str, Any]


def model_data_config(meta: ModelFields, dataset: str, *, data_dir: str | None = None,
                      img_size: int | None = None, **options: Any) -> DataConfig:  # fmt: skip
    """How ``repmlp eval`` and ``repmlp convert`` (its check batch, its int8 calibration) read ``dataset`` for
    the model of a file (``meta``), so that every command sees the pixels the model was trained on.

    ``data_dir`` defaults to the folder the file records when ``dataset`` is the one it was trained on. The
    images come in the model's channels, at ``img_size`` (default: the model's own square side), with
    :func:`eval_preprocessing`'s resize and normalisation (at another size only its normalisation).
    ``options``: the other :class:`DataConfig` fields (limits, batch sizes, workers).
    """
    extra = meta.extra
    if data_dir is None and dataset == extra.get("dataset"):
        data_dir = extra.get("data_dir")
    own = meta.model_kwargs.get("img_size")
    if own is None and isinstance(extra.get("input_size"), Sequence) and len(extra["input_size"]) == 3:
        own = extra["input_size"][1]
    own = own[0] if isinstance(own, (list, tuple)) else own  # a (H, W) option: square images here
    own = int(own) if isinstance(own, int) else None
    size = img_size or own
    channels = meta.input_size[0] if meta.input_size[0] in (1, 3) else None
    pre = None
    if dataset == "imagefolder":
        pre = eval_preprocessing(extra.get("eval_preprocessing"), extra.get("dataset"), channels or 3)
        if size != own:
            pre = {k: pre[k] for k in ("mean", "std")}
    return DataConfig(dataset=dataset, data_dir=data_dir, img_size=size, channels=channels,
                      eval_preprocessing=pre, **options)  # fmt: skip
