"""How a data set is read for a model file: in the file's channels, at its input size, with its normalisation.

:func:`model_data_config` is the one place that decides how ``repmlp eval`` and ``repmlp convert`` (its check
batch and its int8 calibration images) read a data set for a model file, so that every command sees the
pixels the model was trained on; ``repmlp train --init`` gives an image folder the same preprocessing
(:func:`folder_preprocessing`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from repmlp.data import NATIVE_SIZE, NORMALIZATION, DataConfig

if TYPE_CHECKING:
    from repmlp.io.model_file import ModelMetadata

__all__ = ["folder_preprocessing", "model_data_config"]


def folder_preprocessing(
    recorded: Mapping[str, Any] | None, dataset: str | None, channels: int
) -> dict | None:
    """The evaluation preprocessing (timm cfg keys; ``mean``/``std`` of ``channels`` values) an image folder
    gets for a model file whose ``extra`` records ``recorded`` (its ``eval_preprocessing``) and ``dataset``.

    The file's own when it records one; for a model of an in-memory data set (Fashion-MNIST, CIFAR-10), the
    image resized to the input size (as ``repmlp predict`` does) and that data set's normalisation; ``None``
    (resize, centre crop, ImageNet's mean/std) else.
    """
    if recorded:
        out = {
            k: recorded[k] for k in ("crop_pct", "crop_mode", "interpolation", "mean", "std") if k in recorded
        }
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


def model_data_config(meta: ModelMetadata, dataset: str, *, data_dir: str | None = None,
                      img_size: int | None = None, **options: Any) -> DataConfig:  # fmt: skip
    """How to read ``dataset`` for the model of a file (``meta``, its ``ModelMetadata``).

    ``data_dir`` defaults to the folder the file records when ``dataset`` is the one it was trained on. The
    images come in the model's channels, at ``img_size`` (default: the model's own square side, its
    ``img_size`` option or recorded input size), with :func:`folder_preprocessing`'s resize and
    normalisation; at another size only the normalisation is kept (the resize and crop were for its own
    size). ``options``: the other :class:`~repmlp.data.DataConfig` fields (limits, batch sizes, workers).
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
        pre = folder_preprocessing(extra.get("eval_preprocessing"), extra.get("dataset"), channels or 3)
        if pre and size != own:
            pre = {k: pre[k] for k in ("mean", "std")}
    return DataConfig(dataset=dataset, data_dir=data_dir, img_size=size, channels=channels,
                      eval_preprocessing=pre, **options)  # fmt: skip
