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


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from repmlp.commands._common import add_device_argument, add_limit_argument, float_in, int_at_least
    from repmlp.commands._parser import ArgumentParser, HelpFormatter

    p = subparsers.add_parser(
        "study", help="reproduce the paper's studies (ablation: Table 1)", description=__doc__
    )
    sub = p.add_subparsers(dest="study", required=True, metavar="<study>", parser_class=ArgumentParser)
    a = sub.add_parser(
        "ablation",
        help="the pure-MLP ablation study (paper Table 1)",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    a.add_argument(
        "--output", required=True, metavar="DIR", help="study folder (one run folder per row/seed)"
    )
    a.add_argument(
        "--dataset",
        choices=("fashion-mnist", "cifar10"),
        default="fashion-mnist",
        help="(default: fashion-mnist)",
    )
    a.add_argument(
        "--data-dir",
        default=None,
        help="fashion-mnist: folder of the IDX files (default: Debian's); cifar10: folder holding "
        "cifar-10-batches-py",
    )
    a.add_argument("--seeds", type=int_at_least(1, 1000), default=3, help="runs per row, seeds 0..N-1")
    a.add_argument(
        "--epochs", type=int_at_least(1, 100_000), default=100, help="epochs per run (the paper: 100)"
    )
    a.add_argument(
        "--width-multiplier",
        type=float_in(0.0, 64.0, lo_open=True),
        default=1.0,
        metavar="W",
        help="scale every row's channel widths (rounded to a multiple of the groups)",
    )
    a.add_argument(
        "--preset",
        choices=("cifar", "fmnist"),
        default="cifar",
        help="every run's recipe: cifar (the paper's CIFAR-10 recipe) or fmnist (the main job's: warm-up, "
        "label smoothing, no crop; learns in a few epochs) (default: cifar)",
    )
    add_limit_argument(a, "--train-limit", "training examples")
    add_limit_argument(a, "--val-limit", "validation examples")
    add_device_argument(a, default="auto")
    a.add_argument(
        "--bench-batch-size",
        type=int_at_least(1, 1 << 20),
        default=32,
        help="batch of the side-by-side speed measurement",
    )
    a.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="torch.compile every run's training step (as repmlp train --compile; auto: on CUDA only)",
    )
    a.add_argument(
        "--jobs",
        type=int_at_least(1, 256),
        default=1,
        help="runs trained at once, each in its own process with an equal share of the CPU threads "
        "(on a small CPU, --jobs 2 with one thread each beats one run on both cores)",
    )
    a.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from repmlp.engine import keep_freed_memory
    from repmlp.tasks.study import StudyOptions, train_study
    from repmlp.tasks.study_report import write_report

    keep_freed_memory()  # as repmlp train: no page faults per training step

    opts = StudyOptions(
        output=args.output,
        dataset=args.dataset,
        data_dir=args.data_dir,
        seeds=args.seeds,
        epochs=args.epochs,
        width_multiplier=args.width_multiplier,
        preset=args.preset,
        compile=args.compile,
        train_limit=args.train_limit,
        val_limit=args.val_limit,
        device=args.device,
        bench_batch_size=args.bench_batch_size,
        jobs=args.jobs,
    )
    path = write_report(opts, train_study(opts), Path(opts.output))
    print(path)
    return 0
