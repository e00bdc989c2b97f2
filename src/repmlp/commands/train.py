"""``repmlp train``: train a classifier (default: RepMLP on Fashion-MNIST), evaluate, convert, export, report.

With no options this is the project's main job: a pure-MLP RepMLP on the Fashion-MNIST installed by
Debian's ``dataset-fashion-mnist``, about five minutes on a 2-core CPU. ``--preset cifar|imagenet`` selects
the paper's recipes; every preset value can be overridden. Under ``torchrun --nproc_per_node N`` the same
command trains with DistributedDataParallel. ``--task face|seg`` runs the face-recognition or
segmentation pipeline instead (their options: ``repmlp train --task face --help``).

On a CUDA device (``--device auto`` picks one when there is one) training runs in AMP with bfloat16
autocast (float16 with a gradient scaler on GPUs without bfloat16; ``--no-amp`` for float32) and
channels_last activations. On one GPU the model's forward and backward are captured once as CUDA graphs
and replayed every step (``--cuda-graphs auto``); with several GPUs, and for the face and segmentation
tasks, the step is ``torch.compile``-d (``--compile auto``). Every task's steps call the model's training
form, :func:`repmlp.engine.forms.training_form` (``--no-fast-training``: the plain modules). The
conversion check always runs in full float32. Measurements: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from repmlp.commands._common import check_output_file
from repmlp.commands._parser import ArgumentParser, HelpFormatter
from repmlp.commands.task_options import TASK_OPTIONS, classification_arguments
from repmlp.engine import restart_count
from repmlp.errors import UserError
from repmlp.tasks import TASK_MODULES
from repmlp.tasks.classification import TrainConfig, resolve_config, train

TASKS = ("cls", "face", "seg")


def add_task_option(p: argparse.ArgumentParser) -> None:
    """``--task`` and a ``--help`` that shows the chosen task's options (``p`` has no ``-h`` of its own)."""
    p.add_argument("-h", "--help", action="store_true", dest="show_help",
                   help="show this help message and exit (with --task face|seg: that task's options)")  # fmt: skip
    p.add_argument("--task", choices=TASKS, default="cls", help="cls: image classification (this command's "
                   "options); face / seg: the paper's face recognition / semantic segmentation pipelines, with "
                   "their own options (see --task X --help)")  # fmt: skip
    p.set_defaults(parser=p)


def print_help_if_asked(args: argparse.Namespace) -> bool:
    """Print the classification options' help for ``--help`` (tasks print their own in :func:`run_task`)."""
    if args.show_help and args.task == "cls":
        args.parser.print_help()
        return True
    return False


def task_argv(argv: list[str], command: str) -> list[str]:
    """The options after ``command`` in ``argv`` without ``--task X`` (handed to a task's own parser)."""
    rest = argv[argv.index(command) + 1 :] if command in argv else list(argv)
    out, skip = [], False
    for i, a in enumerate(rest):
        if skip:
            skip = False
        elif a == "--task":
            skip = i + 1 < len(rest)
        elif not a.startswith("--task="):
            out.append(a)
    return out


def run_task(args: argparse.Namespace, command: str, phase: str) -> int:
    """Parse the face or segmentation task's own options from the raw command line into its config, and
    call its ``train`` (exit 1 when the run's checks fail) or ``evaluate``."""
    module = importlib.import_module(f"repmlp.tasks.{TASK_MODULES[args.task]}")
    description = (module.__doc__ or "").strip().splitlines()[0]
    parser = ArgumentParser(prog=f"repmlp {command} --task {args.task}", description=description,
                            formatter_class=HelpFormatter)  # fmt: skip
    TASK_OPTIONS[args.task][phase](parser)
    try:
        task_args = parser.parse_args(task_argv(args.argv, command))
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    # For the one-line error of an out-of-memory run (repmlp.cli), which sees only the top-level options.
    args.batch_size = getattr(task_args, "batch_size", None)
    if phase == "train":
        return 0 if module.train(module.TrainConfig.from_args(task_args)).ok else 1
    config = module.EvalConfig.from_args(task_args)
    if config.output_json:  # refused before any work: an input, or an existing file without --force
        check_output_file(
            Path(config.output_json), [config.checkpoint], force=task_args.force, flag="--output-json"
        )
    return module.evaluate(config)


OWN_HELP = True  # --help shows the options of the --task given (repmlp.cli builds the parser without -h)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_task_option(p)
    classification_arguments(p)
    p.set_defaults(accepts_extra=lambda a: a.task != "cls")


def given_options(args: argparse.Namespace) -> set[str]:
    """The options typed on the command line (``--resume`` keeps the others' saved values).

    Re-parses the command's own options into a namespace pre-filled with a marker: ``argparse`` fills in
    defaults only for attributes that are missing, so whatever still holds the marker was not typed. The
    marker is a list because ``append`` actions extend a copy of the current value.
    """
    unset: list = []
    dests = {a.dest for a in args.parser._actions if a.dest != argparse.SUPPRESS}
    probe = argparse.Namespace(**dict.fromkeys(dests, unset))
    args.parser.parse_known_args(task_argv(args.argv, "train"), probe)
    return {d for d in dests if getattr(probe, d) is not unset}


def run(args: argparse.Namespace) -> int:
    if print_help_if_asked(args):
        return 0
    if args.task != "cls":
        return run_task(args, "train", "train")
    if args.resume and not args.output:
        raise UserError("--resume needs --output DIR (the run folder to continue)")
    options = {f: getattr(args, f) for f in TrainConfig.__dataclass_fields__ if hasattr(args, f)}
    options["output"] = args.output or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    options["run_command"] = ["repmlp", *(sys.argv[1:] if args.argv is None else args.argv)]
    resumes = args.resume or restart_count() > 0  # may resume: the options typed must fit the checkpoint's
    result = train(resolve_config(**options), given=given_options(args) if resumes else None)
    return 0 if result.ok else 1
