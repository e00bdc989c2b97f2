"""Face recognition (paper Sec. 4.3): AM-Softmax training, verification and rank-1 identification.

Training reads identity folders; evaluation uses the converted model's embeddings.

Training follows the paper's recipe: SGD with momentum 0.9, learning rate 0.1 divided by 10 at the
``--lr-steps`` iterations (paper: 252k, 364k, 406k of 420k at batch size 512), AM-Softmax loss, and
MobileFaceNets' weight decay (4e-5, 4e-4 on the embedding layer and the class weights).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp.data.face import FaceFolder, ImageList, face_transform, read_pairs
from repmlp.engine import DistInfo, progress, resolve_device, run_in_processes
from repmlp.errors import UserError
from repmlp.models import build_model
from repmlp.tasks import _common
from repmlp.tasks.config import EvalOptions, TrainOptions
from repmlp.tasks.finetune import head_prefixes, init_from_file
from repmlp.tasks.losses import AMSoftmax
from repmlp.tasks.metrics import rank1_identification, verification_accuracy

__all__ = ["TrainConfig", "EvalConfig", "train", "evaluate", "embed_images", "FaceTrainModule"]

log = logging.getLogger(__name__)

PAPER_LR_STEPS = (252_000, 364_000, 406_000)
PAPER_ITERATIONS = 420_000


@dataclass(kw_only=True)
class TrainConfig(TrainOptions):
    """``repmlp train --task face``: the shared options, the paper's recipe as defaults, and the task's own."""

    data_dir: str  # aligned face crops, one sub-folder per identity
    model: str = "repmlp_face_resnet"
    batch_size: int = 512
    lr: float = 0.1
    weight_decay: float = 4e-5
    head_weight_decay: float = 4e-4  # of the embedding layer and the AM-Softmax class weights
    iterations: int = PAPER_ITERATIONS
    lr_steps: list[int] | None = None  # None: the paper's, scaled to iterations
    am_scale: float = 30.0
    am_margin: float = 0.35
    img_size: int | None = None  # None: --model-arg img_size, else 96
    log_interval: int = 20

    def rules(self) -> Iterator[tuple[str, str]]:
        if self.lr_steps and self.lr_steps[-1] > self.iterations:
            yield "lr_steps", f"--lr-steps {self.lr_steps[-1]} is past --iterations {self.iterations}"


@dataclass(kw_only=True)
class EvalConfig(EvalOptions):
    """``repmlp eval --task face``: verification pairs and/or an identification probe and gallery."""

    pairs: str | None = None
    pairs_root: str | None = None
    folds: int = 10
    probe: str | None = None
    gallery: str | None = None
    batch_size: int = 256
    check_conversion: bool = False
    output_json: str | None = None


class FaceTrainModule(nn.Module):
    """Embedding model + AM-Softmax as one module (one DDP wrapper): images ``(N, 3, S, S)``, labels ``(N,)``
    -> scalar loss."""

    def __init__(self, model: nn.Module, loss: nn.Module) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        return self.loss(self.model(images), labels)


def _param_groups(module: FaceTrainModule, wd: float, head_wd: float) -> list[dict[str, Any]]:
    """MobileFaceNets' decay: ``head_wd`` on the last (embedding) layer and the class weights."""
    model = module.model
    head = getattr(model, "head", None)
    if head is None:  # MobileFaceNet: the last conv is the embedding layer
        features = getattr(model, "features", None)
        head = features[-1] if features is not None else None
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    head_ids |= {id(p) for p in module.loss.parameters()}
    base = [p for p in module.parameters() if id(p) not in head_ids]
    heads = [p for p in module.parameters() if id(p) in head_ids]
    return [{"params": base, "weight_decay": wd}, {"params": heads, "weight_decay": head_wd}]


def lr_steps(cfg: TrainConfig) -> list[int]:
    """``lr_steps``, by default the paper's (252k, 364k, 406k of 420k) scaled to ``iterations``."""
    if cfg.lr_steps is not None:
        return list(cfg.lr_steps)
    return [max(1, round(s * cfg.iterations / PAPER_ITERATIONS)) for s in PAPER_LR_STEPS]


def train(cfg: TrainConfig) -> _common.RunResult:
    """``repmlp train --task face``: train, then save the training-form and converted models and the report."""
    cfg.validate()
    return run_in_processes(cfg, _train)


def _train(cfg: TrainConfig, procs: DistInfo) -> _common.RunResult:
    torch.manual_seed(cfg.seed)
    kwargs = dict(cfg.model_args)
    size = _common.resolve_img_size(kwargs, "--img-size", cfg.img_size, 96)
    dataset = FaceFolder(cfg.data_dir, train=True, size=size)
    identities = len(dataset.classes)
    if identities < 2:  # one class makes the AM-Softmax loss 0 whatever the embedding: nothing to learn
        raise UserError(f"{cfg.data_dir} holds {identities} identity; face training needs at least 2")
    model, _ = build_model(cfg.model, kwargs)
    _common.require_task_model(model, "face", cfg.model)
    init = _init_trunk(model, cfg.init, procs)
    loss = AMSoftmax(model.embedding_dim, identities, scale=cfg.am_scale, margin=cfg.am_margin)
    loader = _common.training_loader(dataset, cfg, procs, model)
    steps = lr_steps(cfg)
    if procs.is_main:
        log.info("face: %d images of %d identities, %s (%d params), %d iterations on %d process(es)",
                 loader.num_samples, identities, cfg.model, sum(p.numel() for p in model.parameters()),
                 cfg.iterations, procs.world)  # fmt: skip
    lines = [
        f"- Data: {loader.num_samples} face crops of {identities} identities ({cfg.data_dir})",
        f"- Model: `{cfg.model}` {kwargs}, AM-Softmax s={cfg.am_scale:g} m={cfg.am_margin:g}",
        f"- Recipe: {cfg.iterations} iterations, batch {cfg.batch_size}, SGD lr {cfg.lr:g} (/10 at {steps}), "
        f"momentum {cfg.momentum:g}, weight decay {cfg.weight_decay:g} (head {cfg.head_weight_decay:g}), seed "
        f"{cfg.seed}",
    ]
    meta = {"task": "face", "identities": str(identities), "iterations": str(cfg.iterations)}
    return _common.train_run(cfg, procs, _common.Run(
        FaceTrainModule(model, loss), lambda m: _param_groups(m, cfg.weight_decay, cfg.head_weight_decay), loader,
        lambda step: [cfg.lr * 0.1 ** sum(step >= s for s in steps)] * 2, cfg.iterations, kwargs, size, meta, lines,
        init))  # fmt: skip


def _init_trunk(model: nn.Module, path: str | None, procs: DistInfo) -> dict[str, Any] | None:
    """``--init``: the file's weights into the trunk; the embedding head keeps its fresh initialisation."""
    if not path:
        return None
    report = init_from_file(model, path, fresh_head=True, head=head_prefixes(model, embedding_head=True))
    if procs.is_main:
        log.info("%s", report.summary())
    return report.to_dict()


@torch.no_grad()
def embed_images(
    model: nn.Module, paths: list[Path], *, img_size: int, batch_size: int, device: torch.device, workers: int = 0,
    what: str = "the model",
) -> Tensor:  # fmt: skip
    """L2-normalised embeddings ``(len(paths), D)`` of face crops, in order; :class:`UserError` naming
    ``what`` when the model's outputs are NaN/inf."""
    dataset = ImageList(list(paths), [0] * len(paths), face_transform(img_size, train=False))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers)
    model.eval()
    chunks = []
    with progress(loader, len(loader), "embed", True) as bar:  # closed (line cleared) on errors too
        for images, _ in bar:
            out = model(images.to(device)).float()
            _common.check_finite(out, what)
            chunks.append(F.normalize(out, dim=1).cpu())
    return torch.cat(chunks) if chunks else torch.empty(0)


def face_metrics(
    model: nn.Module, what: str, *, sets: tuple[Any, int, Any, Any], cfg: EvalConfig, img_size: int,
    device: torch.device,
) -> dict[str, Any]:  # fmt: skip
    """Verification accuracy and/or rank-1 identification of ``model`` on ``sets`` (:func:`read_face_sets`)."""
    pairs, folds, probe, gallery = sets
    result: dict[str, Any] = {}
    common = dict(img_size=img_size, batch_size=cfg.batch_size, device=device, workers=cfg.workers, what=what)
    if pairs is not None:
        unique = sorted(set(pairs.first) | set(pairs.second))
        index = {p: i for i, p in enumerate(unique)}
        emb = embed_images(model, unique, **common)
        # cosines: the embeddings are unit vectors
        scores = (emb[[index[p] for p in pairs.first]] * emb[[index[p] for p in pairs.second]]).sum(1)
        result["verification_accuracy"] = verification_accuracy(scores, torch.tensor(pairs.same), folds=folds)
        result.update(verification_pairs=len(scores), verification_folds=folds)
    if probe is not None and gallery is not None:
        pe = embed_images(model, probe.paths, **common)
        ge = embed_images(model, gallery.paths, **common)
        result["rank1_identification"] = rank1_identification(pe, probe.identities, ge, gallery.identities)
        mates = set(probe.classes)  # built once: a set per gallery image is slow at MegaFace scale
        result.update(probes=len(probe), gallery=len(gallery),
                      distractors=sum(1 for c in gallery.identities if c not in mates))  # fmt: skip
    return result


def read_face_sets(cfg: EvalConfig) -> tuple[Any, int, Any, Any]:
    """The evaluation sets of ``cfg``: ``(pairs or None, folds, probe or None, gallery or None)``; every
    problem is a :class:`UserError` raised here, before a progress bar starts."""
    if not cfg.pairs and not (cfg.probe or cfg.gallery):
        raise UserError("nothing to evaluate: give --pairs and/or --probe with --gallery")
    pairs, folds, probe, gallery = None, cfg.folds, None, None
    if cfg.pairs:
        pairs = read_pairs(cfg.pairs, Path(cfg.pairs_root) if cfg.pairs_root else Path(cfg.pairs).parent)
        folds = pairs.folds or cfg.folds
        if len(pairs.same) < folds:
            raise UserError(f"{len(pairs.same)} pairs are too few for {folds} folds")
    if cfg.probe or cfg.gallery:
        if not (cfg.probe and cfg.gallery):
            raise UserError("identification needs both --probe and --gallery")
        probe, gallery = FaceFolder(cfg.probe), FaceFolder(cfg.gallery)
        missing = sorted(set(probe.classes) - set(gallery.classes))
        if missing:
            raise UserError(
                f"{len(missing)} probe identities have no mate in the gallery, e.g. {missing[0]!r}"
            )
    return pairs, folds, probe, gallery


def evaluate(cfg: EvalConfig) -> int:
    """``repmlp eval --task face``: metrics on the converted model's embeddings (and with ``check_conversion``
    the training form's), printed; 1 when one is not finite."""
    cfg.validate()
    sets = read_face_sets(cfg)  # bad sets fail before the checkpoint is loaded, and before any bar
    device = resolve_device(cfg.device)
    trained, deployed, meta = _common.load_for_eval(cfg.checkpoint, device, "face")
    img_size = int(meta.model_kwargs.get("img_size", 96))
    evaluate = partial(face_metrics, sets=sets, cfg=cfg, img_size=img_size, device=device)
    metrics = {"checkpoint": str(cfg.checkpoint), "model": meta.name, "form_evaluated": "deploy",
               **_common.evaluate_both_forms(evaluate, trained, deployed, cfg.check_conversion)}  # fmt: skip
    ref = metrics.get("training_time", {})
    lines = [f"{k}: {100 * metrics[k]:.2f}%" + (f" (training form: {100 * ref[k]:.2f}%)" if ref else "")
             for k in ("verification_accuracy", "rank1_identification") if k in metrics]  # fmt: skip
    _common.report_metrics(cfg, metrics, lines)
    return 0 if all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)) else 1
