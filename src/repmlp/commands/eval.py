"""``repmlp eval``: top-1 / top-5 accuracy of a training-time or deployed checkpoint on a data set.

The checkpoint's metadata names the model and its form; the data set options are those of ``repmlp train``
(by default the data set the checkpoint was trained on). ``--task face|seg`` evaluates with the face /
segmentation protocols instead (their options: ``repmlp eval --task face --help``).
"""

from __future__ import annotations

import argparse
import json
import logging

from ..errors import UserError
from ._common import checkpoint_input_size, int_at_least
from .train import add_task_option, print_help_if_asked, run_task

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from ..cli import HelpFormatter
    from ..data import DATASETS

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
        "--val-limit", type=int_at_least(1), default=None, metavar="N", help="first N examples only"
    )
    p.add_argument("--img-size", type=int_at_least(8), default=None, help="centre-crop size (imagefolder)")
    p.add_argument("--batch-size", type=int_at_least(1), default=512)
    p.add_argument("--workers", type=int_at_least(0), default=2)
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run, accepts_extra=lambda a: a.task != "cls")
    return p


def run(args: argparse.Namespace) -> int:
    if print_help_if_asked(args):
        return 0
    if args.task != "cls":
        return run_task(args, "eval", "eval")
    if not args.checkpoint:
        raise UserError("eval needs --checkpoint FILE (model.safetensors or deploy.safetensors)")
    from ..checkpoint import load_model
    from ..data import DataConfig, build_data
    from ..engine import resolve_device
    from ..files import CheckpointError
    from ..tasks.classification import evaluate

    device = resolve_device(args.device)
    model, info = load_model(args.checkpoint, device=device)
    extra = info.get("extra") or {}
    dataset = args.dataset or extra.get("dataset") or "fashion-mnist"
    # The training run's data folder (recorded in the checkpoint) unless another is given.
    data_dir = args.data_dir or (extra.get("data_dir") if dataset == extra.get("dataset") else None)
    kwargs = info["model_kwargs"]
    # An imported model records its input size and the preprocessing its weights were evaluated with.
    recorded = extra.get("input_size")
    img_size = args.img_size or kwargs.get("img_size") or (recorded[1] if recorded else None)
    data = build_data(
        DataConfig(
            dataset=dataset,
            data_dir=data_dir,
            download=args.download,
            eval_batch_size=args.batch_size,
            val_limit=args.val_limit,
            img_size=img_size,
            eval_preprocessing=None if args.img_size else extra.get("eval_preprocessing"),
            workers=args.workers,
            need_train=False,
        ),
        device=device,
    )
    if kwargs.get("num_classes") not in (None, data.num_classes):
        raise CheckpointError(
            f"{args.checkpoint} predicts {kwargs['num_classes']} classes but {dataset} has {data.num_classes}"
        )
    # The model's own input channels (a foreign model's checkpoint may not record in_chans).
    in_chans = checkpoint_input_size(model, info)[0]
    if in_chans != data.in_chans:
        raise CheckpointError(
            f"{args.checkpoint} takes {in_chans}-channel images but {dataset} has {data.in_chans}"
        )
    if kwargs.get("img_size") not in (None, data.img_size):
        raise CheckpointError(
            f"{args.checkpoint} takes {kwargs['img_size']}px images but {dataset} has {data.img_size}px"
        )
    res = evaluate(model, data.val, device)
    res.update(
        model=info["model"],
        form=info["form"],
        precision=info.get("precision", "fp32"),
        dataset=dataset,
        checkpoint=str(args.checkpoint),
    )
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        print(
            f"{info['model']} ({info['form']} form, {res['precision']}) on {dataset}, {res['n']} examples: "
            f"top-1 {res['top1']:.2f}%  top-5 {res['top5']:.2f}%  loss {res['loss']:.4f}"
        )
    return 0
