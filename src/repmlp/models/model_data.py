"""The data a model takes: how a data set is read for a model file, and a model name's own input.

:func:`model_data_config` is the one place that decides how ``repmlp eval``, ``repmlp convert`` (its check
batch and its int8 calibration images) read a data set for a model file: in the file's channels, at its
input size, with its normalisation (:func:`folder_preprocessing`), so that every command sees the pixels
the model was trained on. ``repmlp train`` gives an image folder the same preprocessing when it fine-tunes
from a file (``--init``), and a model name's own input size and channels (:func:`default_input`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from repmlp.data import NATIVE_SIZE, NORMALIZATION, DataConfig

if TYPE_CHECKING:
    from repmlp.models.model_file import ModelMetadata

__all__ = ["folder_preprocessing", "model_data_config", "default_input", "own_img_size"]

_EVAL_KEYS = ("crop_pct", "crop_mode", "interpolation", "mean", "std")


def folder_preprocessing(
    recorded: Mapping[str, Any] | None, dataset: str | None, channels: int
) -> dict | None:
    """The evaluation preprocessing (timm cfg keys, ``mean``/``std`` of ``channels`` values) an image folder
    gets for a model file whose ``extra`` records ``recorded`` (its ``eval_preprocessing``) and ``dataset``.

    The file's own when it records one (an imported or image-folder model); for a model of an in-memory
    data set (Fashion-MNIST, CIFAR-10), the image resized to the input size (as ``repmlp predict`` does)
    and that data set's normalisation; ``None`` (resize, centre crop, ImageNet's mean/std) else.
    """
    if recorded:
        out = {k: recorded[k] for k in _EVAL_KEYS if k in recorded}
    elif dataset in NATIVE_SIZE:
        mean, std = NORMALIZATION[dataset]
        out = {"crop_pct": 1.0, "crop_mode": "squash", "interpolation": "bilinear", "mean": mean, "std": std}
    else:
        return None
    mean, std = NORMALIZATION["imagefolder"]
    out["mean"] = [float(v) for v in (out.get("mean") or mean)][:channels]
    out["std"] = [float(v) for v in (out.get("std") or std)][:channels]
    if len(out["mean"]) != channels or len(out["std"]) != channels:  # one value for three channels
        out["mean"], out["std"] = out["mean"][:1] * channels, out["std"][:1] * channels
    return out


def own_img_size(meta: ModelMetadata) -> int | None:
    """The square side a model file's model takes: its ``img_size`` option, else the input size its file
    records; ``None`` for a model that takes any size and records none (it gets the data set's own)."""
    size = meta.model_kwargs.get("img_size")
    if size is None:
        recorded = meta.extra.get("input_size")
        size = recorded[1] if isinstance(recorded, Sequence) and len(recorded) == 3 else None
    if isinstance(size, (list, tuple)):  # a (H, W) pair in a model's options: square images here
        size = size[0]
    return int(size) if isinstance(size, int) else None


def model_data_config(
    meta: ModelMetadata,
    dataset: str,
    *,
    data_dir: str | None = None,
    img_size: int | None = None,
    **options: Any,
) -> DataConfig:
    """How to read ``dataset`` for the model of a file (``meta``, :class:`~repmlp.models.model_file.ModelMetadata`).

    ``data_dir`` defaults to the folder the file records when ``dataset`` is the one it was trained on.
    The images come in the model's channels (an image folder's converted to them, a greyscale model's to
    ``L``), at ``img_size`` (default :func:`own_img_size`), with :func:`folder_preprocessing`'s resize and
    normalisation; at another size than the model's own only its normalisation is kept (the resize and
    crop it records were for its own size). ``options``: the other :class:`~repmlp.data.DataConfig` fields
    (limits, batch sizes, workers, ``need_train``)."""
    extra = meta.extra
    if data_dir is None and dataset == extra.get("dataset"):
        data_dir = extra.get("data_dir")
    own = own_img_size(meta)
    size = img_size or own
    channels = meta.input_size[0]
    channels = channels if channels in (1, 3) else None
    pre = None
    if dataset == "imagefolder":
        pre = folder_preprocessing(extra.get("eval_preprocessing"), extra.get("dataset"), channels or 3)
        if pre and size != own:
            pre = {k: pre[k] for k in ("mean", "std")}
    return DataConfig(dataset=dataset, data_dir=data_dir, img_size=size, channels=channels,
                      eval_preprocessing=pre, **options)  # fmt: skip


def default_input(name: str, model_args: Mapping[str, Any] | None = None) -> tuple[int, int, int] | None:
    """``(C, H, W)`` model ``name`` takes when built with ``model_args``: its ``in_chans``/``img_size``
    options, else its registered (repmlp) or timm default config's input size; ``None`` when neither
    knows (a torchvision model)."""
    from repmlp.models.registry import is_model, model_default_cfg

    source, _, bare = name.rpartition(":")
    size: Sequence[int] | None = None
    if source in ("", "repmlp") and is_model(bare):
        size = model_default_cfg(bare).get("input_size")
    elif source in ("", "timm"):
        import timm

        cfg = timm.models.get_pretrained_cfg(bare) if timm.is_model(bare) else None
        size = getattr(cfg, "input_size", None)
    if not size:
        return None
    c, h, w = (int(s) for s in size)
    args = model_args or {}
    c = args["in_chans"] if isinstance(args.get("in_chans"), int) else c
    given = args.get("img_size")
    if isinstance(given, int):
        h = w = given
    elif isinstance(given, (list, tuple)) and len(given) == 2:
        h, w = (int(s) for s in given)
    return c, h, w
