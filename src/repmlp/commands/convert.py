"""``repmlp convert``: training-time checkpoint -> deployed checkpoint (paper Sec. 3.4), verified.

Every RepMLP block becomes FC1, FC2 and FC3 (Local Perceptron and BatchNorms merged in), every conv-BN
pair one conv. The deployed file is written only after it has been loaded back into a freshly built
``deploy=True`` model and that model's outputs matched the training-time model's on real inputs: a
batch of the run's validation data when the checkpoint names its data set (or ``--dataset`` is given),
read for the model as ``repmlp eval`` reads it (its channels, input size and normalisation), otherwise
random inputs. ``--precision int8`` calibrates on the run's training images, read the same way.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from repmlp.commands._common import MAX_SIDE, check_not_input, check_output_kind, int_at_least, positive_float

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from repmlp.commands._parser import HelpFormatter
    from repmlp.deploy.precision import PRECISIONS

    p = subparsers.add_parser(
        "convert",
        help="convert a training-time checkpoint into the deployed (inference) form, verified",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, type=Path, help="training-time checkpoint (.safetensors)")
    p.add_argument(
        "--output",
        type=Path,
        default=None,
        help="deployed checkpoint to write (default: deploy.safetensors next to model.safetensors, "
        "else <name>-deploy.safetensors)",
    )
    p.add_argument(
        "--dataset", default=None, help="data set for the check inputs (default: the one the run recorded)"
    )
    p.add_argument("--data-dir", default=None, help="its folder (default: the one the run recorded)")
    p.add_argument(
        "--num-examples", type=int_at_least(1, 100_000), default=64, help="examples in the check batch"
    )
    p.add_argument(
        "--img-size", type=int_at_least(1, MAX_SIDE), default=None, help="input size (default: the run's)"
    )
    p.add_argument(
        "--tolerance",
        type=positive_float,
        default=1e-4,
        help="max allowed |deployed - training-time| relative to max(1, max |output|)",
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="precision of the deployed file; int8 is post-training static quantization with onnxruntime, "
        "calibrated on the run's training images (see repmlp.deploy.precision)",
    )
    p.add_argument(
        "--calibration-examples",
        type=int_at_least(1, 100_000),
        default=512,
        help="training images that calibrate int8 activation ranges",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from repmlp.deploy.convert_file import convert_checkpoint, default_output

    output = args.output or default_output(args.checkpoint)
    # Only an earlier deployed file may be replaced: not the checkpoint, a training state, a report.
    check_not_input(output, [args.checkpoint])
    check_output_kind(output, "a deployed model file", ("a deployed model file",))
    res = convert_checkpoint(
        args.checkpoint,
        output,
        precision=args.precision,
        tolerance=args.tolerance,
        num_examples=args.num_examples,
        img_size=args.img_size,
        dataset=args.dataset,
        data_dir=args.data_dir,
        calibration_examples=args.calibration_examples,
    )
    print(
        f"wrote {res.output} ({res.model}, deployed form, {res.precision}, {res.params_deploy / 1e6:.3f}M "
        f"params; training-time {res.params_train / 1e6:.3f}M)"
    )
    print(
        f"max abs error deployed vs training-time: {res.max_error:.3e} (max |output| {res.max_output:.3g}) "
        f"on {res.source}"
    )
    if res.precision != "fp32":
        print(
            f"{res.precision}: max abs logit change vs float32 deployed {res.precision_error:.3e}, "
            f"{100 * res.changed:.2f}% of predictions changed on {res.source}; file "
            f"{res.output.stat().st_size} bytes"
        )
    return 0
