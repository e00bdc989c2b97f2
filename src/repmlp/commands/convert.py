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
from pathlib import Path

from repmlp.commands._common import add_force_argument, check_output_file, number_in
from repmlp.deploy.conversion import CONVERSION_RTOL, convert_file, default_output
from repmlp.deploy.precision import PRECISIONS
from repmlp.tasks.limits import MAX_SIDE, POSITIVE, ints


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, type=Path, help="training-time checkpoint (.safetensors)")
    p.add_argument("--output", type=Path, default=None,
                   help="deployed checkpoint to write (default: deploy.safetensors next to model.safetensors, "
                   "else <name>-deploy.safetensors; deploy-<precision> in bf16, fp16, int8)")  # fmt: skip
    add_force_argument(p)
    p.add_argument("--dataset", default=None, help="data set of the check inputs (default: the run's)")
    p.add_argument("--data-dir", default=None, help="its folder (default: the one the run recorded)")
    p.add_argument("--num-examples", type=number_in(ints(1, 100_000)), default=64, help="examples checked")
    p.add_argument("--img-size", type=number_in(ints(1, MAX_SIDE)), default=None, help="(default: the run's)")
    p.add_argument("--tolerance", type=number_in(POSITIVE), default=CONVERSION_RTOL,
                   help="max allowed |deployed - training-time| relative to max(1, max |output|)")  # fmt: skip
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="of the deployed file; int8 is post-training static quantization with onnxruntime, "
                   "calibrated on the run's training images (see repmlp.deploy.precision)")  # fmt: skip
    p.add_argument("--calibration-examples", type=number_in(ints(1, 100_000)), default=512,
                   help="training images that calibrate int8 activation ranges")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    output = args.output or default_output(args.checkpoint, args.precision)
    check_output_file(output, [args.checkpoint], force=args.force)
    print(convert_file(args.checkpoint, output, precision=args.precision, tolerance=args.tolerance,
                       num_examples=args.num_examples, img_size=args.img_size, dataset=args.dataset,
                       data_dir=args.data_dir, calibration_examples=args.calibration_examples))  # fmt: skip
    return 0
