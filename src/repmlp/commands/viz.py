"""``repmlp viz``: the paper's FC3 weight figure for a RepMLP block of a training-time checkpoint.

FC3's kernel is viewed as W(O, h, w, C/g, h, w); the figure shows ln(|W| / min |W|) of
W[out_channel, y, x, in_channel, :, :] for the training-time FC3 (left) and for FC3 merged with the
Local Perceptron (right). The sampled point is the dashed square, the largest conv kernel's extent the
blue square (paper Sec. 4.2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from repmlp.bench.viz import describe, find_repmlp_blocks, plot_fc3
from repmlp.commands._common import add_force_argument, check_output_file, number_in
from repmlp.errors import UserError
from repmlp.io.model_file import load_model
from repmlp.tasks.limits import ints


def add_arguments(p: argparse.ArgumentParser) -> None:
    index = number_in(ints(0))
    p.add_argument("--checkpoint", required=True, type=Path, help="training-time checkpoint (.safetensors)")
    p.add_argument(
        "--block", default=None, help="qualified name of the RepMLP block (default: the first with convs)"
    )
    p.add_argument("--list-blocks", action="store_true", help="print the model's RepMLP blocks and exit")
    p.add_argument("--out-channel", type=index, default=0, help="output channel o")
    p.add_argument("--in-channel", type=index, default=0, help="input channel inside o's group (0 .. C/g-1)")
    p.add_argument("--point", nargs=2, type=index, metavar=("Y", "X"), default=None,
                   help="output point in the partition, zero-based (default: the centre (h//2, w//2))")  # fmt: skip
    p.add_argument("--output", type=Path, default=None, help="PNG to write (default: <checkpoint>-fc3.png beside the "
                   "checkpoint, never replacing the run's fc3.png)")  # fmt: skip
    add_force_argument(p)


def run(args: argparse.Namespace) -> int:
    output = args.output or args.checkpoint.with_name(f"{args.checkpoint.stem}-fc3.png")
    check_output_file(output, [args.checkpoint], force=args.force)
    model = load_model(args.checkpoint, device="cpu")
    meta = model.metadata
    blocks = find_repmlp_blocks(model)
    if args.list_blocks:
        for name, block in blocks:
            print(f"{name or '<root>'}\t{block.extra_repr()}")
        return 0
    if not blocks:
        raise UserError(f"{meta.name} has no RepMLP block to visualise")
    if meta.form != "train":
        raise UserError(f"{args.checkpoint} holds the deployed form of {meta.name}; the figure compares the "
                        "training-time FC3 with the merged one, so pass the training-time checkpoint "
                        "(model.safetensors)")  # fmt: skip
    try:
        sample = plot_fc3(model, output, block_name=args.block, out_channel=args.out_channel, point=args.point,
                          in_channel=args.in_channel)  # fmt: skip
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print(f"wrote {output} ({meta.name} block {sample.block_name or '<root>'}: {describe(sample)}), max "
          f"ln(|W|/min|W|) {sample.train.max():.2f} training-time, {sample.merged.max():.2f} merged)")  # fmt: skip
    return 0
