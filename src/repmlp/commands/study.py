"""``repmlp study ablation``: the paper's pure-MLP ablation (Table 1) trained and compared in one command.

Trains Pure MLP (= A before conversion), B w/o Local, C w/o Global, D FC3 as conv9, E RepMLP as conv9 and
the Wide ConvNet for --seeds seeds each with the paper's CIFAR recipe (``--preset cifar``, the default) or
the main job's short-schedule one (``--preset fmnist``), scaled by --epochs / --width-multiplier /
--train-limit, one run folder per row and seed (OUTPUT/<row>/seed<k>). Fashion-MNIST is zero-padded to
32x32 so that the paper's networks run unchanged (one input channel).
Calling it again reuses finished runs and resumes a killed one. Writes OUTPUT/study.md and
OUTPUT/study.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from repmlp.commands._common import add_device_argument, add_limit_argument, add_option, add_options
from repmlp.commands._parser import ArgumentParser, HelpFormatter
from repmlp.tasks.study import StudyOptions, train_study
from repmlp.tasks.study_report import write_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="study", required=True, metavar="<study>", parser_class=ArgumentParser)
    a = sub.add_parser("ablation", help="the pure-MLP ablation study (paper Table 1)", description=__doc__,
                       formatter_class=HelpFormatter)  # fmt: skip
    a.add_argument(
        "--output", required=True, metavar="DIR", help="study folder (one run folder per row/seed)"
    )
    add_options(a, StudyOptions, {
        "--dataset": None,
        "--data-dir": "fashion-mnist: folder of the IDX files (default: Debian's); cifar10: folder holding "
        "cifar-10-batches-py",
        "--seeds": "runs per row, seeds 0..N-1", "--epochs": "epochs per run (the paper: 100)",
        "--preset": "every run's recipe: cifar (the paper's CIFAR-10 recipe) or fmnist (the main job's: warm-up, "
        "label smoothing, no crop; learns in a few epochs)",
    })  # fmt: skip
    add_option(a, "--width-multiplier", "scale every row's channel widths (rounded to a multiple of the groups)",
               StudyOptions, metavar="W")  # fmt: skip
    add_limit_argument(a, "--train-limit", "training examples")
    add_limit_argument(a, "--val-limit", "validation examples")
    add_device_argument(a, default="auto")
    add_options(a, StudyOptions, {
        "--bench-batch-size": "batch of the side-by-side speed measurement",
        "--compile": "torch.compile every run's training step (as repmlp train --compile; auto: on CUDA only)",
        "--jobs": "runs trained at once, each in its own process with an equal share of the CPU threads (on a "
        "small CPU, --jobs 2 with one thread each beats one run on both cores)",
    })  # fmt: skip


def run(args: argparse.Namespace) -> int:
    opts = StudyOptions.from_args(args)
    print(write_report(opts, train_study(opts), Path(opts.output)))
    return 0
