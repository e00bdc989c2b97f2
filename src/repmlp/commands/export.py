"""``repmlp export``: a checkpoint's deployed model as ONNX (checked with onnxruntime), TorchScript and/or a
``torch.export`` program (``.pt2``, loaded back with ``torch.export.load`` and checked).

A training-time checkpoint is converted first (the file is not changed); the exported graph is always
the deployed one: FC1, FC2 and FC3 per RepMLP block, no BatchNorm, no Local Perceptron. It holds float32
weights, also from a bf16/fp16 file (ONNX Runtime's CPU provider runs no bf16 convolution), and says so:
``deploy-bf16.safetensors`` exports to ``deploy-bf16-as-fp32.onnx`` by default.
"""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

from repmlp.commands._common import add_force_argument, check_output_file, number_in
from repmlp.deploy.export import (
    ExportError,
    export_onnx,
    export_program,
    export_torchscript,
    missing_onnx_packages,
    write_int8_onnx,
)
from repmlp.errors import UserError
from repmlp.io.model_file import load_model, read_metadata
from repmlp.models import check_forward
from repmlp.nn.convert import reparameterize_model
from repmlp.tasks.limits import MAX_SIDE, ints

log = logging.getLogger(__name__)

_SUFFIX = {"onnx": ".onnx", "torchscript": ".pt", "exported-program": ".pt2"}
# What each format's check compares with PyTorch.
_CHECKED_BY = {"onnx": "onnxruntime", "torchscript": "TorchScript", "exported-program": "torch.export.load"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint", required=True, type=Path, help="model checkpoint (.safetensors), either form"
    )
    p.add_argument("--format", choices=("onnx", "torchscript", "exported-program", "both"), default="onnx",
                   help="what to write (both: onnx and torchscript; exported-program: torch.export's "
                   ".pt2)")  # fmt: skip
    p.add_argument("--output", type=Path, default=None, help="output file (its suffix is replaced per format with "
                   "--format both); default: the checkpoint's path with .onnx / .pt / .pt2, deploy.* for a run's "
                   "model.safetensors, NAME-as-fp32.* for a bf16/fp16 file (float32 weights)")  # fmt: skip
    add_force_argument(p)
    p.add_argument("--img-size", type=number_in(ints(1, MAX_SIDE)), default=None, help="(default: the run's)")
    p.add_argument(
        "--opset", type=number_in(ints(7, 100)), default=None, help="ONNX opset (default: the exporter's)"
    )
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")


def output_paths(checkpoint: Path, output: Path | None, fmt: str, precision: str = "fp32") -> dict[str, Path]:
    """Where each requested format goes. The deployed model is what is exported: a run's ``model.safetensors``
    defaults to ``deploy.*``, the name of the run's own ``deploy.onnx`` (refused as existing, not duplicated).
    A bf16/fp16 file's export holds float32 weights: by default it is named so (``deploy-bf16-as-fp32.onnx``)."""
    formats = ("onnx", "torchscript") if fmt == "both" else (fmt,)
    if output is not None and len(formats) == 1:
        return {formats[0]: output}
    base = checkpoint.with_name("deploy") if checkpoint.name == "model.safetensors" else checkpoint
    if output is None and precision in ("bf16", "fp16"):
        base = base.with_name(f"{base.stem}-as-fp32{base.suffix}")
    return {f: (output or base).with_suffix(_SUFFIX[f]) for f in formats}


def run(args: argparse.Namespace) -> int:
    paths = output_paths(
        args.checkpoint, args.output, args.format, read_metadata(args.checkpoint).get("precision")
    )
    for fmt, path in paths.items():
        if path.suffix.lower() != _SUFFIX[fmt]:
            raise UserError(f"--output {path}: --format {fmt} writes a {_SUFFIX[fmt]} file (name it so, or pick "
                            "the --format of that name)")  # fmt: skip
        check_output_file(path, [args.checkpoint], force=args.force)
    model = load_model(args.checkpoint, device="cpu")
    meta = model.metadata
    input_size = meta.input_size_at(args.img_size)
    if meta.precision == "int8":
        if "onnx" not in paths or len(paths) > 1:
            raise UserError(
                "an int8 checkpoint holds an onnxruntime graph: it exports to ONNX only (--format onnx)"
            )
        try:
            write_int8_onnx(model, paths["onnx"], input_size)
        except ExportError as exc:
            raise UserError(str(exc)) from None
        print(f"wrote {paths['onnx']} ({meta.name}, deployed, int8 QDQ ONNX as stored in the checkpoint)")
        return 0
    missing = missing_onnx_packages() if "onnx" in paths else []
    if missing:
        raise UserError(f"ONNX export needs {', '.join(missing)}: pip install 'repmlp[export]'")
    # Every format is written in float32 (ONNX Runtime's CPU provider runs no bf16 Conv): the line says so.
    weights = f"float32 weights of the {meta.precision} file's values, " if meta.precision != "fp32" else ""
    if meta.form == "train":
        log.info("converting the training-time model of %s to its deployed form", meta.name)
        model = reparameterize_model(model)
    check_forward(model, input_size, meta.name)
    size = "x".join(str(s) for s in input_size)
    for fmt, path in paths.items():
        try:
            if fmt == "onnx":
                diff = export_onnx(model, path, input_size, check=not args.no_check, opset_version=args.opset,
                                   force=args.force)  # fmt: skip
            else:
                diff = (export_program if fmt == "exported-program" else export_torchscript)(
                    model, path, input_size
                )
        except ExportError as exc:
            raise UserError(f"{fmt} export failed, {path} left unchanged: {exc}") from None
        how = (
            "not checked"
            if math.isnan(diff)
            else f"{_CHECKED_BY[fmt]} vs PyTorch max diff {diff:.2e} of the output scale"
        )
        print(f"wrote {path} ({meta.name}, deployed, {weights}input Nx{size}; {how})")
    return 0
