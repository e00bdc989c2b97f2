"""Convert a training-time model and check the result against it: the one check behind ``repmlp convert``,
the end of every training run (classification, face, segmentation) and the speed tables.

:func:`convert_and_check` converts the model (:func:`repmlp.nn.convert.reparameterize_model`), optionally
writes the deployed model file and loads it back into a freshly built ``deploy=True`` model (so the check
covers the file a deployment reads, not the object in memory), and runs both forms on the same inputs in
full float32 (:func:`repmlp.nn.numerics.full_float32`: no autocast, no TF32, whose rounding would hide or
fake a conversion error). :func:`compare_outputs` measures how far apart the two forms' outputs are; each
caller judges that with its own tolerance (:data:`CONVERSION_RTOL` of the output scale, or
``repmlp convert --tolerance``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from repmlp.errors import UserError
from repmlp.io.model_file import device_of

__all__ = [
    "CONVERSION_RTOL",
    "OutputDiff",
    "compare_outputs",
    "DeployedFile",
    "Conversion",
    "convert_and_check",
]

log = logging.getLogger(__name__)

# A conversion is exact up to float32 rounding: converted outputs within this share of the largest
# training-time output (max |diff| / max |output|) are equivalent.
CONVERSION_RTOL = 1e-4


@dataclass
class OutputDiff:
    """How far a converted model's outputs are from the training-time model's (see :func:`compare_outputs`)."""

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
        return {
            "max_abs_diff": self.max_abs_diff,
            "max_rel_diff": self.max_rel_diff,
            "changed_predictions": self.changed_predictions,
        }


def compare_outputs(reference: Tensor, output: Tensor) -> OutputDiff:
    """How far ``output`` is from ``reference`` (the same shape: logits ``(N, K)``, embeddings ``(N, D)``,
    score maps ``(N, K, H, W)``), computed in float64 so that the comparison adds no rounding of its own."""
    ref, out = reference.detach().double(), output.detach().double()
    changed = int((ref.argmax(1) != out.argmax(1)).sum()) if ref.dim() >= 2 else 0
    return OutputDiff((ref - out).abs().max().item(), ref.abs().max().item(), changed)


@dataclass
class DeployedFile:
    """Where and as what :func:`convert_and_check` writes the deployed model: the arguments of
    :func:`repmlp.io.model_file.save_model` (``form="deploy"``, float32)."""

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


def convert_and_check(
    model: nn.Module,
    inputs: Tensor | Callable[[nn.Module], Tensor],
    *,
    file: DeployedFile | None = None,
    device: str | torch.device | None = None,
) -> Conversion:
    """Convert ``model``, optionally write the deployed file and load it back, and compare both forms.

    Args:
        model: the training-time model in eval mode (converted as a copy: it is not changed).
        inputs: a batch ``(N, C, H, W)`` on the model's device that both forms run on, or a function
            ``run(model) -> outputs`` that runs a model over inputs of its own (e.g. a whole validation set,
            giving logits ``(N, K)``), called for the training-time model first, then for the deployed one.
            Either way each form runs inside ``torch.inference_mode()`` and full float32; of a tuple of
            outputs the first is compared.
        file: write the deployed form there (:class:`DeployedFile`) and load it back with
            ``load_model(form="deploy")`` onto ``device`` (default: the model's). Every BatchNorm is
            folded unless the registered ``deploy=True`` model keeps some (timm's models that know nothing
            of ``deploy=``): then the model is converted again without folding and written over it.

    Returns:
        :class:`Conversion`: the deployed model, both forms' outputs and their :class:`OutputDiff`. Whether
        the difference is small enough is the caller's to judge (e.g. ``diff.max_rel_diff`` against
        :data:`CONVERSION_RTOL`): this function fails only when the file loads into no ``deploy=True`` model.

    Raises:
        UserError: the written file does not load into ``create_model(name, deploy=True)``.
    """
    from repmlp.nn.numerics import full_float32

    run = inputs if not isinstance(inputs, Tensor) else (lambda m: m(inputs))
    with torch.inference_mode(), full_float32():
        reference = _first(run(model))
    if file is None:
        deployed, seconds = _convert(model, {})
    else:
        deployed, seconds = _write_and_reload(model, file, device_of(model) if device is None else device)
    with torch.inference_mode(), full_float32():
        outputs = _first(run(deployed))
    return Conversion(deployed, reference, outputs, compare_outputs(reference, outputs), seconds)


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _convert(model: nn.Module, options: dict[str, Any]) -> tuple[nn.Module, float]:
    """``(reparameterize_model(model, **options), seconds)``."""
    # Looked up at each call: tests replace the conversion with a broken one to see the check fail.
    from repmlp.nn.convert import reparameterize_model

    start = time.perf_counter()
    deployed = reparameterize_model(model, **options)
    return deployed, time.perf_counter() - start


def _write_and_reload(
    model: nn.Module, file: DeployedFile, device: str | torch.device
) -> tuple[nn.Module, float]:
    """The deployed form written to ``file.path`` and loaded back into ``create_model(..., deploy=True)``
    on ``device``, and the conversion's seconds."""
    from repmlp.io.model_file import CheckpointError, load_model, save_model

    for fuse_bn in (True, False):
        deployed, seconds = _convert(model, {"fuse_bn": fuse_bn})
        save_model(file.path, deployed, name=file.name, model_kwargs=file.model_kwargs, form="deploy",
                   extra=file.extra)  # fmt: skip
        try:
            return load_model(file.path, device=device, form="deploy"), seconds
        except CheckpointError as exc:
            if not fuse_bn:
                raise UserError(
                    f"the deployed {file.name} does not load into create_model({file.name!r}, deploy=True): {exc}"
                ) from None
            log.info("deploy=True %s keeps some BatchNorms; converting without folding them", file.name)
    raise AssertionError("unreachable")
