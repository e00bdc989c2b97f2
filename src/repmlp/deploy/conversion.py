"""Convert a training-time model and check it against that model: the one check behind ``repmlp convert``
(:func:`convert_file`), the end of every training run and the speed tables (:func:`convert_and_check`).

With a file, the deployed form is written and loaded back into a fresh ``deploy=True`` model (the check
covers the file a deployment reads). Both forms run in full float32 (no autocast, no TF32, whose rounding
would hide or fake a conversion error); each caller judges :func:`compare_outputs` with its own tolerance.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from repmlp.data import build_data, model_data_config
from repmlp.deploy.precision import native_support, to_precision
from repmlp.errors import UserError, first_line
from repmlp.io import model_file
from repmlp.io.model_file import CheckpointError, ModelMetadata
from repmlp.models import check_forward
from repmlp.nn import convert as nn_convert
from repmlp.numerics import full_float32

__all__ = ["CONVERSION_RTOL", "OutputDiff", "compare_outputs", "DeployedFile", "Conversion",
           "convert_and_check", "default_output", "convert_file"]  # fmt: skip

log = logging.getLogger(__name__)

CONVERSION_RTOL = 1e-4  # max |diff| / max |output| of an equivalent conversion (float32 rounding)


@dataclass
class OutputDiff:
    """How far a converted model's outputs are from the training-time model's (:func:`compare_outputs`)."""

    max_abs_diff: float  # max |output - reference|
    max_reference: float  # max |reference|: the output scale
    # Positions whose argmax over dim 1 differs: images of logits (N, K), pixels of score maps (N, K, H, W).
    changed_predictions: int

    @property
    def max_rel_diff(self) -> float:
        """``max_abs_diff`` relative to the output scale (NaN outputs give NaN: never within a tolerance)."""
        return self.max_abs_diff / max(self.max_reference, 1e-12)

    def as_dict(self) -> dict[str, float]:
        """``{"max_abs_diff", "max_rel_diff", "changed_predictions"}`` (a run's report and metrics)."""
        return {"max_abs_diff": self.max_abs_diff, "max_rel_diff": self.max_rel_diff,
                "changed_predictions": self.changed_predictions}  # fmt: skip


def compare_outputs(reference: Tensor, output: Tensor) -> OutputDiff:
    """How far ``output`` is from ``reference`` (logits ``(N, K)``, embeddings ``(N, D)``, score maps
    ``(N, K, H, W)``), in float64: the comparison adds no rounding of its own."""
    ref, out = reference.detach().double(), output.detach().double()
    changed = int((ref.argmax(1) != out.argmax(1)).sum()) if ref.dim() >= 2 else 0
    return OutputDiff((ref - out).abs().max().item(), ref.abs().max().item(), changed)


@dataclass
class DeployedFile:
    """Where and as what :func:`convert_and_check` writes the deployed model (``save_model``'s arguments)."""

    path: Path
    name: str
    model_kwargs: dict[str, Any]
    extra: dict[str, Any] | None = None


@dataclass
class Conversion:
    """What :func:`convert_and_check` returns."""

    deployed: nn.Module  # the converted model; loaded back from the file when one was written
    reference: Tensor  # the training-time model's (first) outputs, (N, ...)
    outputs: Tensor  # the deployed model's, the same shape
    diff: OutputDiff  # compare_outputs(reference, outputs)
    seconds: float  # how long reparameterize_model took


def convert_and_check(model: nn.Module, inputs: Tensor | Callable[[nn.Module], Tensor], *,
                      file: DeployedFile | None = None,
                      device: str | torch.device | None = None) -> Conversion:  # fmt: skip
    """Convert ``model`` (eval mode; a copy), optionally write the deployed ``file`` and load it back onto
    ``device`` (default: the model's), and run both forms in inference mode and full float32 on ``inputs``:
    a batch ``(N, C, H, W)`` on the model's device, or a function ``run(model) -> outputs`` (e.g. logits
    ``(N, K)`` of a validation set), called for the training-time model first; of a tuple of outputs the
    first is compared. A written file that does not load into ``create_model(name, deploy=True)`` is a
    :class:`UserError`.
    """
    run = inputs if not isinstance(inputs, Tensor) else (lambda m: m(inputs))
    with torch.inference_mode(), full_float32():
        reference = _first(run(model))
    start = time.perf_counter()
    # Looked up at each call: tests replace the conversion with a broken one to see the check fail.
    deployed = nn_convert.reparameterize_model(model)
    seconds = time.perf_counter() - start
    if file is not None:
        device = model_file.device_of(model) if device is None else device
        deployed = _write_and_reload(model, deployed, file, device)
    with torch.inference_mode(), full_float32():
        outputs = _first(run(deployed))
    return Conversion(deployed, reference, outputs, compare_outputs(reference, outputs), seconds)


def _write_and_reload(model: nn.Module, deployed: nn.Module, file: DeployedFile,
                      device: str | torch.device) -> nn.Module:  # fmt: skip
    """``deployed`` written to ``file`` and loaded back on ``device``; converted again without folding the
    BatchNorms when the registered ``deploy=True`` model keeps some (timm's models know no ``deploy=``)."""
    for fuse_bn in (True, False):
        if not fuse_bn:
            log.info("deploy=True %s keeps some BatchNorms; converting without folding them", file.name)
            deployed = nn_convert.reparameterize_model(model, fuse_bn=False)
        try:  # save_model refuses weights that do not fit the deploy=True model, as load_model would
            model_file.save_model(file.path, deployed, name=file.name, model_kwargs=file.model_kwargs,
                                  form="deploy", extra=file.extra)  # fmt: skip
            return model_file.load_model(file.path, device=device, form="deploy")
        except CheckpointError as exc:
            error = exc
    raise UserError(f"the deployed {file.name} does not load into create_model({file.name!r}, deploy=True): "
                    f"{error}")  # fmt: skip


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


# ------------------------------------------------------------------------------ model file -> file
def default_output(checkpoint: Path, precision: str = "fp32") -> Path:
    """``deploy.safetensors`` beside a run's ``model.safetensors``, else ``<name>-deploy.safetensors``;
    ``deploy-<precision>`` in a reduced precision."""
    stem = "deploy" if checkpoint.name == "model.safetensors" else f"{checkpoint.stem}-deploy"
    return checkpoint.with_name(stem + ("" if precision == "fp32" else f"-{precision}") + ".safetensors")


def _images(meta: ModelMetadata, split: str, n: int, img_size: int | None, dataset: str | None,
            data_dir: str | None) -> tuple[list[Tensor], str]:  # fmt: skip
    """``([(<= n, C, H, W), ...], name)``: the first ``n`` images of ``split`` (``"val"``: one batch;
    ``"train"``: batches of <= 64) of ``dataset`` (else the file's), read as ``repmlp eval`` reads them for
    the file's model (``meta``). No data set known, one that cannot be loaded, or images of another size:
    :class:`UserError`."""
    name = dataset or meta.extra.get("dataset")
    if not name:
        raise UserError("the checkpoint names no data set")
    val = {"need_train": False, "val_limit": n, "eval_batch_size": n}
    sizes = val if split == "val" else {"train_limit": n, "batch_size": min(n, 64)}
    # The model's own size unless --img-size (a model that takes any size and records none: its default).
    size = img_size or meta.input_size[1]
    data = build_data(model_data_config(meta, name, data_dir=data_dir, img_size=size, workers=0, **sizes))
    batches = [x.float() for x, _ in getattr(data, split).batches(0)]
    got, want = tuple(batches[0].shape[1:]), tuple(meta.input_size_at(img_size))
    if got != want:
        raise UserError(f"the images of {name} are {got}, the model takes {want}")
    return batches, name


def _check_inputs(meta: ModelMetadata, n: int, img_size: int | None, dataset: str | None,
                  data_dir: str | None) -> tuple[Tensor, str]:  # fmt: skip
    """``((n, C, H, W), where they come from)``: the run's validation images, else seeded noise. A data set
    the user named must load; one the file records falls back to noise with a warning (it may live on
    another machine)."""
    try:
        (x, *_), name = _images(meta, "val", n, img_size, dataset, data_dir)
        return x, f"{len(x)} {name} validation images"
    except UserError as exc:
        msg = str(exc)
        if dataset:
            raise UserError(msg if msg.startswith("--dataset") else f"--dataset {dataset}: {msg}") from None
        recorded = meta.extra.get("dataset")
        if recorded:
            log.warning("cannot load the run's data set %s (%s); checking on random inputs", recorded, msg)
    why = "the run's data set could not be loaded" if recorded else "no data set known"
    x = torch.randn(n, *meta.input_size_at(img_size), generator=torch.Generator().manual_seed(0))
    return x, f"{n} random inputs ({why})"


def _reduce_precision(deployed: nn.Module, precision: str, x: Tensor,
                      calibration: list[Tensor] | None) -> tuple[nn.Module, float, float]:  # fmt: skip
    """``deployed`` (float32, verified) in ``precision``, its max abs logit change and changed-argmax share."""
    reason = native_support(precision)
    if reason:
        log.warning("%s", reason)
    with torch.inference_mode(), full_float32():
        ref = deployed(x).float()
    try:
        reduced = to_precision(copy.deepcopy(deployed), precision, calibration, input_size=tuple(x.shape[1:]))
        with torch.inference_mode(), full_float32():  # the reduced model without autocast: its own dtype
            out = reduced(x).float()
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        raise UserError(
            f"--precision {precision}: this machine cannot run the model in {precision} ({first_line(exc)})"
        ) from None
    if not torch.isfinite(out).all():
        raise UserError(f"--precision {precision}: the model's outputs overflow in {precision}")
    changed = (out.argmax(1) != ref.argmax(1)).float().mean().item() if out.dim() == 2 else float("nan")
    return reduced, (out - ref).abs().max().item(), changed


def convert_file(checkpoint: Path, output: Path, *, precision: str = "fp32",
                 tolerance: float = CONVERSION_RTOL, num_examples: int = 64, img_size: int | None = None,
                 dataset: str | None = None, data_dir: str | None = None,
                 calibration_examples: int = 512) -> str:  # fmt: skip
    """Convert the training-time ``checkpoint``, check it (:func:`convert_and_check` on the run's validation
    images or noise) and write it in ``precision`` as ``output``, atomically; returns what ``repmlp convert``
    prints. A difference above ``tolerance * max(1, max |output|)`` is a :class:`UserError` and nothing is
    written. int8 calibrates on the run's training images."""
    model = model_file.load_model(checkpoint, device="cpu")
    meta = model.metadata
    if meta.form != "train":  # the training-time file of its run beside it, else the one it records
        source = checkpoint.with_name("model.safetensors")
        source = source if source.is_file() else Path(meta.extra.get("converted_from", source))
        raise UserError(f"{checkpoint} is already a deployed checkpoint of {meta.name}: convert the training-time "
                        f"model file it came from instead (--checkpoint {source})")  # fmt: skip
    input_size = meta.input_size_at(img_size)
    check_forward(model, input_size, meta.name)  # a size the model does not take: one line
    x, source = _check_inputs(meta, num_examples, img_size, dataset, data_dir)
    calibration = None
    if precision == "int8":
        try:
            calibration, _ = _images(meta, "train", calibration_examples, img_size, dataset, data_dir)
        except UserError as exc:
            raise UserError(f"--precision int8 needs calibration data of the run's training images ({exc}); "
                            "pass --dataset and --data-dir of its training data") from None  # fmt: skip
    # The source's resolved preprocessing: every precision reads images as the training-time file does.
    extra = {**meta.extra, "eval_preprocessing": meta.preprocessing["eval_preprocessing"],
             "converted_from": str(checkpoint)}  # fmt: skip
    with model_file.staged(output) as tmp:  # the real name appears only once the file passed the check
        check = convert_and_check(model, x, file=DeployedFile(tmp, meta.name, meta.model_kwargs, extra))
        err, allowed = check.diff.max_abs_diff, tolerance * max(1.0, check.diff.max_reference)
        if not err <= allowed:
            raise UserError(f"deployed model differs from the training-time model by {err:.3g} on {source} "
                            f"(allowed {allowed:.3g}); {output} not written")  # fmt: skip
        params = [sum(p.numel() for p in m.parameters()) / 1e6 for m in (check.deployed, model)]
        lines = [f"wrote {output} ({meta.name}, deployed form, {precision}, {params[0]:.3f}M params; "
                 f"training-time {params[1]:.3f}M)", f"max abs error deployed vs training-time: {err:.3e} "
                 f"(max |output| {check.diff.max_reference:.3g}) on {source}"]  # fmt: skip
        if precision != "fp32":
            reduced, change, changed = _reduce_precision(check.deployed, precision, x, calibration)
            extra.setdefault("input_size", list(input_size))  # an int8 graph has no registry config to tell
            model_file.save_model(tmp, reduced, name=meta.name, model_kwargs=meta.model_kwargs, form="deploy",
                                  extra=extra, precision=precision)  # fmt: skip
            model_file.load_model(tmp, form="deploy")  # the file must load back
            lines.append(
                f"{precision}: max abs logit change vs float32 deployed {change:.3e}, "
                f"{100 * changed:.2f}% of predictions changed on {source}; file {tmp.stat().st_size} bytes"
            )
    return "\n".join(lines)
