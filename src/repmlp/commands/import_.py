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
import logging
from pathlib import Path

from repmlp.commands._common import add_force_argument, check_output_file, model_arg, model_name
from repmlp.errors import UserError

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from repmlp.commands._parser import HelpFormatter

    p = subparsers.add_parser(
        "import",
        help="import a released RepMLP-Res50 / RepMLPNet checkpoint (.pth) as a repmlp model file",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument("checkpoint", type=Path, help="the .pth file (authors' or mmpretrain's)")
    p.add_argument(
        "--model",
        required=True,
        type=model_name,
        help="registered model it holds: repmlpnet_b256, repmlp_res50_light, ...",
    )
    p.add_argument("--output", required=True, type=Path, help="model file to write (.safetensors)")
    add_force_argument(p)
    p.add_argument(
        "--model-arg",
        type=model_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model option the file was built with, VALUE as JSON (e.g. --model-arg img_size=320); repeatable",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from repmlp.io.importer import import_to_file

    out: Path = args.output
    if out.suffix != ".safetensors":
        raise UserError(f"--output {out}: repmlp model files end in .safetensors")
    check_output_file(out, [args.checkpoint], force=args.force)
    result = import_to_file(args.checkpoint, args.model, dict(args.model_arg), out)
    params = sum(p.numel() for p in result["model"].parameters())
    print(
        f"imported {args.checkpoint.name} ({result['layout']} layout, {result['form']} form) as "
        f"{args.model}: {params / 1e6:.2f}M parameters -> {out}"
    )
    return 0
