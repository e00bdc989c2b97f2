"""Image classification (paper Sec. 4.1-4.2): ``repmlp train`` (``--task cls``) and ``repmlp eval``.

:func:`train` trains a :class:`TrainConfig` (:func:`resolve_config` fills it from a recipe, as the command line
does), evaluating after every epoch (the ``metrics.csv`` rows), then ends the run
(:mod:`repmlp.tasks.classification_report`); a killed run continues with ``resume=True`` from its last
checkpoint to the weights of an uninterrupted run. :func:`evaluate` scores a model file."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp import engine
from repmlp.data import Data, DataConfig, build_data, model_data_config
from repmlp.data.loader import batch_generator
from repmlp.deploy.gpu import serving_format
from repmlp.errors import UserError
from repmlp.io.model_file import CheckpointError, check_fit, check_model_kwargs, load_model
from repmlp.models import build_model, takes_img_size
from repmlp.tasks._common import check_batchnorm_batch, loop_options, per_process_batch, require_task_model
from repmlp.tasks.classification_config import EvalConfig, TrainConfig, TrainResult
from repmlp.tasks.classification_report import finish_run, logit_batches
from repmlp.tasks.finetune import init_from_file, init_model_options, init_preprocessing
from repmlp.tasks.metrics import topk_correct
from repmlp.tasks.recipes import DEFAULT_PRESET, PRESETS, folder_recipe

__all__ = ["METRIC_FIELDS", "TrainConfig", "TrainResult", "EvalConfig", "resolve_config", "train", "evaluate",
           "evaluate_model", "lr_at", "make_optimizer"]  # fmt: skip

log = logging.getLogger(__name__)

METRIC_FIELDS = ["epoch", "step", "lr", "train_loss", "train_acc", "val_loss", "val_top1", "val_top5",
                 "epoch_s"]  # fmt: skip


def resolve_config(**options: Any) -> TrainConfig:
    """The config of a run from the options given (``None``: not given), as ``repmlp train`` builds it: the
    preset (``preset``, else the data set's) fills the rest; with ``init`` and no ``model``, the init file's
    model and options; a new run on an image folder takes its recipe, input and batch from the model (or
    the ``init`` file) and the folder (:func:`repmlp.tasks.recipes.folder_recipe`). Options given win."""
    given = {k: v for k, v in options.items() if v is not None}
    for key in ("data_dir", "init"):  # absolute, so that a resume from elsewhere still finds them
        if given.get(key):
            given[key] = os.path.abspath(os.path.expanduser(given[key]))
    dataset = given.setdefault("dataset", "fashion-mnist")
    new = given.get("resume") is not True  # "auto": as a new run; a checkpoint's config then wins
    if given.get("init") and new and "model" not in given:
        # Fine-tuning without --model: the file's model with its options (the new data set the classes).
        given["model"], file_args = init_model_options(given["init"])
        given["model_args"] = {**file_args, **given.get("model_args", {})}
    if dataset == "imagefolder" and new:
        preset, derived = folder_recipe(given)
    else:
        preset, derived = given.get("preset") or DEFAULT_PRESET[dataset], {}
    return TrainConfig(**{**PRESETS[preset].to_dict(), **derived, **given, "preset": preset})


def lr_at(step: int, total_steps: int, cfg: TrainConfig, steps_per_epoch: int) -> float:
    """Learning rate at optimizer step ``step`` (0-based): linear warm-up, then cosine to ``min_lr``."""
    warmup = int(round(cfg.warmup_epochs * steps_per_epoch))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - warmup) / max(1, total_steps - warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # No weight decay on BN parameters and biases (1-D tensors): the usual practice, decaying them hurts.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr)
    nesterov = cfg.nesterov and cfg.momentum > 0
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=nesterov)


@torch.no_grad()
def evaluate_model(
    model: nn.Module, loader, device: torch.device, *, amp: bool = False, procs: engine.DistInfo | None = None
) -> dict[str, float]:
    """Loss, top-1 and top-5 accuracy (%) of ``model`` over ``loader``, summed over the processes."""
    sums = torch.zeros(4, dtype=torch.float64)  # loss, top1, top5, n
    for logits, y in logit_batches(model, loader, device, amp=amp, show=procs is None or procs.is_main):
        loss = F.cross_entropy(logits, y, reduction="sum").item()
        sums += torch.tensor([loss, *topk_correct(logits, y), len(y)], dtype=torch.float64)
    sums = _summed(sums, procs)
    n = max(1.0, sums[3].item())
    return {"loss": sums[0].item() / n, "top1": 100 * sums[1].item() / n, "top5": 100 * sums[2].item() / n,
            "n": int(n)}  # fmt: skip


def _summed(sums: Tensor, procs: engine.DistInfo | None) -> Tensor:
    """``sums`` (CPU, float64) summed over the processes (on the GPU, where NCCL needs them)."""
    if procs is None or not procs.enabled:
        return sums
    return engine.all_reduce_sum(sums.to(procs.device), procs).cpu()


def train(
    cfg: TrainConfig, *, given: Collection[str] | None = None, finished_ok: bool = False
) -> TrainResult:
    """Train per ``cfg`` into ``cfg.output``, then end the run on the main process. With ``cfg.resume`` the run
    continues from its checkpoint with the saved config; ``given`` names the options the caller set
    (``None``: all of them; see :func:`_open_run`). A finished run (its report written) is not resumed unless
    ``finished_ok`` (``repmlp study`` redoing the end of one)."""
    started = time.perf_counter()
    cfg.validate()
    result = engine.run_in_processes(cfg, lambda cfg, procs: _train(cfg, procs, given, finished_ok))
    if result.dist_info.is_main:
        result.ok = finish_run(result, started)
    return result


def _train(
    cfg: TrainConfig, procs: engine.DistInfo, given: Collection[str] | None, finished_ok: bool
) -> TrainResult:
    per_process_batch(cfg.batch_size, procs)
    cfg, state = _open_run(cfg, given, procs, finished_ok)
    data, model, model_kwargs = _build_data_and_model(cfg, procs, state)
    require_task_model(model, "cls", cfg.model)
    check_batchnorm_batch(model, cfg.batch_size, data.train.num_samples, procs)
    init = _initialise(cfg, model, state, procs)
    optimizer = make_optimizer(model, cfg)
    steps = len(data.train)
    total = steps * cfg.epochs
    if procs.is_main:
        log.info("training %s (%.2fM params) on %s: %d train / %d val examples, %d epochs x %d steps, batch %d, "
                 "%s, device %s%s", cfg.model, sum(p.numel() for p in model.parameters()) / 1e6, cfg.dataset,
                 data.train.num_samples, data.val.num_samples, cfg.epochs, steps, cfg.batch_size, cfg.optimizer,
                 procs.device, f", {procs.world} processes" if procs.enabled else "")  # fmt: skip
    # The --init report travels in the checkpoint: a resumed run reports it without the file.
    opts = loop_options(cfg, procs, lambda step: [lr_at(step, total, cfg, steps)] * len(optimizer.param_groups),
                        auto_graphs=True, epochs=cfg.epochs, metric_fields=METRIC_FIELDS,
                        extra_state={"model_kwargs": model_kwargs, **({"init": init} if init else {})})  # fmt: skip
    hooks = _Hooks(cfg, procs, model, data, total)
    # SyncBatchNorm on multi-GPU runs (see repmlp.engine.prepare_module); the parameters stay model's.
    net = engine.prepare_module(model, procs, form=cfg.fast_training)
    hooks = engine.LoopHooks(hooks.step, hooks.end_epoch)
    loop = engine.train_loop(net, optimizer, data.train, opts, procs, state, hooks)
    model.eval()
    return TrainResult(model, model_kwargs, data, loop.history, cfg, loop.seconds, loop.replica_hashes, procs,
                       init, loop.mode)  # fmt: skip


def _open_run(
    cfg: TrainConfig, given: Collection[str] | None, procs: engine.DistInfo, finished_ok: bool
) -> tuple[TrainConfig, dict[str, Any] | None]:
    """The run's config and the state to resume (``None`` for a new run); refuses to overwrite a run and to
    resume a finished one. A resumed run continues with the saved config, validated as any other (naming
    the state file): the runtime options ``given`` replace the saved ones, another option given must equal
    the saved one (:func:`repmlp.engine.check_resumable`), the others keep the saved values."""
    out = Path(cfg.output)
    state = engine.check_output(out, cfg.resume, procs, finished_ok=finished_ok)
    if state is None:
        return cfg, None
    where, saved = out / engine.STATE_FILE, state.get("config")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where} has no usable config (not a mapping)")
    old = TrainConfig.from_dict(saved)
    old.validate(where)
    check_model_kwargs(where, old.model_args, "config.model_args")
    if not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{where} holds no model weights")
    merged = engine.check_resumable(saved, cfg.to_dict(), out, runtime=TrainConfig.RUNTIME, given=given,
                             hint="leave these options out to continue it, or train into another --output")  # fmt: skip
    # This call's own: resuming; the report shows each command that resumed the run.
    again = [cfg.run_command] if cfg.run_command else []
    merged.update(resume=True, resumed_with=old.resumed_with + again)
    return TrainConfig.from_dict(merged), state


# The TrainConfig fields build_data takes as they are (not the batch, which is per process).
_DATA_FIELDS = {f.name for f in dataclasses.fields(DataConfig)} - {"batch_size", "channels_last"}
_DATA_FIELDS &= {f.name for f in dataclasses.fields(TrainConfig)}


def _build_data_and_model(
    cfg: TrainConfig, procs: engine.DistInfo, state: dict[str, Any] | None
) -> tuple[Data, nn.Module, dict[str, Any]]:
    """Seed, then this process's data and the model on its device: ``(data, model, model_kwargs)``."""
    device = procs.device
    channels_last = cfg.channels_last if cfg.channels_last is not None else device.type == "cuda"
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    config = DataConfig(**{k: getattr(cfg, k) for k in _DATA_FIELDS}, batch_size=cfg.batch_size // procs.world,
                        channels_last=channels_last)  # fmt: skip
    data = build_data(config, rank=procs.rank, world=procs.world, device=device)
    if state is None:
        _check_init_fits(cfg, data)
    # A resumed run's model is built on the meta device first and must fit its state's weights: a state whose
    # options describe a huge model is refused before anything is built.
    state_file = Path(cfg.output) / engine.STATE_FILE
    check = None if state is None else lambda kwargs: check_fit(
        state_file, cfg.model, kwargs, state["model"], field_name="config.model_args",
        what=f"this run ({cfg.model} with {kwargs})")  # fmt: skip
    model, model_kwargs = build_model(cfg.model, cfg.model_args, num_classes=data.num_classes,
                                      in_chans=data.in_chans, img_size=data.img_size, check=check)  # fmt: skip
    model.to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    return data, model, model_kwargs


def _check_init_fits(cfg: TrainConfig, data: Data) -> None:
    """A new ``--init`` run of the file's own model must give it the channels and (a model built for one
    input size) the size it was built for: a mismatch is one line saying which option to pass."""
    pre = init_preprocessing(cfg.init) if cfg.init else None
    if pre is None or pre["input_size"] is None or cfg.model != pre["model"]:
        return
    c, h, w = pre["input_size"]
    if c != data.in_chans:
        raise UserError(
            f"--init {cfg.init} takes {c}-channel images but {cfg.dataset} has {data.in_chans}: fine-tune it on "
            "an image folder (--dataset imagefolder --data-dir DIR; its images are converted to the file's "
            "channels), or pass --model to train another model from scratch"
        )
    if takes_img_size(cfg.model) and pre["fixed_size"] and (h, w) != (data.img_size, data.img_size):
        hint = f"pass --img-size {h}" if h == w else "give images of the file's size"
        raise UserError(
            f"--init {cfg.init} holds {pre['model']} built for {h}x{w} inputs, but this run's are "
            f"{data.img_size}x{data.img_size} (its weights would not fit): {hint}"
        )


def _initialise(
    cfg: TrainConfig, model: nn.Module, state: dict[str, Any] | None, procs: engine.DistInfo
) -> dict | None:
    """``--init``: load the file's weights into ``model`` (a new run) or recall what was loaded (a resumed run,
    whose weights come from its checkpoint): the :class:`repmlp.tasks.finetune.InitReport` dict."""
    if not cfg.init:
        return None
    if state is not None:
        return state.get("init")
    report = init_from_file(model, cfg.init)
    if procs.is_main:
        log.info("%s", report.summary())
        if report.reinitialised:
            log.info("the file's classifier does not fit %s classes: %s re-initialised (as timm does)",
                     getattr(model, "num_classes", "the new"), ", ".join(report.reinitialised))  # fmt: skip
    return report.to_dict()


@dataclass
class _Hooks:
    """Classification's part of the engine's loop (:class:`repmlp.engine.LoopHooks`)."""

    cfg: TrainConfig
    procs: engine.DistInfo
    model: nn.Module  # unwrapped: evaluated without DDP
    data: Data
    total_steps: int

    def step(
        self, net: nn.Module, x: Tensor, y: Tensor, pos: engine.Position
    ) -> tuple[Tensor, dict[str, float]]:
        """Mixup (per-batch seeded) and label-smoothed cross-entropy of ``x`` ``(N, C, H, W)``, ``y`` ``(N,)``;
        statistics: the loss and 100 x the correct count summed over the batch (``n`` images)."""
        cfg = self.cfg
        lam, y2 = 1.0, y
        if cfg.mixup > 0:
            gen = batch_generator(cfg.seed, pos.epoch, pos.batch, self.procs.rank, 1)
            seed = int(torch.randint(2**31, (1,), generator=gen))
            lam = float(np.random.default_rng(seed).beta(cfg.mixup, cfg.mixup))
            perm = torch.randperm(len(y), generator=gen).to(x.device)
            x = lam * x + (1 - lam) * x[perm]
            y2 = y[perm]
        logits = net(x)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=cfg.label_smoothing)
        if cfg.mixup > 0:
            loss = lam * loss + (1 - lam) * F.cross_entropy(
                logits.float(), y2, label_smoothing=cfg.label_smoothing
            )
        correct = (logits.argmax(1) == y).sum().item()
        return loss, {"loss": loss.item() * len(y), "acc": 100.0 * correct, "n": float(len(y))}

    def end_epoch(self, pos: engine.Position) -> dict[str, Any]:
        """Evaluate on the validation set: the epoch's ``metrics.csv`` row (logged by the main process)."""
        cfg, procs, acc = self.cfg, self.procs, pos.epoch_acc
        engine.broadcast_buffers(self.model, procs)
        val = evaluate_model(self.model, self.data.val, procs.device, amp=bool(cfg.amp), procs=procs)
        # The training sums are per process: summed, so that the row describes the whole run.
        sums = _summed(
            torch.tensor([acc.get(k, 0.0) for k in ("loss", "acc", "n")], dtype=torch.float64), procs
        )
        n = max(1, sums[2].item())
        row = {"epoch": pos.epoch + 1, "step": pos.step, "lr": lr_at(pos.step - 1, self.total_steps, cfg,
               len(self.data.train)), "train_loss": sums[0].item() / n, "train_acc": sums[1].item() / n,
               "val_loss": val["loss"], "val_top1": val["top1"], "val_top5": val["top5"],
               "epoch_s": acc.get("seconds", 0.0)}  # fmt: skip
        if procs.is_main:
            log.info("epoch %d/%d: train loss %.4f acc %.2f%% | val loss %.4f top-1 %.2f%% top-5 %.2f%% | "
                     "%.0f s this epoch",
                     pos.epoch + 1, cfg.epochs, row["train_loss"], row["train_acc"], val["loss"], val["top1"],
                     val["top5"], row["epoch_s"])  # fmt: skip
        return row


def evaluate(args: EvalConfig) -> int:
    """Top-1/top-5 and loss of a model file on a data set, printed (as JSON with ``json``), run with the
    inference speed pass; a file whose classes, channels or input size do not fit the data set is a
    :class:`CheckpointError`."""
    if not args.checkpoint:
        raise UserError("eval needs --checkpoint FILE (model.safetensors or deploy.safetensors)")
    args.validate()
    device = engine.resolve_device(args.device)
    model = load_model(args.checkpoint, device=device)
    meta = model.metadata
    dataset, kwargs = args.dataset or meta.extra.get("dataset") or "fashion-mnist", meta.model_kwargs
    # The file's channels, input size and normalisation, as convert reads the data for it too (the training
    # run's data folder, recorded in the file, unless another is given).
    config = model_data_config(meta, dataset, data_dir=args.data_dir, img_size=args.img_size,
                               download=args.download, eval_batch_size=args.batch_size,
                               val_limit=args.val_limit, workers=args.workers, need_train=False)  # fmt: skip
    data = build_data(config, device=device)
    # The model's own channels (a foreign file may not record in_chans).
    for what, own, theirs, unit in [("predicts {} classes", kwargs.get("num_classes"), data.num_classes, ""),
                                    ("takes {}-channel images", meta.input_size[0], data.in_chans, ""),
                                    ("takes {}px images", kwargs.get("img_size"), data.img_size, "px")]:  # fmt: skip
        if own not in (None, theirs):
            raise CheckpointError(f"{args.checkpoint} {what.format(own)} but {dataset} has {theirs}{unit}")
    # In the serving layout, as predict runs the file.
    param = next(model.parameters(), None)
    fmt = serving_format(device, param.dtype if param is not None else torch.float32)
    res = evaluate_model(model.to(memory_format=fmt), data.val, device)
    res.update(model=meta.name, form=meta.form, precision=meta.precision, dataset=dataset,
               checkpoint=str(args.checkpoint))  # fmt: skip
    print(json.dumps(res, sort_keys=True) if args.json else
          f"{meta.name} ({meta.form} form, {res['precision']}) on {dataset}, {res['n']} examples: "
          f"top-1 {res['top1']:.2f}%  top-5 {res['top5']:.2f}%  loss {res['loss']:.4f}")  # fmt: skip
    return 0
