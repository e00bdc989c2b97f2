"""``repmlp train``: train a classifier (default: RepMLP on Fashion-MNIST), evaluate, convert, export, report.

With no options this is the project's main job: a pure-MLP RepMLP on the Fashion-MNIST installed by
Debian's ``dataset-fashion-mnist``, about five minutes on a 2-core CPU. ``--preset cifar|imagenet`` selects
the paper's recipes; every preset value can be overridden. Under ``torchrun --nproc_per_node N`` the same
command trains with DistributedDataParallel. ``--task face|seg`` runs the face-recognition or
segmentation pipeline instead (their options: ``repmlp train --task face --help``).

On a CUDA device (``--device auto`` picks one when there is one) training runs in AMP with bfloat16
autocast (float16 with a gradient scaler on GPUs without bfloat16; ``--no-amp`` for float32), channels_last
activations, float32 convolutions in TF32 (PyTorch's default for cuDNN; float32 matmuls stay full float32)
and ``cudnn.benchmark`` left off (PyTorch's default). On one GPU the model's forward and backward are
captured once as CUDA graphs and replayed every step (``--cuda-graphs auto``; no compile then); with
several GPUs, and for the face and segmentation tasks, the step is ``torch.compile``-d (``--compile
auto``). The RepMLP blocks train in their dense form on CUDA (repmlp.nn.dense), in the conv form inside CUDA
graphs. The conversion check always runs in full float32. Measurements: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from repmlp.commands._common import (
    MAX_BATCH,
    MAX_PAD,
    MAX_SIDE,
    MAX_WORKERS,
    add_init_argument,
    add_limit_argument,
    add_run_arguments,
    int_at_least,
    model_arg,
    model_name,
    nonneg_float,
    positive_float,
    seed_int,
)
from repmlp.errors import UserError

log = logging.getLogger(__name__)

TASKS = ("cls", "face", "seg")
# task -> phase -> the name of its config class in its module
CONFIGS = {
    "face": {"train": "FaceTrainConfig", "eval": "FaceEvalConfig"},
    "seg": {"train": "SegTrainConfig", "eval": "SegEvalConfig"},
}


def _workers(text: str) -> int:
    return int_at_least(0, MAX_WORKERS)(text)


def add_task_option(p: argparse.ArgumentParser) -> None:
    """``--task`` and a ``--help`` that shows the chosen task's options (``p`` has ``add_help=False``)."""
    p.add_argument(
        "-h",
        "--help",
        action="store_true",
        dest="show_help",
        help="show this help message and exit (with --task face|seg: that task's options)",
    )
    p.add_argument(
        "--task",
        choices=TASKS,
        default="cls",
        help="cls: image classification (this command's options); face / seg: the paper's face "
        "recognition / semantic segmentation pipelines, with their own options (see --task X --help)",
    )
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
    """Parse the task's own options from the raw command line and call its ``train``/``evaluate``."""
    import importlib

    from repmlp.commands._parser import ArgumentParser
    from repmlp.tasks import TASK_MODULES

    module = importlib.import_module(f"repmlp.tasks.{TASK_MODULES[args.task]}")
    parser = ArgumentParser(
        prog=f"repmlp {command} --task {args.task}",
        description=(module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else None,
    )
    from repmlp.commands.task_options import TASK_OPTIONS

    TASK_OPTIONS[args.task][phase](parser)
    try:
        task_args = parser.parse_args(task_argv(args.argv, command))
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    # For the one-line error of an out-of-memory run (repmlp.cli), which sees only the top-level options.
    args.batch_size = getattr(task_args, "batch_size", None)
    # The task's typed config, built here at the command line's boundary.
    config = getattr(module, CONFIGS[args.task][phase]).from_args(task_args)
    if getattr(config, "output_json", None):
        from pathlib import Path

        from repmlp.commands._common import check_output_file

        check_output_file(
            Path(config.output_json), [config.checkpoint], force=task_args.force, flag="--output-json"
        )
    return int(getattr(module, "train" if phase == "train" else "evaluate")(config) or 0)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from repmlp.commands._parser import HelpFormatter

    p = subparsers.add_parser(
        "train",
        add_help=False,
        help="train a model (default: the 5-minute Fashion-MNIST job)",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_task_option(p)
    _add_data_options(p)
    _add_recipe_options(p)
    _add_run_options(p)
    p.set_defaults(func=run, accepts_extra=lambda a: a.task != "cls")
    return p


def _add_data_options(parser: argparse.ArgumentParser) -> None:
    """The data set options of ``repmlp train``."""
    from repmlp.data import DATASETS

    g = parser.add_argument_group("data")
    g.add_argument("--dataset", choices=DATASETS, default="fashion-mnist", help="(default: fashion-mnist)")
    g.add_argument(
        "--data-dir",
        default=None,
        help="fashion-mnist: folder of the IDX files (default: Debian's, else the download cache); "
        "cifar10: folder holding cifar-10-batches-py; imagefolder: folder with train/ and val/",
    )
    g.add_argument("--download", action="store_true", help="fetch Fashion-MNIST with torchvision if missing")
    add_limit_argument(g, "--train-limit", "training examples")
    add_limit_argument(g, "--val-limit", "validation examples")
    from repmlp.data.loader import default_workers

    g.add_argument(
        "--workers",
        type=_workers,
        default=min(default_workers(), MAX_WORKERS),
        help="image decoding processes (imagefolder; default: one per CPU core this process may use)",
    )


def _add_recipe_options(parser: argparse.ArgumentParser) -> None:
    """The model and recipe options (their defaults come from ``--preset``)."""
    from repmlp.tasks.recipes import PRESETS

    g = parser.add_argument_group("model and recipe (defaults come from --preset)")
    g.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="fmnist (default for fashion-mnist), cifar (the paper's CIFAR-10 recipe, default for "
        "cifar10), imagenet (the paper's ImageNet recipe); an image folder's default is the model's own "
        "(the --init file's) recipe, its batch fitted to the folder's size",
    )
    g.add_argument(
        "--model",
        default=None,
        type=model_name,
        help="registered repmlp model, or a timm / torchvision model name",
    )
    g.add_argument(
        "--model-arg",
        type=model_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra model option, VALUE as JSON (e.g. --model-arg kernel_sizes=[3]); repeatable",
    )
    g.add_argument("--epochs", type=int_at_least(1, 100_000), default=None)
    g.add_argument(
        "--batch-size",
        type=int_at_least(1, MAX_BATCH),
        default=None,
        help="global batch size (split over processes)",
    )
    g.add_argument("--eval-batch-size", type=int_at_least(1, MAX_BATCH), default=512)
    g.add_argument("--optimizer", choices=("sgd", "adamw"), default=None)
    g.add_argument("--lr", type=positive_float, default=None, help="peak learning rate")
    g.add_argument(
        "--min-lr", type=nonneg_float, default=None, help="final learning rate of the cosine schedule"
    )
    g.add_argument("--momentum", type=nonneg_float, default=None, help="SGD momentum in [0, 1)")
    g.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--weight-decay", type=nonneg_float, default=None)
    g.add_argument("--schedule", choices=("cosine", "constant"), default=None)
    g.add_argument("--warmup-epochs", type=nonneg_float, default=None)
    g.add_argument("--label-smoothing", type=nonneg_float, default=None, help="in [0, 1)")
    g.add_argument("--mixup", type=nonneg_float, default=None, help="mixup Beta(a, a) parameter; 0 disables")
    g.add_argument(
        "--pad",
        type=int_at_least(0, MAX_PAD),
        default=None,
        help="random-crop padding in pixels (in-memory data)",
    )
    g.add_argument(
        "--flip", action=argparse.BooleanOptionalAction, default=None, help="random left-right flips"
    )
    g.add_argument("--autoaugment", action=argparse.BooleanOptionalAction, default=None, help="(imagefolder)")
    g.add_argument(
        "--img-size",
        type=int_at_least(8, MAX_SIDE),
        default=None,
        help="crop size (imagefolder; default: the model's own input size, with --init the init file's); "
        "zero-pad to it (fashion-mnist, cifar10)",
    )
    g.add_argument("--seed", type=seed_int, default=0, help="0 .. 2**32-1 (default: 0)")
    add_init_argument(
        g,
        help="fine-tune: start from the weights of this training-time model file (e.g. runs/X/model.safetensors); "
        "a classifier for another number of classes is re-initialised; without --model, the file's model "
        "and options are used",
    )


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of the run itself: folder, resume, checkpoints, what the end of the run does."""
    g = parser.add_argument_group("run")
    g.add_argument("--output", default=None, help="run folder (default: runs/<date>-<time>)")
    add_run_arguments(
        g,
        resume_help="continue the run in --output from its last checkpoint, with its saved settings (options "
        "that would change them are refused; --device, --workers, --data-dir, ... may change)",
        step="optimizer step",
    )
    g.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="channels-last memory format (default: on CUDA)",
    )
    g.add_argument("--bench-batch-size", type=int_at_least(1, MAX_BATCH), default=128)
    g.add_argument("--no-export", action="store_true", help="skip the ONNX export")
    g.add_argument("--no-bench", action="store_true", help="skip the speed benchmark")


def resolve_config(args: argparse.Namespace):
    """Preset values for every option not given on the command line -> :class:`TrainConfig`.

    An image folder's run (not resumed) takes its recipe, input and batch from :func:`_folder_recipe`."""
    from repmlp.tasks.classification import TrainConfig
    from repmlp.tasks.recipes import DEFAULT_PRESET, PRESETS

    output = args.output or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    if args.resume and not args.output:
        raise UserError("--resume needs --output DIR (the run folder to continue)")
    model_args = dict(args.model_arg)
    init = os.path.abspath(os.path.expanduser(args.init)) if args.init else None
    model = args.model
    if init and not args.resume and model is None:
        from repmlp.tasks.finetune import init_model_options

        # Fine-tuning without --model: the file's model with its options (the new data set the classes).
        model, file_args = init_model_options(init)
        model_args = {**file_args, **model_args}
    folder: dict[str, object] = {}
    derived: dict[str, object] = {}
    if args.dataset == "imagefolder" and not args.resume:
        preset, folder, derived = _folder_recipe(args, init, model, model_args)
    else:
        preset = args.preset or DEFAULT_PRESET[args.dataset]
    values = {**PRESETS[preset].to_dict(), **derived, **({"model": model} if model else {})}
    for k in list(values):
        given = getattr(args, k, None)
        if given is not None:
            values[k] = given
    argv = sys.argv[1:] if args.argv is None else args.argv
    return TrainConfig(
        init=init,
        dataset=args.dataset,
        # Absolute, so that --resume from another working directory still finds the data.
        data_dir=os.path.abspath(os.path.expanduser(args.data_dir)) if args.data_dir else None,
        download=args.download,
        preset=preset,
        model_args=model_args,
        eval_batch_size=args.eval_batch_size,
        train_limit=args.train_limit,
        val_limit=args.val_limit,
        seed=args.seed,
        device=args.device,
        amp=args.amp,
        compile=args.compile,
        cuda_graphs=args.cuda_graphs,
        workers=args.workers,
        ckpt_every=args.ckpt_every,
        output=output,
        no_export=args.no_export,
        no_bench=args.no_bench,
        bench_batch_size=args.bench_batch_size,
        run_command=["repmlp", *argv],
        **folder,
        **values,
    )


def _folder_recipe(
    args: argparse.Namespace, init: str | None, model: str | None, model_args: dict[str, object]
) -> tuple[str, dict[str, object], dict[str, object]]:
    """An image folder's new run: ``(preset, TrainConfig fields, recipe values)``, said in one log line.

    The input (channels and size) is the ``--init`` file's (:func:`_init_folder_defaults`), else the
    model's own (:func:`_model_input`: ``repmlp_fmnist`` takes 1x28x28, not the
    ``imagenet`` preset's 224x224 RGB). Without ``--preset`` the recipe is that model's (the init file's:
    :func:`repmlp.tasks.recipes.preset_for_model`), and without ``--batch-size`` its batch is fitted to the
    folder's size (:func:`repmlp.tasks.recipes.folder_batch_size`). Options given on the command line win.
    """
    from repmlp.tasks.recipes import PRESETS, folder_batch_size, folder_lr, preset_for_model

    name = model or PRESETS[args.preset or "imagenet"].model
    derived: dict[str, object] = {}
    if init:
        fields, pre = _init_folder_defaults(init, args, derived)
        size, whose = pre["input_size"], "the --init file's"
        basis = (pre["model"], size, pre["dataset"])
    else:
        size, whose = _model_input(name, model_args), f"{name}'s"
        fields, basis = _own_input(name, size, args, derived), (name, size, None)
    preset, why = (args.preset, "--preset") if args.preset else preset_for_model(*basis)
    recipe = PRESETS[preset]
    img = args.img_size or derived.get("img_size") or recipe.img_size
    said = [f"recipe {preset} ({why})"]
    if size:
        c = fields.get("channels", 3)
        said.append(f"input {c}x{img}x{img}" + ("" if args.img_size else f" ({whose})"))
    if args.batch_size is None:
        n = _count_images(args.data_dir, args.train_limit, recipe.batch_size * FOLDER_COUNT_STEPS)
        if n is not None:
            derived["batch_size"] = batch = folder_batch_size(recipe.batch_size, n)
            said.append(f"batch {batch} ({max(1, n // batch)} steps an epoch on {n} training images)")
            if batch < recipe.batch_size and args.lr is None:
                derived["lr"] = lr = folder_lr(recipe.lr, recipe.batch_size, batch)
                said.append(f"lr {lr:.3g} (the recipe's {recipe.lr:g} x sqrt({batch}/{recipe.batch_size}))")
    log.info("image folder: %s; options given on the command line win", ", ".join(said))
    return preset, fields, derived


# How far _count_images counts: a folder of at least this many batches is large enough for any preset.
FOLDER_COUNT_STEPS = 16


def _model_input(name: str, model_args: dict | None) -> tuple[int, int, int] | None:
    """``(C, H, W)`` model ``name`` takes with ``model_args``: their ``in_chans``/``img_size``, else its timm
    config's input size; ``None`` when no config knows (a torchvision model)."""
    import timm  # start-up time: the registries load only when a run starts

    from repmlp.models.registry import resolve_model

    try:
        source, bare = resolve_model(name)
    except ValueError:
        return None
    size = getattr(timm.get_pretrained_cfg(bare), "input_size", None) if source != "torchvision" else None
    if not size:
        return None
    args = model_args or {}
    c, h, w = (int(s) for s in size)
    given = args.get("img_size")
    h, w = (given, given) if isinstance(given, int) else given if isinstance(given, (list, tuple)) else (h, w)
    return (args["in_chans"] if isinstance(args.get("in_chans"), int) else c), int(h), int(w)


def _own_input(
    name: str, size: tuple[int, int, int] | None, args: argparse.Namespace, derived: dict[str, object]
) -> dict[str, object]:
    """The channels (a TrainConfig field) and, unless ``--img-size`` is given, the size
    (``derived["img_size"]``) of an image folder for model ``name`` whose own input is ``size``."""
    if size is None:  # a model without a known input (torchvision's): RGB at the preset's size
        return {}
    c, h, w = size
    if c not in (1, 3):
        raise UserError(
            f"{name} takes {c}-channel images, but image folders give 1 (greyscale) or 3 (RGB): pass "
            "--model-arg in_chans=1 or in_chans=3"
        )
    if args.img_size is None and h == w:
        derived["img_size"] = h
    return {"channels": c}


def _count_images(data_dir: str | None, limit: int | None, at_most: int) -> int | None:
    """The training images of image folder ``data_dir`` (at most ``limit``), counted up to ``at_most``
    (enough to know the recipe's batch fits); ``None`` when the folder cannot be read (building the data
    then says what is wrong)."""
    from pathlib import Path

    from repmlp.data.folder import IMG_EXTENSIONS
    from repmlp.data.inputs import not_regular, walk_files

    if not data_dir:
        return None
    root = Path(os.path.expanduser(data_dir)) / "train"
    at_most = min(at_most, limit) if limit else at_most
    n = 0
    try:
        for folder in sorted(root.iterdir()):
            if not folder.name.startswith(".") and not_regular(folder) == "a folder":
                n += len(walk_files(folder, IMG_EXTENSIONS)[0])
                if n >= at_most:
                    break
    except OSError:
        return None
    return min(n, at_most) if n else None


def _init_folder_defaults(
    init: str, args: argparse.Namespace, values: dict[str, object]
) -> tuple[dict[str, object], dict[str, object]]:
    """An image folder fine-tuned from ``--init FILE``: the file's recorded preprocessing as the defaults
    (its channels, its input size unless ``--img-size`` is given, its normalisation and evaluation resize),
    so that the main job's one-channel 28x28 model fine-tunes on one's own images of any mode and size.
    Returns the :class:`~repmlp.tasks.classification.TrainConfig` fields and the file's
    :func:`~repmlp.tasks.finetune.init_preprocessing`; sets ``values["img_size"]``."""
    from repmlp.tasks.finetune import folder_preprocessing, init_preprocessing

    pre = init_preprocessing(init)
    size = pre["input_size"]
    out: dict[str, object] = {}
    if size:
        c, h, w = size
        if c not in (1, 3):
            raise UserError(
                f"--init {init} takes {c}-channel images, but image folders give 1 (greyscale) or 3 (RGB); "
                "pass --model to train another model from scratch"
            )
        out["channels"] = c
        if args.img_size is None:
            if h != w:
                raise UserError(
                    f"--init {init} takes {h}x{w} images: pass --img-size (image folders are square)"
                )
            values["img_size"] = h
    evaluation = folder_preprocessing(pre, int(out.get("channels", 3)))
    if evaluation:
        out["eval_preprocessing"] = evaluation
        out["mean"], out["std"] = evaluation["mean"], evaluation["std"]
    return out, pre


def given_options(args: argparse.Namespace) -> set[str]:
    """The :class:`~repmlp.tasks.classification.TrainConfig` fields typed (``--resume`` keeps the others' saved values).

    Re-parses the command's own options into a namespace pre-filled with a marker: ``argparse`` fills in
    defaults only for attributes that are missing, so whatever still holds the marker was not typed. The
    marker is a list because ``append`` actions (``--model-arg``) extend a copy of the current value.
    """
    unset: list = []
    dests = {a.dest for a in args.parser._actions if a.dest != argparse.SUPPRESS}
    probe = argparse.Namespace(**dict.fromkeys(dests, unset))
    argv = sys.argv[1:] if args.argv is None else args.argv
    args.parser.parse_known_args(task_argv(argv, "train"), probe)
    typed = {d for d in dests if getattr(probe, d) is not unset}
    return {"model_args" if d == "model_arg" else d for d in typed}


def run(args: argparse.Namespace) -> int:
    if print_help_if_asked(args):
        return 0
    from repmlp.engine import keep_freed_memory

    keep_freed_memory()  # the application's allocator setting: no page faults per step (docs/benchmarks.md)
    if args.task != "cls":
        return run_task(args, "train", "train")
    t0 = time.perf_counter()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from repmlp.engine import cleanup_distributed
    from repmlp.tasks.classification import run_training
    from repmlp.tasks.classification_report import finish_run

    cfg = resolve_config(args)
    try:
        result = run_training(
            cfg,
            resume=args.resume,
            stop_after_steps=args.stop_after_steps,
            given=given_options(args) if args.resume else None,
        )
        if not result.dist_info.is_main:
            return 0
        done = result.config  # a resumed run's: its original end-of-run options unless given again
        ok = finish_run(
            result,
            command=done.run_command or ["repmlp", *(sys.argv[1:] if args.argv is None else args.argv)],
            started=t0,
            bench_batch_size=done.bench_batch_size,
            export=not done.no_export,
            bench=not done.no_bench,
        )
        return 0 if ok else 1
    finally:
        cleanup_distributed()
