"""Face recognition (paper Sec. 4.3): AM-Softmax training, verification and rank-1 identification.

Training reads identity folders; evaluation uses the converted model's embeddings.

Training follows the paper's recipe: SGD with momentum 0.9, learning rate 0.1 divided by 10 at the
``--lr-steps`` iterations (paper: 252k, 364k, 406k of 420k at batch size 512), AM-Softmax loss, and
MobileFaceNets' weight decay (4e-5, 4e-4 on the embedding layer and the class weights).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp.engine import progress, unwrap
from repmlp.errors import UserError
from repmlp.models.registry import build_model
from repmlp.tasks._common import (
    EvalOptions,
    TrainOptions,
    check_batchnorm_batch,
    check_finite,
    check_train_options,
    evaluate_both_forms,
    load_for_eval,
    model_options,
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
    "embed_images",
    "FaceTrainModule",
]

log = logging.getLogger(__name__)

PAPER_LR_STEPS = (252_000, 364_000, 406_000)
PAPER_ITERATIONS = 420_000


@dataclass
class FaceTrainConfig(TrainOptions):
    """``repmlp train --task face``: the shared training options and the face pipeline's own."""

    head_weight_decay: float
    iterations: int
    lr_steps: list[int] | None
    am_scale: float
    am_margin: float
    img_size: int | None


@dataclass
class FaceEvalConfig(EvalOptions):
    """``repmlp eval --task face``: verification pairs and/or an identification probe and gallery."""

    pairs: str | None
    pairs_root: str | None
    folds: int
    probe: str | None
    gallery: str | None
    batch_size: int


class FaceTrainModule(nn.Module):
    """Embedding model + AM-Softmax as one module, so one DDP wrapper synchronises both.

    Shapes: images ``(N, 3, S, S)``, labels ``(N,)`` -> scalar loss.
    """

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


def face_lr(args: FaceTrainConfig, step: int) -> list[float]:
    """Learning rate of both parameter groups at ``step``: ``--lr`` divided by 10 at each ``--lr-steps``."""
    lr = args.lr * 0.1 ** sum(step >= s for s in lr_steps(args))
    return [lr, lr]


def lr_steps(args: FaceTrainConfig) -> list[int]:
    """``--lr-steps``, by default the paper's (252k, 364k, 406k of 420k) scaled to ``--iterations``."""
    if args.lr_steps is not None:
        return list(args.lr_steps)
    return [max(1, round(s * args.iterations / PAPER_ITERATIONS)) for s in PAPER_LR_STEPS]


def check_options(args: FaceTrainConfig) -> None:
    """Option checks of a face run (one :class:`UserError` each), before anything is loaded."""
    check_train_options(args)
    if not 0 <= args.am_margin < 2:
        raise UserError(f"--am-margin must be in [0, 2), got {args.am_margin}")
    if args.lr_steps and args.lr_steps[-1] > args.iterations:
        raise UserError(f"--lr-steps {args.lr_steps[-1]} is past --iterations {args.iterations}")


def train(args: FaceTrainConfig) -> int:
    """``repmlp train --task face``: train, then save the training-form and converted models."""
    from repmlp.engine import run_in_processes

    check_options(args)
    return run_in_processes(args, _train)


def _train(args: FaceTrainConfig, procs) -> int:
    from repmlp.data.face import FaceFolder
    from repmlp.engine import prepare_module, train_loop, write_run_report
    from repmlp.tasks.losses import AMSoftmax

    torch.manual_seed(args.seed)
    kwargs = model_options(args)
    size = resolve_img_size(kwargs, "--img-size", args.img_size, 96)
    dataset = FaceFolder(args.data_dir, train=True, size=size)
    if len(dataset.classes) < 2:
        # One class makes the AM-Softmax loss 0 whatever the embedding: nothing would be learnt.
        raise UserError(
            f"{args.data_dir} holds {len(dataset.classes)} identity; face training needs at least 2"
        )
    model, _ = build_model(args.model, kwargs)
    require_task_model(model, "face", args.model)
    init = _init_trunk(model, args.init, procs)
    loss = AMSoftmax(model.embedding_dim, len(dataset.classes), scale=args.am_scale, margin=args.am_margin)
    per_process = per_process_batch(args.batch_size, procs)
    examples = min(len(dataset), args.train_limit or len(dataset))
    check_batchnorm_batch(model, args.batch_size, examples, procs)
    opts, state = start_run(args, procs, args.iterations, lambda step: face_lr(args, step), kwargs)
    net = prepare_module(FaceTrainModule(model, loss), procs)
    optimizer = torch.optim.SGD(
        _param_groups(unwrap(net), args.weight_decay, args.head_weight_decay),
        lr=args.lr,
        momentum=args.momentum,
    )
    loader = training_loader(dataset, args, procs, per_process)
    if procs.is_main:
        log.info(
            "face: %d images of %d identities, %s (%d params), %d iterations on %d process(es)",
            loader.num_samples,
            len(dataset.classes),
            args.model,
            sum(p.numel() for p in model.parameters()),
            args.iterations,
            procs.world,
        )
    loop = train_loop(net, optimizer, loader, opts, procs, state)
    history = loop.history
    if procs.is_main:
        meta = {"task": "face", "identities": str(len(dataset.classes)), "iterations": str(args.iterations)}
        trained = unwrap(net).model
        input_size = (getattr(trained, "in_chans", 3), size, size)
        check = save_run(opts.output, trained, args.model, kwargs, meta, history, input_size)
        section = [
            f"- Data: {loader.num_samples} face crops of {len(dataset.classes)} identities ({args.data_dir})",
            f"- Model: `{args.model}` {kwargs}, AM-Softmax s={args.am_scale:g} m={args.am_margin:g}",
            f"- Recipe: {args.iterations} iterations, batch {args.batch_size}, SGD lr {args.lr:g} "
            f"(/10 at {lr_steps(args)}), momentum {args.momentum:g}, weight decay {args.weight_decay:g} "
            f"(head {args.head_weight_decay:g}), seed {args.seed}, {procs.world} process(es), "
            f"{loop.mode} training step",
            "- Files: `model.safetensors` (training form), `deploy.safetensors` (converted), "
            "`checkpoint.safetensors` (for --resume); evaluate with `repmlp eval --task face`",
            f"- Conversion: {check.summary()}",
            *report_lines(init),
        ]
        write_run_report(opts.output, f"repmlp face run: {args.model}", history, section)
        return 0 if check.equivalent else 1
    return 0


def _init_trunk(model: nn.Module, path: str | None, procs) -> dict[str, Any] | None:
    """``--init``: the file's weights into the trunk; the embedding head keeps its fresh initialisation."""
    if not path:
        return None
    from repmlp.tasks.finetune import head_prefixes, init_from_file

    report = init_from_file(model, path, fresh_head=True, head=head_prefixes(model, embedding_head=True))
    if procs.is_main:
        log.info("%s", report.summary())
    return report.to_dict()


@torch.no_grad()
def embed_images(
    model: nn.Module,
    paths: list[Path],
    *,
    img_size: int,
    batch_size: int,
    device: torch.device,
    workers: int = 0,
    what: str = "the model",
) -> Tensor:
    """L2-normalised embeddings ``(len(paths), D)`` of face crops, in order.

    Raises :class:`UserError` naming ``what`` when the model's outputs are NaN/inf.
    """
    from repmlp.data.face import ImageList, face_transform

    dataset = ImageList(list(paths), [0] * len(paths), face_transform(img_size, train=False))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers)
    model.eval()
    chunks = []
    with progress(loader, len(loader), "embed", True) as bar:  # closed (line cleared) on errors too
        for images, _ in bar:
            out = model(images.to(device)).float()
            check_finite(out, what)
            chunks.append(F.normalize(out, dim=1).cpu())
    return torch.cat(chunks) if chunks else torch.empty(0)


def face_metrics(
    model: nn.Module,
    sets: tuple[Any, int, Any, Any],
    args: argparse.Namespace,
    img_size: int,
    device: torch.device,
    what: str = "the model",
) -> dict[str, Any]:
    """Verification accuracy and/or rank-1 identification of ``model`` on ``sets``
    (:func:`read_face_sets`); ``args`` gives the batch size and workers.
    """
    from repmlp.tasks.metrics import rank1_identification, verification_accuracy

    pairs, folds, probe, gallery = sets
    result: dict[str, Any] = {}
    common = dict(
        img_size=img_size, batch_size=args.batch_size, device=device, workers=args.workers, what=what
    )
    if pairs is not None:
        unique = sorted(set(pairs.first) | set(pairs.second))
        index = {p: i for i, p in enumerate(unique)}
        emb = embed_images(model, unique, **common)
        a = emb[[index[p] for p in pairs.first]]
        b = emb[[index[p] for p in pairs.second]]
        scores = (a * b).sum(1)  # cosine: embeddings are unit vectors
        result["verification_accuracy"] = verification_accuracy(scores, torch.tensor(pairs.same), folds=folds)
        result["verification_pairs"] = len(scores)
        result["verification_folds"] = folds
    if probe is not None and gallery is not None:
        pe = embed_images(model, probe.paths, **common)
        ge = embed_images(model, gallery.paths, **common)
        result["rank1_identification"] = rank1_identification(pe, probe.identities, ge, gallery.identities)
        result["probes"] = len(probe)
        result["gallery"] = len(gallery)
        mates = set(probe.classes)  # built once: a set per gallery image is slow at MegaFace scale
        result["distractors"] = sum(1 for c in gallery.identities if c not in mates)
    return result


def read_face_sets(args: FaceEvalConfig) -> tuple[Any, int, Any, Any]:
    """Read the evaluation sets of ``args``: ``(pairs or None, folds, probe or None, gallery or None)``.

    Every problem is a :class:`UserError` raised here, before a progress bar starts.
    """
    from repmlp.data.face import FaceFolder, read_pairs

    if not args.pairs and not (args.probe or args.gallery):
        raise UserError("nothing to evaluate: give --pairs and/or --probe with --gallery")
    pairs, folds, probe, gallery = None, args.folds, None, None
    if args.pairs:
        root = Path(args.pairs_root) if args.pairs_root else Path(args.pairs).parent
        pairs = read_pairs(args.pairs, root)
        folds = pairs.folds or args.folds
        if len(pairs.same) < folds:
            raise UserError(f"{len(pairs.same)} pairs are too few for {folds} folds")
    if args.probe or args.gallery:
        if not (args.probe and args.gallery):
            raise UserError("identification needs both --probe and --gallery")
        probe, gallery = FaceFolder(args.probe), FaceFolder(args.gallery)
        missing = sorted(set(probe.classes) - set(gallery.classes))
        if missing:
            raise UserError(
                f"{len(missing)} probe identities have no mate in the gallery, e.g. {missing[0]!r}"
            )
    return pairs, folds, probe, gallery


def evaluate(args: FaceEvalConfig) -> int:
    """``repmlp eval --task face``: metrics on the converted model's embeddings."""
    from repmlp.engine import resolve_device

    sets = read_face_sets(args)  # bad sets fail before the checkpoint is loaded, and before any bar
    device = resolve_device(args.device)
    trained, deployed, meta = load_for_eval(args.checkpoint, device, "face")
    if args.check_conversion and trained is None:
        raise UserError("--check-conversion needs a training-form checkpoint (this one is already converted)")
    img_size = int(meta.model_kwargs.get("img_size", 96))
    metrics = {"checkpoint": str(args.checkpoint), "model": meta.name, "form_evaluated": "deploy"}
    metrics.update(
        evaluate_both_forms(
            lambda model, what: face_metrics(model, sets, args, img_size, device, what),
            trained,
            deployed,
            args.check_conversion,
        )
    )
    if args.json:
        print(json.dumps(metrics, sort_keys=True))
    for key in ("verification_accuracy", "rank1_identification"):
        if key in metrics and not args.json:
            line = f"{key}: {100 * metrics[key]:.2f}%"
            if "train_form" in metrics:
                line += f" (training form: {100 * metrics['train_form'][key]:.2f}%)"
            print(line)
    if args.output_json:
        write_json(Path(args.output_json), metrics)
    return 0 if all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)) else 1
