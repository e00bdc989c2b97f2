"""``repmlp eval``: top-1 / top-5 accuracy of a training-time or deployed checkpoint on a data set.

The checkpoint's metadata names the model and its form; the data set options are those of ``repmlp train``
(by default the data set the checkpoint was trained on). ``--task face|seg`` evaluates with the face /
segmentation protocols instead (their options: ``repmlp eval --task face --help``).
"""

from __future__ import annotations

import argparse

from repmlp.commands._common import add_option, add_options
from repmlp.commands.train import add_task_option, print_help_if_asked, run_task
from repmlp.tasks.classification import EvalConfig, evaluate

OWN_HELP = True  # --help shows the options of the --task given (repmlp.cli builds the parser without -h)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_task_option(p)
    add_options(p, EvalConfig, {
        "--checkpoint": "model.safetensors or deploy.safetensors of a run",
        "--dataset": "(default: the one the checkpoint was trained on, else fashion-mnist)",
        "--data-dir": "as for repmlp train (default: the folder the checkpoint was trained on)",
        "--download": "fetch Fashion-MNIST with torchvision if missing",
        "--img-size": "centre-crop size (imagefolder)", "--batch-size": None,
        "--workers": None, "--device": "auto (CUDA if available), cpu, cuda, cuda:N",
        "--json": "print the result as JSON",
    })  # fmt: skip
    add_option(p, "--val-limit", "first N examples only", EvalConfig, metavar="N")
    p.set_defaults(accepts_extra=lambda a: a.task != "cls")


def run(args: argparse.Namespace) -> int:
    if print_help_if_asked(args):
        return 0
    if args.task != "cls":
        return run_task(args, "eval", "eval")
    return evaluate(EvalConfig.from_args(args))
