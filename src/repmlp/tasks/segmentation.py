"""Semantic segmentation (paper Sec. 4.4): PSPNet on Cityscapes, mIoU of the converted model.

Training follows the official PSPNet configuration the paper adopts: SGD (momentum 0.9), poly
learning rate ``base * (1 - it/max_it)^0.9`` with base 0.01 (the head at 10x, as PSPNet's code does),
weight decay 1e-4, random scale (0.5-2) / crop / flip, ignore label 255, main + 0.4 x auxiliary loss;
the paper trains 200 epochs at a global batch size of 16 with 713x713 crops.

Evaluation is single-scale: images no larger than the crop are padded to it and predicted in one
pass; larger ones (Cityscapes' 1024x2048 frames) are predicted with a sliding ``crop_size`` window
(stride 2/3 of the crop, overlapping logits averaged), which is what a model whose RepMLPs are built
for one resolution requires. ``--mode whole`` predicts whole images in one pass instead (models
without RepMLPs only).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp.engine import (
    DistInfo,
    all_reduce_sum,
    cleanup_distributed,
    progress,
    setup_distributed,
    unwrap,
)
from repmlp.errors import UserError
from repmlp.io.model_file import CheckpointError, compare_state, read_model_file
from repmlp.models.pspnet import PSPNet
from repmlp.models.registry import build_model
from repmlp.tasks._common import (
    EvalOptions,
    TrainOptions,
    check_train_options,
    evaluate_both_forms,
    load_for_eval,
    model_options,
    non_finite,
    per_process_batch,
    require_task_model,
    resolve_img_size,
    save_run,
    start_run,
    training_loader,
    write_json,
)
from repmlp.tasks.finetune import report_lines

__all__ = [
    "train",
    "evaluate",
    "poly_lr",
    "sliding_window_logits",
    "predict",
    "segmentation_metrics",
]

log = logging.getLogger(__name__)


def poly_lr(base: float, iteration: int, max_iterations: int, power: float = 0.9) -> float:
    """Poly policy: ``base * (1 - iteration / max_iterations) ** power``."""
    return base * (1.0 - min(iteration, max_iterations) / max_iterations) ** power


@dataclass
class SegTrainConfig(TrainOptions):
    """``repmlp train --task seg``: the shared training options and PSPNet's own."""

    epochs: int
    iterations: int | None
    power: float
    head_lr_mult: float
    crop_size: int | None
    scale_min: float
    scale_max: float
    aux_weight: float
    train_split: str


@dataclass
class SegEvalConfig(EvalOptions):
    """``repmlp eval --task seg``: a split of a Cityscapes folder, sliding-window or whole images."""

    data_dir: str
    split: str
    mode: str
    crop_size: int | None
    val_limit: int | None


class SegTrainModule(nn.Module):
    """PSPNet + its loss as one module (one DDP wrapper): images ``(N,3,h,w)``, labels ``(N,h,w)`` -> loss."""

    def __init__(self, model: nn.Module, aux_weight: float) -> None:
        super().__init__()
        self.model, self.aux_weight = model, aux_weight

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        from repmlp.data.cityscapes import IGNORE_INDEX
        from repmlp.tasks.losses import pspnet_loss

        out = self.model(images)
        main, aux = out if isinstance(out, tuple) else (out, None)
        return pspnet_loss(main, aux, labels, aux_weight=self.aux_weight, ignore_index=IGNORE_INDEX)


def _param_groups(model: nn.Module, wd: float, head_mult: float) -> list[dict[str, Any]]:
    backbone = getattr(model, "backbone", None)
    back_ids = {id(p) for p in backbone.parameters()} if backbone is not None else set()
    back = [p for p in model.parameters() if id(p) in back_ids]
    head = [p for p in model.parameters() if id(p) not in back_ids]
    return [
        {"params": back, "weight_decay": wd, "lr_mult": 1.0},
        {"params": head, "weight_decay": wd, "lr_mult": head_mult},
    ]


def check_options(args: SegTrainConfig) -> None:
    """Option checks of a segmentation run (one :class:`UserError` each), before anything is loaded."""
    check_train_options(args)
    if args.scale_min > args.scale_max:
        raise UserError(f"--scale-min {args.scale_min} is larger than --scale-max {args.scale_max}")


def train(args: SegTrainConfig) -> int:
    """``repmlp train --task seg``: train PSPNet, save the training-form and converted models."""
    from repmlp.engine import run_in_processes

    check_options(args)
    return run_in_processes(args, _train)


def _is_reinitialised(key: str) -> bool:
    """FC1/FC2 of the Global Perceptrons: their size depends on the resolution (paper Sec. 4.4)."""
    return ".global_perceptron.fc1." in key or ".global_perceptron.fc2." in key


def load_backbone_weights(model: PSPNet, path: str, *, flag: str = "--backbone-weights") -> dict[str, Any]:
    """Load ImageNet-trained backbone weights (a training-form model file) into ``model.backbone``.

    Everything is inherited except the Global Perceptrons' FC1/FC2, which keep their fresh initialisation
    (their shapes follow the resolution, as in the paper); the classifier (``fc.*``) of the ImageNet model
    is dropped. Any other difference (a backbone tensor the file lacks, a file tensor the backbone lacks, a
    shape) is one :class:`UserError` listing them. Returns ``{"loaded": [...], "reinitialised": [...],
    "ignored": [...]}`` (backbone keys) and the file's ``"model"``.
    """
    try:  # the file's metadata and tensors checked as any model file's
        tensors, fm = read_model_file(path)
    except CheckpointError as exc:
        raise UserError(f"{flag}: {exc}") from None
    if fm.form == "deploy":
        raise UserError(
            f"{path} holds a converted (deploy-form) model; backbone weights must be the training form "
            "(conv and BN separate, RepMLP branches unmerged) so fine-tuning can continue from them"
        )
    own = {k: v for k, v in model.backbone.state_dict().items() if not _is_reinitialised(k)}
    ignored = sorted(k for k in tensors if k.startswith("fc."))
    kept = {k: v for k, v in tensors.items() if k not in ignored and not _is_reinitialised(k)}
    compare_state(f"backbone weights {path} (from {fm.model})", "the backbone", own, kept)
    model.backbone.load_state_dict(kept, strict=False)
    reinit = sorted(k for k in model.backbone.state_dict() if _is_reinitialised(k))
    return {"loaded": sorted(kept), "reinitialised": reinit, "ignored": ignored, "model": fm.model}


def _build(
    args: SegTrainConfig, kwargs: dict[str, Any], procs: DistInfo
) -> tuple[nn.Module, dict[str, Any] | None]:
    """The PSPNet of ``args``, with ``--init`` (``--backbone-weights``) loaded into its backbone; returns
    it and what was loaded (``None`` without ``--init``)."""
    from repmlp.tasks.finetune import file_sha256

    model, _ = build_model(args.model, kwargs)
    require_task_model(model, "seg", args.model)
    if not args.init:
        return model, None
    report = load_backbone_weights(model, args.init, flag="--backbone-weights/--init")
    init = {
        "path": args.init,
        "sha256": file_sha256(args.init),
        "model": report["model"],
        "loaded": len(report["loaded"]),
        "reinitialised": report["reinitialised"],
    }
    if procs.is_main:
        log.info(
            "backbone: %d tensors inherited from %s, %d re-initialised (FC1/FC2)",
            len(report["loaded"]),
            args.init,
            len(report["reinitialised"]),
        )
    return model, init


def _check_batches(args: SegTrainConfig, procs: DistInfo, images: int) -> int:
    """The per-process batch size; BatchNorm batches of one image are a :class:`UserError`."""
    per_process = per_process_batch(args.batch_size, procs)
    sync_bn = procs.enabled and procs.device.type == "cuda"
    if (args.batch_size if sync_bn else per_process) < 2:
        # The pyramid's 1x1 bin leaves BatchNorm one value per channel: training cannot normalise it.
        raise UserError(
            f"--batch-size {args.batch_size} gives BatchNorm batches of 1 "
            f"({'global' if sync_bn else 'per process'}); use at least 2"
            + ("" if sync_bn else f" per process ({2 * procs.world} in all)")
        )
    if images < args.batch_size:
        raise UserError(f"{images} training image(s) are fewer than --batch-size {args.batch_size}")
    return per_process


def _train(args: SegTrainConfig, procs: DistInfo) -> int:
    from repmlp.data.cityscapes import CityscapesSegmentation
    from repmlp.engine import prepare_module, train_loop, write_run_report

    torch.manual_seed(args.seed)
    kwargs = model_options(args)
    # The crops are the model's inputs: its RepMLPs are built for exactly that size.
    crop = resolve_img_size(kwargs, "--crop-size", args.crop_size, 713)
    dataset = CityscapesSegmentation(
        args.data_dir, args.train_split, crop_size=crop, scale_range=(args.scale_min, args.scale_max)
    )
    per_process = _check_batches(args, procs, min(len(dataset), args.train_limit or len(dataset)))
    model, init = _build(args, kwargs, procs)
    loader = training_loader(dataset, args, procs, per_process)
    max_it = args.iterations or args.epochs * len(loader)
    mults = [1.0, args.head_lr_mult]  # the groups of _param_groups: backbone, heads
    # Poly policy as a function of the step, each group at its multiple of --lr (head: --head-lr-mult).
    opts, state = start_run(
        args, procs, max_it, lambda step: [args.lr * m * poly_lr(1.0, step, max_it, args.power) for m in mults],
        kwargs,
    )  # fmt: skip
    net = prepare_module(SegTrainModule(model, args.aux_weight), procs)
    model = unwrap(net).model
    optimizer = torch.optim.SGD(_param_groups(model, args.weight_decay, args.head_lr_mult), lr=args.lr,
                                momentum=args.momentum)  # fmt: skip
    if procs.is_main:
        log.info(
            "seg: %d images, %s (%d params), %d iterations (%d per epoch) on %d process(es)",
            loader.num_samples,
            args.model,
            sum(p.numel() for p in model.parameters()),
            max_it,
            len(loader),
            procs.world,
        )
    loop = train_loop(net, optimizer, loader, opts, procs, state)
    history = loop.history
    if procs.is_main:
        meta = {"task": "seg", "epochs": args.epochs, "iterations": max_it, "crop_size": crop}
        input_size = (getattr(model, "in_chans", 3), crop, crop)
        check = save_run(opts.output, model, args.model, kwargs, meta, history, input_size)
        section = [
            f"- Data: {loader.num_samples} images of {args.data_dir} ({args.train_split}), crops {crop}x{crop}, "
            f"scale {args.scale_min:g}-{args.scale_max:g}",
            f"- Model: `{args.model}` {kwargs}, auxiliary loss weight {args.aux_weight:g}",
            f"- Recipe: {max_it} iterations, batch {args.batch_size}, SGD poly lr {args.lr:g} (power "
            f"{args.power:g}, heads x{args.head_lr_mult:g}), momentum {args.momentum:g}, weight decay "
            f"{args.weight_decay:g}, seed {args.seed}, {procs.world} process(es), "
            f"{loop.mode} training step",
            "- Files: `model.safetensors` (training form), `deploy.safetensors` (converted), "
            "`checkpoint.safetensors` (for --resume); evaluate with `repmlp eval --task seg`",
            f"- Conversion: {check.summary()}",
            *report_lines(init),
        ]
        write_run_report(opts.output, f"repmlp segmentation run: {args.model}", history, section)
        return 0 if check.equivalent else 1
    return 0


@torch.no_grad()
def sliding_window_logits(model: nn.Module, image: Tensor, crop: tuple[int, int], num_classes: int) -> Tensor:
    """Single-scale sliding-window logits ``(N, K, H, W)`` for images ``(N, 3, H, W)`` of any size.

    The image is zero-padded (the mean colour after normalisation) to at least ``crop``; windows of
    ``crop`` with stride ``ceil(2/3 crop)`` (the last one flush with the border) cover it, each window
    is predicted at exactly ``crop`` (what a resolution-specific RepMLP model needs), and overlapping
    logits are averaged.
    """
    n, _, h, w = image.shape
    ch, cw = crop
    ph, pw = max(ch - h, 0), max(cw - w, 0)
    if ph or pw:
        image = F.pad(image, (0, pw, 0, ph))
    hh, ww = image.shape[-2:]
    sh, sw = math.ceil(ch * 2 / 3), math.ceil(cw * 2 / 3)
    rows = max(math.ceil((hh - ch) / sh), 0) + 1
    cols = max(math.ceil((ww - cw) / sw), 0) + 1
    logits = image.new_zeros(n, num_classes, hh, ww)
    count = image.new_zeros(1, 1, hh, ww)
    for r in range(rows):
        for c in range(cols):
            top, left = min(r * sh, hh - ch), min(c * sw, ww - cw)
            window = image[:, :, top : top + ch, left : left + cw]
            logits[:, :, top : top + ch, left : left + cw] += model(window).float()
            count[:, :, top : top + ch, left : left + cw] += 1
    return (logits / count)[:, :, :h, :w]


@torch.no_grad()
def _logits(model: nn.Module, image: Tensor, *, mode: str, crop: tuple[int, int], num_classes: int) -> Tensor:
    """Logits ``(N, K, H, W)`` of ``image`` ``(N, 3, H, W)`` (``mode``: ``slide`` or ``whole``)."""
    model.eval()
    if mode == "whole":
        try:
            return model(image)
        except ValueError as exc:  # a RepMLP model built for another resolution
            raise UserError(f"--mode whole: {exc}; use --mode slide") from None
    return sliding_window_logits(model, image, crop, num_classes)


@torch.no_grad()
def predict(model: nn.Module, image: Tensor, *, mode: str, crop: tuple[int, int], num_classes: int) -> Tensor:
    """Label map ``(N, H, W)`` of ``image`` ``(N, 3, H, W)`` (``mode``: ``slide`` or ``whole``)."""
    return _logits(model, image, mode=mode, crop=crop, num_classes=num_classes).argmax(1)


def segmentation_metrics(
    model: nn.Module,
    dataset,
    *,
    mode: str,
    crop: tuple[int, int],
    device: torch.device,
    procs: DistInfo | None = None,
    workers: int = 0,
    what: str = "the model",
) -> dict[str, Any]:
    """mIoU and per-class IoU of ``model`` over ``dataset`` (whole images), summed confusion matrix.

    Raises :class:`NonFiniteOutput` naming ``what`` when the model's logits hold NaN/inf (on every
    process: the count is summed first, so no process is left waiting in a collective).
    """
    from repmlp.data.cityscapes import CLASS_NAMES, IGNORE_INDEX, NUM_CLASSES
    from repmlp.tasks.metrics import confusion_matrix, iou_from_confusion

    procs = procs or DistInfo(device=device)
    indices = list(range(procs.rank, len(dataset), procs.world))
    subset = torch.utils.data.Subset(dataset, indices)
    loader = torch.utils.data.DataLoader(subset, batch_size=1, num_workers=workers)
    confusion = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    non_finite_images = torch.zeros((), dtype=torch.long, device=device)
    with progress(loader, len(loader), "eval", procs.is_main) as bar:  # closed (line cleared) on errors too
        for image, label in bar:
            logits = _logits(model, image.to(device), mode=mode, crop=crop, num_classes=NUM_CLASSES)
            non_finite_images += (~torch.isfinite(logits)).any().long()
            confusion += confusion_matrix(logits.argmax(1), label.to(device), NUM_CLASSES, IGNORE_INDEX)
    confusion = all_reduce_sum(confusion, procs)
    if all_reduce_sum(non_finite_images, procs).item():
        raise non_finite(what)
    miou, iou = iou_from_confusion(confusion.cpu())
    return {
        "miou": miou,
        "per_class_iou": {
            name: (None if math.isnan(v) else v) for name, v in zip(CLASS_NAMES, iou.tolist(), strict=True)
        },
        "images": len(dataset),
        "confusion_matrix": confusion.cpu().tolist(),
    }


def _crop_of(model_kwargs: dict[str, Any], override: int | None) -> tuple[int, int]:
    if override is not None:
        return (override, override)
    size = model_kwargs.get("img_size", 713)
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _fixed_resolution(model: nn.Module) -> bool:
    """Whether ``model`` holds RepMLPs, which take one input resolution only."""
    from repmlp.nn.block import RepMLPBlock

    return any(isinstance(m, RepMLPBlock) for m in model.modules())


def evaluate(args: SegEvalConfig) -> int:
    """``repmlp eval --task seg``: mIoU and per-class IoU of the converted model."""
    from repmlp.data.cityscapes import CityscapesSegmentation

    procs = setup_distributed(args.device)
    try:
        trained, deployed, meta = load_for_eval(args.checkpoint, procs.device, "seg")
        if args.check_conversion and trained is None:
            raise UserError(
                "--check-conversion needs a training-form checkpoint (this one is already converted)"
            )
        dataset = CityscapesSegmentation(args.data_dir, args.split)
        if args.val_limit:
            dataset = torch.utils.data.Subset(dataset, range(min(args.val_limit, len(dataset))))
        crop = _crop_of(meta.model_kwargs, args.crop_size)
        if args.mode == "whole" and _fixed_resolution(deployed):  # checked before any progress bar
            h, w = _crop_of(meta.model_kwargs, None)
            raise UserError(
                f"--mode whole: this model's RepMLPs are built for {h}x{w} inputs, not whole images; "
                "use --mode slide"
            )
        common = dict(mode=args.mode, crop=crop, device=procs.device, procs=procs, workers=args.workers)
        metrics: dict[str, Any] = {
            "checkpoint": str(args.checkpoint),
            "model": meta.name,
            "form_evaluated": "deploy",
            "mode": args.mode,
            "crop": list(crop),
        }
        metrics.update(
            evaluate_both_forms(
                lambda model, what: segmentation_metrics(model, dataset, what=what, **common),
                trained,
                deployed,
                args.check_conversion,
            )
        )
        if procs.is_main and args.json:
            print(json.dumps(metrics, sort_keys=True))
        elif procs.is_main:
            print(
                f"mIoU: {100 * metrics['miou']:.2f}% over {metrics['images']} images "
                f"({args.mode}, crop {crop[0]})"
            )
            for name, v in metrics["per_class_iou"].items():
                print(f"  {name:<14} {'-' if v is None else f'{100 * v:.2f}'}")
            if "train_form" in metrics:
                print(f"training form mIoU: {100 * metrics['train_form']['miou']:.2f}%")
        if procs.is_main and args.output_json:
            write_json(Path(args.output_json), metrics)
        return 0
    finally:
        cleanup_distributed()
