"""``repmlp eval``: top-1 / top-5 accuracy of a training-time or deployed checkpoint on a data set.

The checkpoint's metadata names the model and its form; the data set options are those of ``repmlp train``
(by default the data set the checkpoint was trained on). ``--task face|seg`` evaluates with the face /
segmentation protocols instead (their options: ``repmlp eval --task face --help``).
"""

from __future__ import annotations

import argparse
import logging

from repmlp.commands._common import MAX_BATCH, MAX_SIDE, MAX_WORKERS, int_at_least
from repmlp.commands.train import add_task_option, print_help_if_asked, run_task

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from repmlp.commands._parser import HelpFormatter
    from repmlp.data import DATASETS

    p = subparsers.add_parser(
        "eval",
        add_help=False,
        help="top-1/top-5 accuracy of a checkpoint",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_task_option(p)
    p.add_argument("--checkpoint", default=None, help="model.safetensors or deploy.safetensors of a run")
    p.add_argument(
        "--dataset",
        choices=DATASETS,
        default=None,
        help="(default: the one the checkpoint was trained on, else fashion-mnist)",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="as for repmlp train (default: the folder the checkpoint was trained on)",
    )
    p.add_argument("--download", action="store_true", help="fetch Fashion-MNIST with torchvision if missing")
    p.add_argument(
        "--val-limit",
        type=int_at_least(1, 2**31 - 1),
        default=None,
        metavar="N",
        help="first N examples only",
    )
    p.add_argument(
        "--img-size", type=int_at_least(8, MAX_SIDE), default=None, help="centre-crop size (imagefolder)"
    )
    p.add_argument("--batch-size", type=int_at_least(1, MAX_BATCH), default=512)
    p.add_argument("--workers", type=int_at_least(0, MAX_WORKERS), default=2)
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run, accepts_extra=lambda a: a.task != "cls")
    return p


def run(args: argparse.Namespace) -> int:
    if print_help_if_asked(args):
        return 0
    if args.task != "cls":
        return run_task(args, "eval", "eval")
    from repmlp.tasks.classification import EvalConfig, evaluate

    return evaluate(EvalConfig.from_args(args))
