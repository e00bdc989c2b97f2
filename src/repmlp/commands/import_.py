"""``repmlp import``: a released checkpoint (.pth) -> a repmlp model file (.safetensors).

Reads the authors' RepMLP-Res50 files (Bottleneck or Light; training-time or converted), the authors'
RepMLPNet files (training-time or locality-injected) and mmpretrain's RepMLPNet (``backbone.`` and
``head.fc.`` keys under ``state_dict``), nested under ``model``/``state_dict`` or not, with or without
DDP's ``module.`` prefix. Only tensors and plain containers are unpickled (``weights_only=True``): a file
that would run code is refused and nothing is written. Every key must map onto the model and every
weight of the model must come from the file. The output takes ``eval``, ``convert``, ``export``,
``bench`` and ``viz`` like a file ``repmlp train`` wrote; it records the evaluation preprocessing the
weights were published with (resize, crop, interpolation, mean/std).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from repmlp.commands._common import add_force_argument, check_output_file, model_arg, model_name
from repmlp.errors import UserError
from repmlp.io.importer import import_to_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="the .pth file (authors' or mmpretrain's)")
    p.add_argument("--model", required=True, type=model_name,
                   help="registered model it holds: repmlpnet_b256, repmlp_res50_light, ...")  # fmt: skip
    p.add_argument("--output", required=True, type=Path, help="model file to write (.safetensors)")
    add_force_argument(p)
    p.add_argument("--model-arg", type=model_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="model option the file was built with, VALUE as JSON (e.g. --model-arg img_size=320); "
                   "repeatable")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    out: Path = args.output
    if out.suffix != ".safetensors":
        raise UserError(f"--output {out}: repmlp model files end in .safetensors")
    check_output_file(out, [args.checkpoint], force=args.force)
    result = import_to_file(args.checkpoint, args.model, dict(args.model_arg), out)
    params = sum(p.numel() for p in result["model"].parameters())
    print(f"imported {args.checkpoint.name} ({result['layout']} layout, {result['form']} form) as {args.model}: "
          f"{params / 1e6:.2f}M parameters -> {out}")  # fmt: skip
    return 0
