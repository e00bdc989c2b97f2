"""Training recipes (presets): the paper's CIFAR and ImageNet settings and the fast Fashion-MNIST default.

A preset fills every training option the user did not give. The paper's settings (Sec. 4.1, 4.2):

- CIFAR-10: batch 128, cosine learning rate 0.2 -> 0 over 100 epochs, padding to 40x40 + random 32x32
  crop + left-right flip (SGD; momentum and weight decay are not stated, we use 0.9 and 1e-4).
- ImageNet: global batch 256, SGD momentum 0.9, weight decay 1e-4, cosine 0.1 -> 0 over 100 epochs,
  mixup, AutoAugment, random (resized) crop + flip; single centre crop for evaluation.
- fmnist (ours): the 5-minute CPU job that ``repmlp train`` runs by default.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from repmlp.data import eval_preprocessing
from repmlp.data.folder import IMG_EXTENSIONS
from repmlp.data.inputs import not_regular, open_image, walk_files
from repmlp.errors import UserError
from repmlp.models.registry import get_pretrained_cfg, resolve_model
from repmlp.tasks.finetune import init_preprocessing

__all__ = ["Recipe", "PRESETS", "DEFAULT_PRESET", "preset_for_model", "folder_batch_size", "folder_lr",
           "folder_recipe", "model_input"]  # fmt: skip

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """The training options a preset sets (:class:`~repmlp.tasks.classification.TrainConfig`'s defaults are
    ``PRESETS["fmnist"]``). The defaults are what the paper's two recipes share (SGD with momentum 0.9 and
    weight decay 1e-4, a cosine schedule to zero, flips; no warm-up, label smoothing, mixup or padding)."""

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
    # The patch stem (rather than repmlp_fmnist's) halves the stages' resolution, so that five epochs fit in
    # five minutes on the slowest 2-core CPU, at the same accuracy (docs/main-job.md).
    "fmnist": Recipe(model="repmlp_fmnist_patch2", epochs=5, batch_size=256, lr=0.2, nesterov=True,
                     weight_decay=5e-5, warmup_epochs=0.5, label_smoothing=0.1, channels_last=True),
    "cifar": Recipe(model="repmlp_cifar", epochs=100, batch_size=128, lr=0.2, pad=4),
    "imagenet": Recipe(model="repmlp_res50", epochs=100, batch_size=256, lr=0.1, mixup=0.2, autoaugment=True,
                       img_size=224),
}  # fmt: skip

# The preset a data set gets when --preset is not given (an image folder's run of a known model, or with
# --init, takes that model's own instead: preset_for_model).
DEFAULT_PRESET = {"fashion-mnist": "fmnist", "cifar10": "cifar", "imagefolder": "imagenet"}

# An image folder's run without --batch-size: the preset's batch, halved until an epoch has at least this
# many steps (else a small folder gets one or two steps an epoch), but not below FOLDER_MIN_BATCH (BatchNorm's
# statistics need a few images); the training images are counted up to FOLDER_COUNT_STEPS batches.
FOLDER_MIN_STEPS, FOLDER_MIN_BATCH, FOLDER_COUNT_STEPS = 10, 8, 16
# A folder's run without --model or --preset: images up to this side train the `cifar` preset's small model
# at their size, larger ones the `imagenet` preset's at 224x224 (preset_for_model's line between the two).
SMALL_IMAGES = 64


def preset_for_model(
    model: str, input_size: Sequence[int] | None, dataset: str | None = None
) -> tuple[str, str]:
    """``(preset, why)``: the recipe an image folder's run of ``model`` takes without ``--preset``: the preset
    built for it (``repmlp_res50``: ``imagenet``), else that of the in-memory data set it was trained on
    (``dataset``, an ``--init`` file's), else the one for inputs like its ``input_size`` ``(C, H, W)``: small
    greyscale ones ``fmnist``, small ones ``cifar``, others ``imagenet``. ``why`` says which, for the log."""
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
    """The peak learning rate for a batch fitted down from the recipe's ``batch`` to ``fitted``: ``lr`` scaled by
    ``sqrt(fitted / batch)``, the square-root rule (the linear rule slows a short fine-tuning run down:
    docs/using.md)."""
    return round(lr * math.sqrt(fitted / batch), 6) if fitted < batch else lr


def folder_recipe(options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """An image folder's new run: ``(preset, values)`` of its :class:`~repmlp.tasks.classification.TrainConfig`
    not in ``options`` (those given win), said in one log line. The input (channels, size, normalisation) is
    the ``init`` file's, else the model's own (:func:`model_input`); without ``preset`` the recipe is the
    model's (:func:`preset_for_model`), and without ``batch_size`` its batch is fitted to the folder's size
    (:func:`folder_batch_size`, :func:`folder_lr`)."""
    init, preset, name = options.get("init"), options.get("preset"), options.get("model")
    said, side = [], None
    if not (name or preset):  # a model that fits the images: a small one at their size, else the paper's
        side = options.get("img_size") or _first_image_side(options.get("data_dir"))
        side = side if side and side <= SMALL_IMAGES else None
        name = PRESETS["cifar" if side else "imagenet"].model
        fits = f"for {side}x{side} images" if side else f"for images over {SMALL_IMAGES}x{SMALL_IMAGES}"
        said.append(f"model {name} ({fits}; --model picks another)")
    name = name or PRESETS[preset or "imagenet"].model
    size, whose, basis, values = _folder_input(
        name, options.get("model_args", {}), init, options.get("img_size")
    )
    if side and "img_size" not in options:  # a multiple of 4 (its stages halve it twice), at least its own
        values["img_size"], whose = max(side // 4 * 4, 32), "to fit the images"
    preset, why = (preset, "--preset") if preset else preset_for_model(*basis)
    recipe = PRESETS[preset]
    said.append(f"recipe {preset} ({why})")
    if size:
        img = options.get("img_size") or values.get("img_size") or recipe.img_size
        said.append(
            f"input {values['channels']}x{img}x{img}" + ("" if "img_size" in options else f" ({whose})")
        )
    at_most = min(options.get("train_limit") or math.inf, recipe.batch_size * FOLDER_COUNT_STEPS)
    n = _count_images(options.get("data_dir"), at_most) if "batch_size" not in options else None
    if n:
        values["batch_size"] = batch = folder_batch_size(recipe.batch_size, n)
        capped = n >= recipe.batch_size * FOLDER_COUNT_STEPS and n != options.get("train_limit")
        more = "at least " if capped else ""  # the count stopped there: the folder may hold more
        said.append(f"batch {batch} ({more}{max(1, n // batch)} steps an epoch on {more}{n} training images)")
        if batch < recipe.batch_size and "lr" not in options:
            values["lr"] = lr = folder_lr(recipe.lr, recipe.batch_size, batch)
            said.append(f"lr {lr:.3g} (the recipe's {recipe.lr:g} x sqrt({batch}/{recipe.batch_size}))")
    log.info("image folder: %s; options given on the command line win", ", ".join(said))
    return preset, values


def _folder_input(
    name: str, model_args: dict[str, Any], init: str | None, img_size: int | None
) -> tuple[list[int] | None, str, tuple, dict[str, Any]]:  # fmt: skip
    """``(input_size, whose, preset_for_model's arguments, values)`` of an image folder's run of model ``name``
    or of the ``init`` file: its channels (1 or 3), its size unless ``img_size`` is given, and the ``init``
    file's recorded normalisation and evaluation resize."""
    if init:
        pre = init_preprocessing(init)
        size, whose, flag = pre["input_size"], "the --init file's", f"--init {init}"
        basis, hint = (pre["model"], size, pre["dataset"]), "pass --model to train another model from scratch"
    else:
        size = model_input(name, model_args)  # None: a model without a known input (torchvision's)
        whose, flag, basis = f"{name}'s", name, (name, size, None)
        hint = "pass --model-arg in_chans=1 or in_chans=3"
    values: dict[str, Any] = {}
    if size:
        c, h, w = size
        if c not in (1, 3):
            raise UserError(f"{flag} takes {c}-channel images, but image folders give 1 (greyscale) or 3 (RGB): "
                            f"{hint}")  # fmt: skip
        values["channels"] = c
        if img_size is None and h != w and init:
            raise UserError(f"--init {init} takes {h}x{w} images: pass --img-size (image folders are square)")
        if img_size is None and h == w:
            values["img_size"] = h
    # What `repmlp eval` reads a folder with for the init file: its normalisation and evaluation resize
    # (without --init the folder's default, not the model's config: it was not trained on these images).
    if init:
        evaluation = eval_preprocessing(pre["eval_preprocessing"], pre["dataset"], values.get("channels", 3))
        values.update(eval_preprocessing=evaluation, mean=evaluation["mean"], std=evaluation["std"])
    return size, whose, basis, values


def model_input(name: str, model_args: dict[str, Any] | None) -> tuple[int, int, int] | None:
    """``(C, H, W)`` model ``name`` takes with ``model_args``: their ``in_chans``/``img_size``, else its timm
    config's input size; ``None`` when no config knows (a torchvision model)."""
    try:
        source, bare = resolve_model(name)
    except ValueError:
        return None
    size = getattr(get_pretrained_cfg(bare), "input_size", None) if source != "torchvision" else None
    if not size:
        return None
    args = model_args or {}
    c, h, w = (int(s) for s in size)
    given = args.get("img_size")
    h, w = (given, given) if isinstance(given, int) else given if isinstance(given, (list, tuple)) else (h, w)
    return (args["in_chans"] if isinstance(args.get("in_chans"), int) else c), int(h), int(w)


def _first_image_side(data_dir: str | None) -> int | None:
    """The shorter side of the first training image of image folder ``data_dir`` (its header read); ``None``
    when there is none to read (building the data then says what is wrong)."""
    if not data_dir:
        return None
    try:
        train = Path(os.path.expanduser(data_dir)) / "train"
        first = min(d for d in train.iterdir() if not d.name.startswith(".") and not_regular(d) == "a folder")
        with open_image(walk_files(first, IMG_EXTENSIONS)[0][0]) as im:
            return min(im.size)
    except (OSError, ValueError, IndexError):  # InputError is a ValueError
        return None


def _count_images(data_dir: str | None, at_most: float) -> int | None:
    """The training images of image folder ``data_dir``, counted up to ``at_most``; ``None`` when the folder
    cannot be read (building the data then says what is wrong)."""
    if not data_dir:
        return None
    n = 0
    try:
        for folder in sorted((Path(os.path.expanduser(data_dir)) / "train").iterdir()):
            if not folder.name.startswith(".") and not_regular(folder) == "a folder":
                n += len(walk_files(folder, IMG_EXTENSIONS)[0])
                if n >= at_most:
                    break
    except OSError:
        return None
    return int(min(n, at_most)) or None
