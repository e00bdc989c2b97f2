"""The options of ``repmlp train`` and ``repmlp eval --task face|seg``, from the tasks' configs: an option's
type is its field's range in :data:`repmlp.tasks.limits.OPTIONS` (a value the command line refuses, a config
refuses too, in the same words), its choices the config's and, but for classification's recipe (the preset's),
its default the config's. Options every task shares are spelt as classification spells them."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from repmlp.commands._common import (
    add_force_argument,
    add_limit_argument,
    add_model_options,
    add_option,
    add_options,
)
from repmlp.data.loader import default_workers
from repmlp.tasks import classification, face, segmentation
from repmlp.tasks.config import EvalOptions, TrainOptions
from repmlp.tasks.limits import OPTIONS

__all__ = ["TASK_OPTIONS", "classification_arguments"]


def add_workers_option(group: argparse._ActionsContainer, default: int | None = None) -> None:
    """``--workers``: data loading processes (default: one per CPU core this process may use)."""
    auto = min(default_workers(), OPTIONS["workers"].hi)
    help = "data loading processes" + (
        " (default: one per CPU core this process may use)" if default is None else ""
    )
    add_option(group, "--workers", help, default=auto if default is None else default)


def add_run_arguments(group: argparse._ActionsContainer, *, resume_help: str, step: str) -> None:
    """The run options every task's training shares; ``step`` names a training step in the help (optimizer
    step, iteration)."""
    add_option(group, "--resume", resume_help + "; --resume auto: continue it if --output holds a checkpoint, "
               "else start it, and exit 0 if it has finished (for jobs a scheduler may preempt and rerun)",
               TrainOptions, action="store", nargs="?", const=True, choices=["auto"])  # fmt: skip
    add_option(group, "--ckpt-every", f"checkpoint every STEPS {step}s as well (0: only at the usual points; "
               "default: 200)", TrainOptions, default=200, metavar="STEPS")  # fmt: skip
    add_options(group, TrainOptions, {
        "--device": "auto (CUDA if available), cpu, cuda, cuda:N",
        "--amp": "mixed precision (default: on CUDA); it changes the maths, so a resumed run keeps it",
        "--threads": "CPU threads (default: torch's)",
        "--compile": "torch.compile the training step (default auto: on CUDA unless the step runs as CUDA graphs, "
        "off on CPU, where it measured slower); a failed compilation falls back to eager with one logged line",
        "--cuda-graphs": "replay the model's forward and backward as CUDA graphs, so that the host launches two "
        "graphs a step instead of every kernel (default auto: on for classification on one CUDA device without "
        "--compile on; a failed capture falls back to eager with one logged line)",
    })  # fmt: skip
    group.add_argument("--no-fast-training", dest="fast_training", action="store_false",
                       help="train the plain modules, not their training form (repmlp.engine.forms)")  # fmt: skip


def add_init_argument(group: argparse._ActionsContainer, help: str, *aliases: str) -> None:
    """``--init FILE``: start training from the weights of a model file (:mod:`repmlp.tasks.finetune`);
    ``aliases``: older spellings of the same option."""
    group.add_argument("--init", *aliases, dest="init", default=None, metavar="FILE", help=help)


def classification_arguments(p: argparse.ArgumentParser) -> None:
    """``repmlp train``'s own options (classification): the recipe's defaults come from the preset (``None``)."""
    cfg = classification.TrainConfig
    g = p.add_argument_group("data")
    add_options(g, cfg, {
        "--dataset": None,
        "--data-dir": "fashion-mnist: folder of the IDX files (default: Debian's, else the download cache); "
        "cifar10: folder holding cifar-10-batches-py; imagefolder: folder with train/ and val/",
        "--download": "fetch Fashion-MNIST with torchvision if missing",
    })  # fmt: skip
    add_limit_argument(g, "--train-limit", "training examples")
    add_limit_argument(g, "--val-limit", "validation examples")
    add_workers_option(g)
    g = p.add_argument_group("model and recipe (defaults come from --preset)")
    add_option(g, "--preset", "fmnist (default for fashion-mnist), cifar (the paper's CIFAR-10 recipe, default for "
               "cifar10), imagenet (the paper's ImageNet recipe); an image folder's default is the model's own (the "
               "--init file's) recipe, its batch fitted to the folder's size", cfg, default=None)  # fmt: skip
    add_model_options(g, None, "--model-arg kernel_sizes=[3]")
    add_options(g, cfg, {
        "--epochs": None, "--batch-size": "global batch size (split over processes)", "--optimizer": None,
        "--lr": "peak learning rate", "--min-lr": "final learning rate of the cosine schedule",
        "--momentum": "SGD momentum", "--nesterov": None, "--weight-decay": None, "--schedule": None,
        "--warmup-epochs": None, "--label-smoothing": None, "--mixup": "mixup Beta(a, a) parameter; 0 disables",
        "--pad": "random-crop padding in pixels (in-memory data)", "--flip": "random left-right flips",
        "--autoaugment": "(imagefolder)", "--img-size": "crop size (imagefolder; default: the model's own input "
        "size, with --init the init file's); zero-pad to it (fashion-mnist, cifar10)",
    }, default=None)  # fmt: skip
    add_options(g, cfg, {"--eval-batch-size": None, "--seed": "random seed (default: 0)"})
    add_init_argument(g, "fine-tune: start from the weights of this training-time model file (e.g. "
                      "runs/X/model.safetensors); a classifier for another number of classes is re-initialised; "
                      "without --model, the file's model and options are used")  # fmt: skip
    g = p.add_argument_group("run")
    g.add_argument("--output", default=None, help="run folder (default: runs/<date>-<time>)")
    add_run_arguments(g, step="optimizer step", resume_help="continue the run in --output from its last checkpoint, "
                      "with its saved settings (options that would change them are refused; --device, --workers, "
                      "--data-dir, ... may change)")  # fmt: skip
    add_option(g, "--channels-last", "channels-last memory format (default: on CUDA)", cfg, default=None)
    add_options(g, cfg, {"--bench-batch-size": None, "--no-export": "skip the ONNX export",
                         "--no-bench": "skip the speed benchmark"})  # fmt: skip


def _shared_train(
    p: argparse.ArgumentParser, config: type[TrainOptions], data: str, init: str, *aliases: str
) -> None:
    """The training options face recognition and segmentation share (their defaults: ``config``'s)."""
    p.add_argument("--data-dir", required=True, help=data)
    add_init_argument(p, init, *aliases)
    add_model_options(p, config.model, "--model-arg img_size=64")
    p.add_argument("--output", required=True, help="run folder: new or empty, or a run to --resume")
    add_options(p, config, {
        "--batch-size": "global batch size, split over torchrun processes", "--lr": "base learning rate",
        "--momentum": "SGD momentum", "--weight-decay": "weight decay", "--seed": "random seed (default: 0)",
        "--log-interval": "log the mean loss every N iterations",
    })  # fmt: skip
    add_limit_argument(p, "--train-limit", "training images")
    add_workers_option(p)
    add_run_arguments(p, step="iteration", resume_help="continue the run in --output from its last checkpoint "
                      "(repeat the run's options)")  # fmt: skip


def _iterations(text: str) -> list[int]:
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
    _shared_train(p, face.TrainConfig, "folder of aligned face crops, one sub-folder per identity", "start from a "
                  "training-time model file of the same architecture (e.g. a classification run of it): the trunk is "
                  "loaded, the embedding head starts fresh")  # fmt: skip
    add_options(p, face.TrainConfig, {
        "--head-weight-decay": "weight decay of the embedding layer and AM-Softmax class weights",
        "--iterations": "training iterations (the paper's: 420000)", "--am-scale": "AM-Softmax scale s",
        "--am-margin": "AM-Softmax margin m", "--img-size": "face crop size (default: --model-arg img_size, else 96)",
    })  # fmt: skip
    p.add_argument("--lr-steps", type=_iterations, default=None, help="iterations at which the LR is divided by 10 "
                   "(default: the paper's 252000,364000,406000 of 420000, scaled to --iterations)")  # fmt: skip


def seg_train_arguments(p: argparse.ArgumentParser) -> None:
    _shared_train(p, segmentation.TrainConfig, "Cityscapes root (leftImg8bit/ and gtFine/ with labelTrainIds)",
                  "ImageNet-trained backbone: a training-time classification model file from `repmlp train` or "
                  "`repmlp import`; FC1/FC2 are re-initialised (the paper's), everything else inherited",
                  "--backbone-weights")  # fmt: skip
    add_options(p, segmentation.TrainConfig, {
        "--epochs": "training epochs", "--iterations": "training iterations (default: from --epochs)",
        "--power": "poly LR power",
        "--head-lr-mult": "LR multiplier of the PSP and auxiliary heads (PSPNet's code: 10)",
        "--crop-size": "training crop, the model's img_size (default: --model-arg img_size, else 713)",
        "--scale-min": "random scale lower bound", "--scale-max": "random scale upper bound",
        "--aux-weight": "auxiliary loss weight", "--train-split": "Cityscapes split to train on",
    })  # fmt: skip


def _shared_eval(p: argparse.ArgumentParser, task: str, config: type[EvalOptions]) -> None:
    p.add_argument("--checkpoint", required=True, help=f"model file written by `repmlp train --task {task}`")
    add_options(p, config, {
        "--check-conversion": "also evaluate the training-form model and report both (train-form checkpoints)",
        "--json": "print the metrics as JSON (as for classification)",
        "--output-json": "also write the metrics to this JSON file",
    })  # fmt: skip
    add_force_argument(p, "--output-json")
    add_workers_option(p, default=2)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")


def face_eval_arguments(p: argparse.ArgumentParser) -> None:
    _shared_eval(p, "face", face.EvalConfig)
    add_options(p, face.EvalConfig, {
        "--pairs": "verification pairs: LFW pairs.txt or lines '<path1> <path2> <0|1>'",
        "--pairs-root": "folder the pair paths are relative to (default: the pairs file's folder)",
        "--folds": "verification folds", "--probe": "identification probe set: one sub-folder per identity",
        "--gallery": "identification gallery: the probes' mates plus distractors, one sub-folder per identity",
        "--batch-size": "embedding batch size",
    })  # fmt: skip


def seg_eval_arguments(p: argparse.ArgumentParser) -> None:
    _shared_eval(p, "seg", segmentation.EvalConfig)
    p.add_argument("--data-dir", required=True, help="Cityscapes root")
    add_options(p, segmentation.EvalConfig, {
        "--split": "split to evaluate", "--mode": "slide: crop-size windows; whole: one pass per image (no RepMLPs)",
        "--crop-size": "window size (default: the model's img_size)", "--val-limit": "evaluate the first N images only",
    })  # fmt: skip


# task -> phase -> the function that adds that task's options to a parser
TASK_OPTIONS: dict[str, dict[str, Callable[[argparse.ArgumentParser], None]]] = {
    "face": {"train": face_train_arguments, "eval": face_eval_arguments},
    "seg": {"train": seg_train_arguments, "eval": seg_eval_arguments},
}
