"""The options of ``repmlp train`` and ``repmlp eval --task face|seg``, built at the command line's boundary.

An option's type is its field's range in the one table of :data:`repmlp.tasks.limits.OPTIONS` (a value the
command line refuses, a config refuses too, in the same words), its choices :data:`repmlp.tasks.config.CHOICES`,
and a face or segmentation option's default its task's config's. Options every task shares are spelt as
classification spells them.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from repmlp.commands._common import (
    add_force_argument,
    add_init_argument,
    add_limit_argument,
    add_run_arguments,
    model_arg,
    model_name,
)
from repmlp.data.loader import default_workers
from repmlp.tasks import face, segmentation
from repmlp.tasks.config import CHOICES
from repmlp.tasks.limits import MAX_WORKERS, OPTIONS

__all__ = ["TASK_OPTIONS", "option_type", "add_option", "add_model_options", "classification_arguments"]


def option_type(name: str) -> Callable[[str], int | float]:
    """The ``argparse`` type of config field ``name``: a number in its range of :data:`OPTIONS`."""
    rng = OPTIONS[name]

    def parse(text: str) -> int | float:
        try:
            value = int(text) if rng.integer else float(text)
        except ValueError:
            kind = "an integer" if rng.integer else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not rng.contains(value):
            raise argparse.ArgumentTypeError(f"must be in {rng.describe()}, got {text}")
        return value

    parse.__name__ = "integer" if rng.integer else "number"
    return parse


def add_option(group: Any, flag: str, help: str | None = None, **kwargs: Any) -> None:
    """``flag`` with its field's type (:func:`option_type`) or choices, unless ``kwargs`` say otherwise."""
    name = flag[2:].replace("-", "_")
    if name in OPTIONS:
        kwargs.setdefault("type", option_type(name))
    elif name in CHOICES:
        kwargs.setdefault("choices", CHOICES[name])
    group.add_argument(flag, help=help, **kwargs)


class _ModelArgs(argparse.Action):
    """``--model-arg KEY=VALUE`` (repeatable) into one mapping: the config's ``model_args``."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:  # noqa: ANN001
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, {**(current if isinstance(current, dict) else {}), value[0]: value[1]})


def add_model_options(group: Any, model: str | None, example: str) -> None:
    """``--model`` (default ``model``) and ``--model-arg``."""
    group.add_argument(
        "--model",
        default=model,
        type=model_name,
        help="registered repmlp model, or a timm / torchvision model name",
    )
    group.add_argument(
        "--model-arg",
        dest="model_args",
        type=model_arg,
        action=_ModelArgs,
        default={},
        metavar="KEY=VALUE",
        help=f"extra model option, VALUE as JSON (e.g. {example}); repeatable",
    )


def add_workers_option(group: Any, default: int | None = None) -> None:
    """``--workers``: data loading processes (default: one per CPU core this process may use)."""
    if default is None:
        add_option(group, "--workers", "data loading processes (default: one per CPU core this process may use)",
                   default=min(default_workers(), MAX_WORKERS))  # fmt: skip
    else:
        add_option(group, "--workers", "data loading processes", default=default)


def classification_arguments(p: argparse.ArgumentParser) -> None:
    """``repmlp train``'s own options (classification): their defaults come from the preset (``None``)."""
    g = p.add_argument_group("data")
    add_option(g, "--dataset", default="fashion-mnist")
    g.add_argument("--data-dir", default=None, help="fashion-mnist: folder of the IDX files (default: Debian's, "
                   "else the download cache); cifar10: folder holding cifar-10-batches-py; imagefolder: folder with "
                   "train/ and val/")  # fmt: skip
    g.add_argument("--download", action="store_true", help="fetch Fashion-MNIST with torchvision if missing")
    add_limit_argument(g, "--train-limit", "training examples")
    add_limit_argument(g, "--val-limit", "validation examples")
    add_workers_option(g)
    g = p.add_argument_group("model and recipe (defaults come from --preset)")
    add_option(g, "--preset", "fmnist (default for fashion-mnist), cifar (the paper's CIFAR-10 recipe, default for "
               "cifar10), imagenet (the paper's ImageNet recipe); an image folder's default is the model's own (the "
               "--init file's) recipe, its batch fitted to the folder's size")  # fmt: skip
    add_model_options(g, None, "--model-arg kernel_sizes=[3]")
    flip = argparse.BooleanOptionalAction
    for flag, help, kwargs in [
        ("--epochs", None, {}), ("--batch-size", "global batch size (split over processes)", {}),
        ("--eval-batch-size", None, {"default": 512}), ("--optimizer", None, {}), ("--lr", "peak learning rate", {}),
        ("--min-lr", "final learning rate of the cosine schedule", {}), ("--momentum", "SGD momentum", {}),
        ("--nesterov", None, {"action": flip}), ("--weight-decay", None, {}), ("--schedule", None, {}),
        ("--warmup-epochs", None, {}), ("--label-smoothing", None, {}),
        ("--mixup", "mixup Beta(a, a) parameter; 0 disables", {}),
        ("--pad", "random-crop padding in pixels (in-memory data)", {}),
        ("--flip", "random left-right flips", {"action": flip}), ("--autoaugment", "(imagefolder)", {"action": flip}),
        ("--img-size", "crop size (imagefolder; default: the model's own input size, with --init the init file's); "
         "zero-pad to it (fashion-mnist, cifar10)", {}),
        ("--seed", "random seed (default: 0)", {"default": 0}),
    ]:  # fmt: skip
        add_option(g, flag, help, **{"default": None, **kwargs})
    add_init_argument(g, help="fine-tune: start from the weights of this training-time model file (e.g. "
                      "runs/X/model.safetensors); a classifier for another number of classes is re-initialised; "
                      "without --model, the file's model and options are used")  # fmt: skip
    g = p.add_argument_group("run")
    g.add_argument("--output", default=None, help="run folder (default: runs/<date>-<time>)")
    add_run_arguments(g, step="optimizer step", resume_help="continue the run in --output from its last checkpoint, "
                      "with its saved settings (options that would change them are refused; --device, --workers, "
                      "--data-dir, ... may change)")  # fmt: skip
    g.add_argument(
        "--channels-last", action=flip, default=None, help="channels-last memory format (default: on CUDA)"
    )
    add_option(g, "--bench-batch-size", default=128)
    g.add_argument("--no-export", action="store_true", help="skip the ONNX export")
    g.add_argument("--no-bench", action="store_true", help="skip the speed benchmark")


def _shared_train(
    p: argparse.ArgumentParser, defaults: dict[str, Any], data: str, init: str, *aliases: str
) -> None:
    """The training options face recognition and segmentation share (``defaults``: their config's)."""
    p.add_argument("--data-dir", required=True, help=data)
    add_init_argument(p, help=init, aliases=aliases)
    add_model_options(p, defaults["model"], "--model-arg img_size=64")
    p.add_argument("--output", required=True, help="run folder: new or empty, or a run to --resume")
    for flag, help in [
        ("--batch-size", "global batch size, split over torchrun processes"),
        ("--lr", "base learning rate"),
        ("--momentum", "SGD momentum"),
        ("--weight-decay", "weight decay"),
        ("--seed", "random seed (default: 0)"),
        ("--log-interval", "log the mean loss every N iterations"),
    ]:
        add_option(p, flag, help, default=defaults[flag[2:].replace("-", "_")])
    add_limit_argument(p, "--train-limit", "training images")
    add_workers_option(p)
    add_run_arguments(p, step="iteration", resume_help="continue the run in --output from its last checkpoint "
                      "(repeat the run's options)")  # fmt: skip


def _int_list(text: str) -> list[int]:
    """``--lr-steps``: increasing positive iterations, comma- or space-separated."""
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        values = []
    if (
        not values
        or len(values) > 1000
        or values != sorted(values)
        or not 1 <= values[0] <= values[-1] <= 10**9
    ):
        raise argparse.ArgumentTypeError(
            f"expected up to 1000 increasing iterations in 1..10**9, got {text!r}"
        )
    return values


def face_train_arguments(p: argparse.ArgumentParser) -> None:
    d = {f.name: f.default for f in dataclasses.fields(face.TrainConfig)}
    _shared_train(p, d, "folder of aligned face crops, one sub-folder per identity", "start from a training-time "
                  "model file of the same architecture (e.g. a classification run of it): the trunk is loaded, the "
                  "embedding head starts fresh")  # fmt: skip
    for flag, help in [
        ("--head-weight-decay", "weight decay of the embedding layer and AM-Softmax class weights"),
        ("--iterations", "training iterations (the paper's: 420000)"),
        ("--am-scale", "AM-Softmax scale s"),
        ("--am-margin", "AM-Softmax margin m"),
        ("--img-size", "face crop size (default: --model-arg img_size, else 96)"),
    ]:
        add_option(p, flag, help, default=d[flag[2:].replace("-", "_")])
    p.add_argument("--lr-steps", type=_int_list, default=None, help="iterations at which the LR is divided by 10 "
                   "(default: the paper's 252000,364000,406000 of 420000, scaled to --iterations)")  # fmt: skip


def seg_train_arguments(p: argparse.ArgumentParser) -> None:
    d = {f.name: f.default for f in dataclasses.fields(segmentation.TrainConfig)}
    _shared_train(p, d, "Cityscapes root (leftImg8bit/ and gtFine/ with labelTrainIds)", "ImageNet-trained backbone: "
                  "a training-time classification model file from `repmlp train` or `repmlp import`; FC1/FC2 are "
                  "re-initialised (the paper's), everything else inherited", "--backbone-weights")  # fmt: skip
    for flag, help in [
        ("--epochs", "training epochs"),
        ("--iterations", "training iterations (default: from --epochs)"),
        ("--power", "poly LR power"),
        ("--head-lr-mult", "LR multiplier of the PSP and auxiliary heads (PSPNet's code: 10)"),
        ("--crop-size", "training crop, the model's img_size (default: --model-arg img_size, else 713)"),
        ("--scale-min", "random scale lower bound"),
        ("--scale-max", "random scale upper bound"),
        ("--aux-weight", "auxiliary loss weight"),
        ("--train-split", "Cityscapes split to train on"),
    ]:
        add_option(p, flag, help, default=d[flag[2:].replace("-", "_")])


def _shared_eval(p: argparse.ArgumentParser, task: str) -> None:
    p.add_argument("--checkpoint", required=True, help=f"model file written by `repmlp train --task {task}`")
    p.add_argument("--check-conversion", action="store_true", help="also evaluate the training-form model and "
                   "report both (train-form checkpoints)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the metrics as JSON (as for classification)")
    p.add_argument("--output-json", default=None, help="also write the metrics to this JSON file")
    add_force_argument(p, "--output-json")
    add_workers_option(p, default=2)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")


def face_eval_arguments(p: argparse.ArgumentParser) -> None:
    _shared_eval(p, "face")
    p.add_argument(
        "--pairs", default=None, help="verification pairs: LFW pairs.txt or lines '<path1> <path2> <0|1>'"
    )
    p.add_argument("--pairs-root", default=None, help="folder the pair paths are relative to (default: the pairs "
                   "file's folder)")  # fmt: skip
    add_option(p, "--folds", "verification folds", default=10)
    p.add_argument("--probe", default=None, help="identification probe set: one sub-folder per identity")
    p.add_argument("--gallery", default=None, help="identification gallery: the probes' mates plus distractors, one "
                   "sub-folder per identity")  # fmt: skip
    add_option(p, "--batch-size", "embedding batch size", default=256)


def seg_eval_arguments(p: argparse.ArgumentParser) -> None:
    _shared_eval(p, "seg")
    p.add_argument("--data-dir", required=True, help="Cityscapes root")
    p.add_argument("--split", default="val", help="split to evaluate")
    add_option(
        p, "--mode", "slide: crop-size windows; whole: one pass per image (no RepMLPs)", default="slide"
    )
    add_option(p, "--crop-size", "window size (default: the model's img_size)", default=None)
    add_option(p, "--val-limit", "evaluate the first N images only", default=None)


# task -> phase -> the function that adds that task's options to a parser
TASK_OPTIONS: dict[str, dict[str, Callable[[argparse.ArgumentParser], None]]] = {
    "face": {"train": face_train_arguments, "eval": face_eval_arguments},
    "seg": {"train": seg_train_arguments, "eval": seg_eval_arguments},
}
