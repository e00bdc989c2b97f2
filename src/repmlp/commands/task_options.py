"""The options of ``repmlp train/eval --task face|seg``: each task's own parser, built here at the CLI
boundary (the tasks take the parsed namespace).

Classification's options are ``repmlp train``'s and ``repmlp eval``'s own (:mod:`.train`, :mod:`.eval`).
Options every task shares are spelt as classification spells them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from repmlp.commands._common import (
    MAX_BATCH,
    MAX_SIDE,
    MAX_WORKERS,
    add_force_argument,
    add_init_argument,
    add_limit_argument,
    add_run_arguments,
    float_in,
    fraction,
    int_at_least,
    model_arg,
    model_name,
    nonneg_float,
    positive_float,
    seed_int,
)

__all__ = ["TASK_OPTIONS"]


def add_data_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """``--data-dir``, as classification calls it."""
    parser.add_argument("--data-dir", required=True, help=help)


def add_common_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every task's evaluation shares (conversion check, JSON output, processes)."""
    parser.add_argument(
        "--check-conversion",
        action="store_true",
        help="also evaluate the training-form model and report both (train-form checkpoints)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the metrics as JSON (as for classification)"
    )
    parser.add_argument("--output-json", default=None, help="also write the metrics to this JSON file")
    add_force_argument(parser, "--output-json")
    parser.add_argument(
        "--workers", type=int_at_least(0, MAX_WORKERS), default=2, help="data loading processes (default: 2)"
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")


def add_common_train_arguments(
    parser: argparse.ArgumentParser,
    *,
    model: str,
    batch_size: int,
    lr: float,
    weight_decay: float,
    init_help: str,
    init_aliases: tuple[str, ...] = (),
) -> None:
    """The flags every task's training shares, spelt as classification spells them (model, output,
    schedule basics, ``--init``, processes, checkpoints)."""

    add_init_argument(parser, help=init_help, aliases=init_aliases)

    parser.add_argument(
        "--model", default=model, type=model_name, help=f"registered model name (default: {model})"
    )
    parser.add_argument(
        "--model-arg",
        type=model_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra model option, VALUE as JSON (e.g. --model-arg img_size=64); repeatable",
    )
    parser.add_argument("--output", required=True, help="run folder: new or empty, or a run to --resume")
    parser.add_argument(
        "--batch-size",
        type=int_at_least(1, MAX_BATCH),
        default=batch_size,
        help=f"global batch size, split over torchrun processes (default: {batch_size})",
    )
    parser.add_argument("--lr", type=positive_float, default=lr, help=f"base learning rate (default: {lr})")
    parser.add_argument(
        "--momentum", type=nonneg_float, default=0.9, help="SGD momentum in [0, 1) (default: 0.9)"
    )
    parser.add_argument(
        "--weight-decay",
        type=nonneg_float,
        default=weight_decay,
        help=f"weight decay (default: {weight_decay})",
    )
    parser.add_argument("--seed", type=seed_int, default=0, help="random seed, 0 .. 2**32-1 (default: 0)")
    add_limit_argument(parser, "--train-limit", "training images")
    from repmlp.data.loader import default_workers

    parser.add_argument(
        "--workers",
        type=int_at_least(0, MAX_WORKERS),
        default=min(default_workers(), MAX_WORKERS),
        help="data loading processes (default: one per CPU core this process may use)",
    )
    parser.add_argument(
        "--log-interval",
        type=int_at_least(1),
        default=20,
        help="log the mean loss every N iterations (default: 20)",
    )
    add_run_arguments(
        parser,
        resume_help="continue the run in --output from its last checkpoint (repeat the run's options)",
        step="iteration",
    )


# Random scales of segmentation crops: a scale of the whole image, bounded so that a scaled image fits memory.
_scale = float_in(0.0, 16.0, lo_open=True)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
        if len(values) > 1000 or any(v > 10**9 for v in values):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected up to 1000 comma-separated integers <= 10**9, got {text!r}"
        ) from None
    if any(v < 1 for v in values) or values != sorted(values):
        raise argparse.ArgumentTypeError(f"expected increasing positive iterations, got {text!r}")
    return values


def face_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``repmlp train --task face``."""
    add_data_argument(parser, "folder of aligned face crops, one sub-folder per identity")
    add_common_train_arguments(
        parser,
        model="repmlp_face_resnet",
        batch_size=512,
        lr=0.1,
        weight_decay=4e-5,
        init_help="start from a training-time model file of the same architecture (e.g. a classification "
        "run of it): the trunk is loaded, the embedding head starts fresh",
    )
    parser.add_argument(
        "--head-weight-decay",
        type=nonneg_float,
        default=4e-4,
        help="weight decay of the embedding layer and AM-Softmax class weights (default: 4e-4)",
    )
    parser.add_argument(
        "--iterations",
        type=int_at_least(1),
        default=420_000,
        help="training iterations (default: 420000, the paper's)",
    )
    parser.add_argument(
        "--lr-steps",
        type=_int_list,
        default=None,
        help="iterations at which the LR is divided by 10 (default: the paper's 252000,364000,406000 "
        "of 420000, scaled to --iterations)",
    )
    parser.add_argument(
        "--am-scale", type=positive_float, default=30.0, help="AM-Softmax scale s (default: 30)"
    )
    parser.add_argument(
        "--am-margin", type=fraction, default=0.35, help="AM-Softmax margin m (default: 0.35)"
    )
    parser.add_argument(
        "--img-size",
        type=int_at_least(16, MAX_SIDE),
        default=None,
        help="face crop size (default: --model-arg img_size, else 96)",
    )


def face_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``repmlp eval --task face``."""
    parser.add_argument(
        "--checkpoint", required=True, help="model file written by `repmlp train --task face`"
    )
    parser.add_argument(
        "--pairs", default=None, help="verification pairs: LFW pairs.txt or lines '<path1> <path2> <0|1>'"
    )
    parser.add_argument(
        "--pairs-root",
        default=None,
        help="folder the pair paths are relative to (default: the pairs file's folder)",
    )
    parser.add_argument(
        "--folds", type=int_at_least(2, 1000), default=10, help="verification folds (default: 10)"
    )
    parser.add_argument("--probe", default=None, help="identification probe set: one sub-folder per identity")
    parser.add_argument(
        "--gallery",
        default=None,
        help="identification gallery: the probes' mates plus distractors, one sub-folder per identity",
    )
    parser.add_argument(
        "--batch-size",
        type=int_at_least(1, MAX_BATCH),
        default=256,
        help="embedding batch size (default: 256)",
    )
    add_common_eval_arguments(parser)


def seg_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``repmlp train --task seg``."""
    add_data_argument(parser, "Cityscapes root (leftImg8bit/ and gtFine/ with labelTrainIds)")
    add_common_train_arguments(
        parser,
        model="pspnet_repmlp_res50",
        batch_size=16,
        lr=0.01,
        weight_decay=1e-4,
        init_help="ImageNet-trained backbone: a training-time classification model file from `repmlp train` "
        "or `repmlp import`; FC1/FC2 are re-initialised (the paper's), everything else inherited",
        init_aliases=("--backbone-weights",),
    )
    parser.add_argument(
        "--epochs", type=int_at_least(1, 100_000), default=200, help="training epochs (default: 200)"
    )
    parser.add_argument(
        "--iterations",
        type=int_at_least(1),
        default=None,
        help="training iterations (default: from --epochs)",
    )
    parser.add_argument("--power", type=positive_float, default=0.9, help="poly LR power (default: 0.9)")
    parser.add_argument(
        "--head-lr-mult",
        type=positive_float,
        default=10.0,
        help="LR multiplier of the PSP and auxiliary heads (PSPNet's code: 10)",
    )
    parser.add_argument(
        "--crop-size",
        type=int_at_least(8, MAX_SIDE),
        default=None,
        help="training crop, the model's img_size (default: --model-arg img_size, else 713)",
    )
    parser.add_argument(
        "--scale-min", type=_scale, default=0.5, help="random scale lower bound, in (0, 16] (0.5)"
    )
    parser.add_argument(
        "--scale-max", type=_scale, default=2.0, help="random scale upper bound, in (0, 16] (2.0)"
    )
    parser.add_argument(
        "--aux-weight", type=nonneg_float, default=0.4, help="auxiliary loss weight (default: 0.4)"
    )
    parser.add_argument(
        "--train-split", default="train", help="Cityscapes split to train on (default: train)"
    )


def seg_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``repmlp eval --task seg``."""
    parser.add_argument("--checkpoint", required=True, help="model file written by `repmlp train --task seg`")
    add_data_argument(parser, "Cityscapes root")
    parser.add_argument("--split", default="val", help="split to evaluate (default: val)")
    parser.add_argument(
        "--mode",
        choices=("slide", "whole"),
        default="slide",
        help="slide: crop-size windows (default); whole: one pass per image (no RepMLPs)",
    )
    parser.add_argument(
        "--crop-size",
        type=int_at_least(8, MAX_SIDE),
        default=None,
        help="window size (default: the model's img_size)",
    )
    parser.add_argument(
        "--val-limit", type=int_at_least(1, 2**31 - 1), default=None, help="evaluate the first N images only"
    )
    add_common_eval_arguments(parser)


# task -> phase -> the function that adds that task's options to a parser
TASK_OPTIONS: dict[str, dict[str, Callable[[argparse.ArgumentParser], None]]] = {
    "face": {"train": face_train_arguments, "eval": face_eval_arguments},
    "seg": {"train": seg_train_arguments, "eval": seg_eval_arguments},
}
