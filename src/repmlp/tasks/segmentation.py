"""Semantic segmentation (paper Sec. 4.4): PSPNet on Cityscapes, mIoU of the converted model.

Training follows the official PSPNet configuration the paper adopts: SGD (momentum 0.9), poly learning rate
``base * (1 - it/max_it)^0.9`` with base 0.01 (the heads at 10x, as PSPNet's code does), weight decay 1e-4,
random scale (0.5-2) / crop / flip, ignore label 255, main + 0.4 x auxiliary loss; the paper trains 200 epochs
at a global batch size of 16 with 713x713 crops.

Evaluation is single-scale, with a sliding ``crop_size`` window over larger images (what a model whose RepMLPs
are built for one resolution needs); ``--mode whole`` predicts whole images in one pass (no RepMLPs).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp import engine
from repmlp.data.cityscapes import CLASS_NAMES, IGNORE_INDEX, NUM_CLASSES, CityscapesSegmentation
from repmlp.errors import UserError
from repmlp.io.model_file import compare_state
from repmlp.models import build_model
from repmlp.models.pspnet import PSPNet
from repmlp.nn.block import RepMLPBlock
from repmlp.tasks import _common
from repmlp.tasks.config import EvalOptions, TrainOptions
from repmlp.tasks.finetune import InitReport, file_sha256, read_training_file
from repmlp.tasks.losses import pspnet_loss
from repmlp.tasks.metrics import confusion_matrix, iou_from_confusion

__all__ = ["TrainConfig", "EvalConfig", "train", "evaluate", "poly_lr", "sliding_window_logits",
           "segmentation_metrics", "load_backbone_weights"]  # fmt: skip

log = logging.getLogger(__name__)


def poly_lr(base: float, iteration: int, max_iterations: int, power: float = 0.9) -> float:
    """Poly policy: ``base * (1 - iteration / max_iterations) ** power``."""
    return base * (1.0 - min(iteration, max_iterations) / max_iterations) ** power


@dataclass(kw_only=True)
class TrainConfig(TrainOptions):
    """``repmlp train --task seg``: the shared training options, PSPNet's recipe as defaults, and its own."""

    data_dir: str  # a Cityscapes root (leftImg8bit/ and gtFine/ with labelTrainIds)
    model: str = "pspnet_repmlp_res50"
    batch_size: int = 16
    lr: float = 0.01
    weight_decay: float = 1e-4
    epochs: int = 200
    iterations: int | None = None  # None: from epochs
    power: float = 0.9  # of the poly learning rate
    head_lr_mult: float = 10.0  # the PSP and auxiliary heads' learning rate, as a multiple of lr (PSPNet's)
    crop_size: int | None = None  # the model's img_size (None: --model-arg img_size, else 713)
    scale_min: float = 0.5
    scale_max: float = 2.0
    aux_weight: float = 0.4
    train_split: str = "train"
    log_interval: int = 20

    def rules(self) -> Iterator[tuple[str, str]]:
        if self.scale_min > self.scale_max:
            yield "scale_min", f"--scale-min {self.scale_min} is larger than --scale-max {self.scale_max}"


@dataclass(kw_only=True)
class EvalConfig(EvalOptions):
    """``repmlp eval --task seg``: a split of a Cityscapes folder, sliding-window or whole images."""

    data_dir: str
    split: str = "val"
    mode: str = "slide"
    crop_size: int | None = None  # None: the model's img_size
    val_limit: int | None = None
    check_conversion: bool = False
    output_json: str | None = None


class SegTrainModule(nn.Module):
    """PSPNet + its loss as one module (one DDP wrapper): images ``(N,3,h,w)``, labels ``(N,h,w)`` -> loss."""

    def __init__(self, model: nn.Module, aux_weight: float) -> None:
        super().__init__()
        self.model, self.aux_weight = model, aux_weight

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        out = self.model(images)
        main, aux = out if isinstance(out, tuple) else (out, None)
        return pspnet_loss(main, aux, labels, aux_weight=self.aux_weight, ignore_index=IGNORE_INDEX)


def _param_groups(model: nn.Module, wd: float, head_mult: float) -> list[dict[str, Any]]:
    """The backbone's parameters, then the heads' (their learning rate ``head_mult`` times the backbone's)."""
    back_ids = {id(p) for p in model.backbone.parameters()}
    back = [p for p in model.parameters() if id(p) in back_ids]
    head = [p for p in model.parameters() if id(p) not in back_ids]
    return [{"params": back, "weight_decay": wd, "lr_mult": 1.0}, {"params": head, "weight_decay": wd,
                                                                     "lr_mult": head_mult}]  # fmt: skip


def train(cfg: TrainConfig) -> _common.RunResult:
    """``repmlp train --task seg``: train PSPNet, then save the training-form and converted models and the report."""
    cfg.validate()
    return engine.run_in_processes(cfg, _train)


def _is_reinitialised(key: str) -> bool:
    """FC1/FC2 of the Global Perceptrons: their size depends on the resolution (paper Sec. 4.4)."""
    return ".global_perceptron.fc1." in key or ".global_perceptron.fc2." in key


def load_backbone_weights(model: PSPNet, path: str, *, flag: str = "--backbone-weights") -> dict[str, Any]:
    """Load ImageNet-trained backbone weights (a training-form model file) into ``model.backbone``.

    Everything is inherited but the Global Perceptrons' FC1/FC2, which keep their fresh initialisation (their
    shapes follow the resolution, as in the paper); the ImageNet classifier (``fc.*``) is dropped. Any other
    difference (a tensor missing on either side, a shape) is one :class:`UserError` listing them. Returns
    ``{"loaded": [...], "reinitialised": [...], "ignored": [...]}`` (backbone keys) and the file's ``"model"``."""
    tensors, fm = read_training_file(path, flag)
    own = {k: v for k, v in model.backbone.state_dict().items() if not _is_reinitialised(k)}
    ignored = sorted(k for k in tensors if k.startswith("fc."))
    kept = {k: v for k, v in tensors.items() if k not in ignored and not _is_reinitialised(k)}
    compare_state(f"backbone weights {path} (from {fm.model})", "the backbone", own, kept)
    model.backbone.load_state_dict(kept, strict=False)
    reinit = sorted(k for k in model.backbone.state_dict() if _is_reinitialised(k))
    return {"loaded": sorted(kept), "reinitialised": reinit, "ignored": ignored, "model": fm.model}


def _build(cfg: TrainConfig, kwargs: dict[str, Any], procs: engine.DistInfo) -> tuple[nn.Module, dict | None]:
    """The PSPNet of ``cfg``, and with ``--init`` (``--backbone-weights``) the weights loaded into its backbone
    (what was loaded, as :class:`repmlp.tasks.finetune.InitReport`'s dict; else ``None``)."""
    model, _ = build_model(cfg.model, kwargs)
    _common.require_task_model(model, "seg", cfg.model)
    if not cfg.init:
        return model, None
    loaded = load_backbone_weights(model, cfg.init, flag="--backbone-weights/--init")
    report = InitReport(cfg.init, file_sha256(cfg.init), loaded["model"], len(loaded["loaded"]),
                        loaded["reinitialised"], loaded["ignored"])  # fmt: skip
    if procs.is_main:
        log.info("%s", report.summary())
    return model, report.to_dict()


def _train(cfg: TrainConfig, procs: engine.DistInfo) -> _common.RunResult:
    torch.manual_seed(cfg.seed)
    kwargs = dict(cfg.model_args)
    # The crops are the model's inputs: its RepMLPs are built for exactly that size.
    crop = _common.resolve_img_size(kwargs, "--crop-size", cfg.crop_size, 713)
    dataset = CityscapesSegmentation(cfg.data_dir, cfg.train_split, crop_size=crop,
                                     scale_range=(cfg.scale_min, cfg.scale_max))  # fmt: skip
    images = min(len(dataset), cfg.train_limit or len(dataset))
    if images < cfg.batch_size:
        raise UserError(f"{images} training image(s) are fewer than --batch-size {cfg.batch_size}")
    model, init = _build(cfg, kwargs, procs)
    # The pyramid's 1x1 bin leaves BatchNorm one value per channel and image: batches of 1 are refused.
    loader = _common.training_loader(dataset, cfg, procs, model)
    max_it = cfg.iterations or cfg.epochs * len(loader)
    if procs.is_main:
        log.info("seg: %d images, %s (%d params), %d iterations (%d per epoch) on %d process(es)",
                 loader.num_samples, cfg.model, sum(p.numel() for p in model.parameters()), max_it, len(loader),
                 procs.world)  # fmt: skip
    lines = [
        f"- Data: {loader.num_samples} images of {cfg.data_dir} ({cfg.train_split}), crops {crop}x{crop}, "
        f"scale {cfg.scale_min:g}-{cfg.scale_max:g}",
        f"- Model: `{cfg.model}` {kwargs}, auxiliary loss weight {cfg.aux_weight:g}",
        f"- Recipe: {max_it} iterations, batch {cfg.batch_size}, SGD poly lr {cfg.lr:g} (power {cfg.power:g}, "
        f"heads x{cfg.head_lr_mult:g}), momentum {cfg.momentum:g}, weight decay {cfg.weight_decay:g}, seed "
        f"{cfg.seed}",
    ]
    meta = {"task": "seg", "epochs": cfg.epochs, "iterations": max_it, "crop_size": crop}
    # Poly policy as a function of the step, the heads at --head-lr-mult times --lr.
    return _common.train_run(cfg, procs, _common.Run(
        SegTrainModule(model, cfg.aux_weight), lambda m: _param_groups(m.model, cfg.weight_decay, cfg.head_lr_mult),
        loader, lambda step: [cfg.lr * m * poly_lr(1.0, step, max_it, cfg.power) for m in (1.0, cfg.head_lr_mult)],
        max_it, kwargs, crop, meta, lines, init))  # fmt: skip


@torch.no_grad()
def sliding_window_logits(model: nn.Module, image: Tensor, crop: tuple[int, int], num_classes: int) -> Tensor:
    """Single-scale sliding-window logits ``(N, K, H, W)`` for images ``(N, 3, H, W)`` of any size: the image
    zero-padded (the mean colour after normalisation) to at least ``crop``, covered by windows of ``crop`` at a
    stride of ``ceil(2/3 crop)`` (the last one flush with the border), each predicted at exactly ``crop`` (what
    a resolution-specific RepMLP model needs), overlapping logits averaged."""
    n, _, h, w = image.shape
    ch, cw = crop
    image = F.pad(image, (0, max(cw - w, 0), 0, max(ch - h, 0)))
    hh, ww = image.shape[-2:]
    sh, sw = math.ceil(ch * 2 / 3), math.ceil(cw * 2 / 3)
    logits = image.new_zeros(n, num_classes, hh, ww)
    count = image.new_zeros(1, 1, hh, ww)
    for r in range(max(math.ceil((hh - ch) / sh), 0) + 1):
        for c in range(max(math.ceil((ww - cw) / sw), 0) + 1):
            top, left = min(r * sh, hh - ch), min(c * sw, ww - cw)
            window = image[:, :, top : top + ch, left : left + cw]
            logits[:, :, top : top + ch, left : left + cw] += model(window).float()
            count[:, :, top : top + ch, left : left + cw] += 1
    return (logits / count)[:, :, :h, :w]


@torch.no_grad()
def segmentation_metrics(
    model: nn.Module, dataset, *, mode: str, crop: tuple[int, int], device: torch.device,
    procs: engine.DistInfo | None = None, workers: int = 0, what: str = "the model",
) -> dict[str, Any]:  # fmt: skip
    """mIoU and per-class IoU of ``model`` over ``dataset`` (whole images; ``mode``: ``slide`` or ``whole``), of
    the confusion matrix summed over the processes. :class:`NonFiniteOutput` naming ``what`` when the logits
    hold NaN/inf, on every process (the count is summed first: no process is left waiting in a collective)."""
    procs = procs or engine.DistInfo(device=device)
    subset = torch.utils.data.Subset(dataset, list(range(procs.rank, len(dataset), procs.world)))
    loader = torch.utils.data.DataLoader(subset, batch_size=1, num_workers=workers)
    confusion = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    non_finite_images = torch.zeros((), dtype=torch.long, device=device)
    model.eval()
    with engine.progress(
        loader, len(loader), "eval", procs.is_main
    ) as bar:  # closed (line cleared) on errors
        for image, label in bar:
            image = image.to(device)
            if mode == "slide":
                logits = sliding_window_logits(model, image, crop, NUM_CLASSES)
            else:
                try:
                    logits = model(image)
                except ValueError as exc:  # a RepMLP model built for another resolution
                    raise UserError(f"--mode whole: {exc}; use --mode slide") from None
            non_finite_images += (~torch.isfinite(logits)).any().long()
            confusion += confusion_matrix(logits.argmax(1), label.to(device), NUM_CLASSES, IGNORE_INDEX)
    confusion = engine.all_reduce_sum(confusion, procs).cpu()
    if engine.all_reduce_sum(non_finite_images, procs).item():
        raise _common.non_finite(what)
    miou, iou = iou_from_confusion(confusion)
    per_class = {
        name: None if math.isnan(v) else v for name, v in zip(CLASS_NAMES, iou.tolist(), strict=True)
    }
    return {"miou": miou, "per_class_iou": per_class, "images": len(dataset),
            "confusion_matrix": confusion.tolist()}  # fmt: skip


def _crop_of(model_kwargs: dict[str, Any], override: int | None) -> tuple[int, int]:
    if override is not None:
        return (override, override)
    size = model_kwargs.get("img_size", 713)
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def evaluate(cfg: EvalConfig) -> int:
    """``repmlp eval --task seg``: mIoU and per-class IoU of the converted model (and with ``check_conversion``
    the training form's), printed."""
    cfg.validate()
    procs = engine.setup_distributed(cfg.device)
    try:
        trained, deployed, meta = _common.load_for_eval(cfg.checkpoint, procs.device, "seg")
        dataset = CityscapesSegmentation(cfg.data_dir, cfg.split)
        if cfg.val_limit:
            dataset = torch.utils.data.Subset(dataset, range(min(cfg.val_limit, len(dataset))))
        crop = _crop_of(meta.model_kwargs, cfg.crop_size)
        # RepMLPs take one input resolution only: checked before any progress bar.
        if cfg.mode == "whole" and any(isinstance(m, RepMLPBlock) for m in deployed.modules()):
            h, w = _crop_of(meta.model_kwargs, None)
            raise UserError(f"--mode whole: this model's RepMLPs are built for {h}x{w} inputs, not whole images; "
                            "use --mode slide")  # fmt: skip
        common = dict(mode=cfg.mode, crop=crop, device=procs.device, procs=procs, workers=cfg.workers)
        metrics = {"checkpoint": str(cfg.checkpoint), "model": meta.name, "form_evaluated": "deploy",
                   "mode": cfg.mode, "crop": list(crop), **_common.evaluate_both_forms(
                       lambda model, what: segmentation_metrics(model, dataset, what=what, **common), trained,
                       deployed, cfg.check_conversion)}  # fmt: skip
        lines = [
            f"mIoU: {100 * metrics['miou']:.2f}% over {metrics['images']} images ({cfg.mode}, crop {crop[0]})"
        ]
        lines += [f"  {name:<14} {'-' if v is None else f'{100 * v:.2f}'}"
                  for name, v in metrics["per_class_iou"].items()]  # fmt: skip
        if "training_time" in metrics:
            lines.append(f"training form mIoU: {100 * metrics['training_time']['miou']:.2f}%")
        if procs.is_main:
            _common.report_metrics(cfg, metrics, lines)
        return 0
    finally:
        engine.cleanup_distributed()
