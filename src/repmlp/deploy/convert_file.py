"""A training-time model file -> a verified deployed model file (``repmlp convert``, paper Sec. 3.4).

Every RepMLP block becomes FC1, FC2 and FC3 (Local Perceptron and BatchNorms merged in), every conv-BN
pair one conv. The deployed file is written only after it has been loaded back into a freshly built
``deploy=True`` model and that model's outputs matched the training-time model's on real inputs
(:func:`repmlp.deploy.conversion.convert_and_check`): a batch of the run's validation data when the file
names its data set (or ``dataset`` is given), otherwise random inputs. Data are read for the file's model
as ``repmlp eval`` reads them (:func:`repmlp.data.for_model.model_data_config`). A reduced precision
(bf16, fp16, int8) is applied to the verified model.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from repmlp.errors import UserError, first_line
from repmlp.nn.numerics import full_float32

if TYPE_CHECKING:
    from repmlp.data import Data
    from repmlp.io.model_file import ModelMetadata

__all__ = ["Converted", "convert_checkpoint", "default_output", "check_inputs", "calibration_batches"]

log = logging.getLogger(__name__)


@dataclass
class Converted:
    """What :func:`convert_checkpoint` wrote and measured."""

    output: Path
    model: str
    precision: str
    params_train: int
    params_deploy: int
    max_error: float  # |deployed - training-time|, max over the check inputs
    max_output: float  # max |training-time output|
    source: str  # where the check inputs came from
    precision_error: float | None = None  # max |reduced - float32 deployed| logit change
    changed: float | None = None  # share of predictions the reduced precision changed


def default_output(checkpoint: Path) -> Path:
    if checkpoint.name == "model.safetensors":
        return checkpoint.with_name("deploy.safetensors")
    return checkpoint.with_name(f"{checkpoint.stem}-deploy.safetensors")


def _data_for(
    meta: ModelMetadata, name: str, data_dir: str | None, img_size: int | None, **options: Any
) -> Data:
    """``name`` read for the file's model as ``repmlp eval`` reads it (:func:`repmlp.data.for_model.
    model_data_config`: its channels, input size and normalisation)."""
    from repmlp.data import build_data
    from repmlp.data.for_model import model_data_config

    # At the size the check runs at: the model's own unless --img-size (a model that takes any size and
    # records none: its default, not the data set's).
    size = img_size or meta.input_size[1]
    return build_data(model_data_config(meta, name, data_dir=data_dir, img_size=size, workers=0, **options))


def check_inputs(
    meta: ModelMetadata,
    n: int,
    *,
    img_size: int | None = None,
    dataset: str | None = None,
    data_dir: str | None = None,
) -> tuple[Tensor, str]:
    """``(n, C, H, W)`` inputs for the equivalence check of the file's model (``meta``, at ``img_size``,
    default its own) and a description of where they come from.

    Real validation images when a data set is known (``dataset`` or the one the file records) and loadable
    for the model (:func:`_data_for`); else standard-normal noise (seeded). A data set the user named
    explicitly that cannot be loaded is a :class:`UserError`; one only recorded in the file falls back to
    noise with a warning (the data may live on another machine).
    """
    input_size = meta.input_size_at(img_size)
    name = dataset or meta.extra.get("dataset")
    if name:
        try:
            data = _data_for(meta, name, data_dir, img_size, need_train=False, val_limit=n, eval_batch_size=n)
            x, _ = next(iter(data.val.batches(0)))
            if tuple(x.shape[1:]) != tuple(input_size):
                raise UserError(f"its images are {tuple(x.shape[1:])}, the model takes {tuple(input_size)}")
            return x.float(), f"{len(x)} {name} validation images"
        except UserError as exc:
            if dataset:
                msg = str(exc)
                raise UserError(
                    msg if msg.startswith("--dataset") else f"--dataset {dataset}: {msg}"
                ) from None
            log.warning("cannot load the run's data set %s (%s); checking on random inputs", name, exc)
    gen = torch.Generator().manual_seed(0)
    why = "the run's data set could not be loaded" if name else "no data set known"
    return torch.randn(n, *input_size, generator=gen), f"{n} random inputs ({why})"


def calibration_batches(
    meta: ModelMetadata,
    n: int,
    *,
    img_size: int | None = None,
    dataset: str | None = None,
    data_dir: str | None = None,
) -> list[Tensor]:
    """The first ``n`` training images of the run's data set (``dataset``, else the one the file records)
    read for the file's model (``meta``) as ``repmlp eval`` reads it, in batches ``(<= 64, C, H, W)``.

    No data set known, or one that cannot be loaded, is a :class:`UserError`: int8 ranges calibrated
    on noise would be wrong for real images.
    """
    name = dataset or meta.extra.get("dataset")
    if not name:
        raise UserError(
            "--precision int8 needs calibration data: the checkpoint names no data set; pass --dataset "
            "(and --data-dir) of the training data"
        )
    try:
        data = _data_for(meta, name, data_dir, img_size, train_limit=n, batch_size=min(n, 64))
        batches = [x.float() for x, _ in data.train.batches(0)]
    except UserError as exc:
        raise UserError(f"--precision int8: cannot load calibration data ({exc})") from None
    input_size = meta.input_size_at(img_size)
    if tuple(batches[0].shape[1:]) != tuple(input_size):
        raise UserError(
            f"--precision int8: the calibration images of {name} are {tuple(batches[0].shape[1:])}, the "
            f"model takes {tuple(input_size)}; pass --dataset and --data-dir of its training data"
        )
    return batches


def _reduce_precision(
    deployed: nn.Module, precision: str, x: Tensor, calibration: list[Tensor] | None
) -> tuple[nn.Module, float, float]:
    """``deployed`` (float32, verified) in ``precision``; its max abs logit change and changed-argmax share."""
    from repmlp.deploy.precision import native_support, to_precision

    reason = native_support(precision)
    if reason:
        log.warning("%s", reason)
    # The float32 reference in full float32; the reduced model without autocast (its own dtype).
    with torch.inference_mode(), full_float32():
        ref = deployed(x).float()
    try:
        reduced = to_precision(copy.deepcopy(deployed), precision, calibration, input_size=tuple(x.shape[1:]))
        with torch.inference_mode(), full_float32():
            out = reduced(x).float()
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        first = first_line(exc)
        raise UserError(
            f"--precision {precision}: this machine cannot run the model in {precision} ({first})"
        ) from None
    if not torch.isfinite(out).all():
        raise UserError(f"--precision {precision}: the model's outputs overflow in {precision}")
    err = (out - ref).abs().max().item()
    changed = (out.argmax(1) != ref.argmax(1)).float().mean().item() if out.dim() == 2 else float("nan")
    return reduced, err, changed


def convert_checkpoint(
    checkpoint: Path,
    output: Path | None = None,
    *,
    precision: str = "fp32",
    tolerance: float = 1e-4,
    num_examples: int = 64,
    img_size: int | None = None,
    dataset: str | None = None,
    data_dir: str | None = None,
    calibration_examples: int = 512,
) -> Converted:
    """Convert, verify and write (atomically) the deployed form of the training-time ``checkpoint``.

    ``output`` defaults to :func:`default_output`. The check runs the training-time and the reloaded
    deployed model on :func:`check_inputs`; a difference above ``tolerance * max(1, max |output|)`` is a
    :class:`UserError` and nothing is written.
    """
    from repmlp.deploy.conversion import DeployedFile, convert_and_check
    from repmlp.io.model_file import load_model
    from repmlp.models.registry import check_forward

    output = output or default_output(checkpoint)
    model = load_model(checkpoint, device="cpu")
    meta = model.metadata
    if meta.form != "train":
        # What to convert instead: the training-time file of its run beside it, else the one it records.
        source = checkpoint.with_name("model.safetensors")
        if not source.is_file() and meta.extra.get("converted_from"):
            source = Path(meta.extra["converted_from"])
        raise UserError(
            f"{checkpoint} is already a deployed checkpoint of {meta.name}: convert the training-time model "
            f"file it came from instead (--checkpoint {source})"
        )
    input_size = meta.input_size_at(img_size)
    check_forward(model, input_size, meta.name)  # a size the model does not take: one line
    x, source = check_inputs(meta, num_examples, img_size=img_size, dataset=dataset, data_dir=data_dir)
    calibration = None
    if precision == "int8":
        calibration = calibration_batches(meta, calibration_examples, img_size=img_size, dataset=dataset,
                                          data_dir=data_dir)  # fmt: skip
    extra = {**meta.extra, "converted_from": str(checkpoint)}
    output.parent.mkdir(parents=True, exist_ok=True)
    # Stage in the output's folder; the real name appears only once the file has passed the check.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        check = convert_and_check(model, x, file=DeployedFile(tmp, meta.name, meta.model_kwargs, extra))
        reloaded, err, largest = check.deployed, check.diff.max_abs_diff, check.diff.max_reference
        if not err <= tolerance * max(1.0, largest):
            raise UserError(
                f"deployed model differs from the training-time model by {err:.3g} on {source} "
                f"(allowed {tolerance * max(1.0, largest):.3g}); {output} not written"
            )
        result = Converted(output, meta.name, precision, _params(model), _params(reloaded), err, largest,
                           source)  # fmt: skip
        if precision != "fp32":
            reduced, result.precision_error, result.changed = _reduce_precision(reloaded, precision, x,
                                                                                calibration)  # fmt: skip
            # An int8 graph has no registry config left to tell its input size: record it.
            extra.setdefault("input_size", list(input_size))
            _save(tmp, reduced, meta, extra, precision)
            load_model(tmp, form="deploy")  # the file must load back
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return result


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _save(path: Path, model: nn.Module, meta: ModelMetadata, extra: dict[str, Any], precision: str) -> None:
    from repmlp.io.model_file import save_model

    save_model(path, model, name=meta.name, model_kwargs=meta.model_kwargs, form="deploy", extra=extra,
               precision=precision)  # fmt: skip
