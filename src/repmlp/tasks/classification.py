"""Image classification (paper Sec. 4.1-4.2): the task that ``repmlp train`` (``--task cls``) runs.

What is classification's own: :class:`TrainConfig` (every option, with :func:`resumed_config`'s rules for
a resumed run), the data and model (:func:`build_data`, :func:`build_model`), the optimizer and its
learning rate as a pure function of the step (:func:`lr_at`), the step (mixup, label smoothing, the
correct count) and the per-epoch evaluation that makes each ``metrics.csv`` row (:func:`evaluate`).

:func:`run_training` trains through :func:`repmlp.engine.train_loop`, the loop face recognition and
segmentation use too: ``checkpoint.safetensors`` every ``ckpt_every`` steps and at the end of every epoch;
a killed run continues with ``resume=True`` from its last checkpoint (model, optimizer, gradient scaler,
every process's torch/numpy/python RNG states, the position in the epoch's data order, the epoch's sums and
the metrics so far), so its final weights equal those of an uninterrupted run. The end of a run (convert,
verify, benchmark, export, report) is :mod:`repmlp.tasks.classification_report`, whose names this module
re-exports.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import random
import typing
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp.data import DATASETS, Data, DataConfig, build_data
from repmlp.data.loader import batch_generator
from repmlp.engine import (
    STATE_FILE,
    DistInfo,
    LoopHooks,
    LoopOptions,
    Position,
    amp_dtype,
    broadcast_buffers,
    check_output,
    check_resumable,
    prepare_module,
    resolve_compile,
    resolve_cuda_graphs,
    setup_distributed,
    train_loop,
)
from repmlp.engine import write_metrics_csv as _write_csv
from repmlp.engine.devices import COMPILE_CHOICES
from repmlp.errors import UserError
from repmlp.io.model_file import CheckpointError, check_field, check_fit, check_model_kwargs
from repmlp.models.registry import build_model, takes_img_size
from repmlp.tasks._common import check_batchnorm_batch, require_task_model
from repmlp.tasks.limits import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_EPOCHS,
    MAX_LIMIT,
    MAX_PAD,
    MAX_REAL,
    MAX_SEED,
    MAX_SIDE,
    MAX_WORKERS,
    Range,
)
from repmlp.tasks.metrics import topk_correct
from repmlp.tasks.recipes import PRESETS

__all__ = [
    "METRIC_FIELDS",
    "TrainConfig",
    "TrainResult",
    "lr_at",
    "EvalConfig",
    "evaluate",
    "evaluate_model",
    "run_training",
    "resumed_config",
    "config_json",
    "make_optimizer",
    "seed_everything",
    "write_metrics_csv",
]

log = logging.getLogger(__name__)

METRIC_FIELDS = [
    "epoch",
    "step",
    "lr",
    "train_loss",
    "train_acc",
    "val_loss",
    "val_top1",
    "val_top5",
    "epoch_s",
]


_DEFAULT = PRESETS["fmnist"]  # the main job's recipe: TrainConfig's defaults

# TrainConfig field -> (the option, its range): the bounds of ``repmlp train``'s parsers, which take them from
# repmlp.tasks.limits too; TrainConfig.validate applies them to a run from the command line and to the values
# a resumed run reads back from its state (tests/test_hostile_input.py checks that it refuses whatever the
# parsers refuse). momentum and label smoothing are fractions (the parsers take any number >= 0).
OPTION_RANGES: dict[str, tuple[str, Range]] = {
    "epochs": ("--epochs", Range(1, MAX_EPOCHS, integer=True)),
    "batch_size": ("--batch-size", Range(1, MAX_BATCH, integer=True)),
    "eval_batch_size": ("--eval-batch-size", Range(1, MAX_BATCH, integer=True)),
    "bench_batch_size": ("--bench-batch-size", Range(1, MAX_BATCH, integer=True)),
    "lr": ("--lr", Range(0, MAX_REAL, lo_open=True)),
    "min_lr": ("--min-lr", Range(0, MAX_REAL)),
    "momentum": ("--momentum", Range(0, 1, hi_open=True)),
    "weight_decay": ("--weight-decay", Range(0, MAX_REAL)),
    "warmup_epochs": ("--warmup-epochs", Range(0, MAX_REAL)),
    "label_smoothing": ("--label-smoothing", Range(0, 1, hi_open=True)),
    "mixup": ("--mixup", Range(0, MAX_REAL)),
    "pad": ("--pad", Range(0, MAX_PAD, integer=True)),
    "img_size": ("--img-size", Range(8, MAX_SIDE, integer=True)),
    "train_limit": ("--train-limit", Range(1, MAX_LIMIT, integer=True)),
    "val_limit": ("--val-limit", Range(1, MAX_LIMIT, integer=True)),
    "seed": ("--seed", Range(0, MAX_SEED, integer=True)),
    "workers": ("--workers", Range(0, MAX_WORKERS, integer=True)),
    "ckpt_every": ("--ckpt-every", Range(0, MAX_COUNT, integer=True)),
}
_OPTIONAL = {"img_size", "train_limit", "val_limit"}  # None: not given
# TrainConfig field -> (the option, its choices); None where a field may be unset.
_CHOICES: dict[str, tuple[str, tuple[Any, ...]]] = {
    "dataset": ("--dataset", DATASETS),
    "preset": ("--preset", tuple(sorted(PRESETS))),
    "optimizer": ("--optimizer", ("sgd", "adamw")),
    "schedule": ("--schedule", ("cosine", "constant")),
    "compile": ("--compile", COMPILE_CHOICES),
    "cuda_graphs": ("--cuda-graphs", COMPILE_CHOICES),
    "channels": ("channels (of an --init file's images)", (None, 1, 3)),
}
# The images' normalisation: a std far from 0 (x / std stays finite), means of pixels in [0, 1].
_NORMALISATION = {"mean": Range(-1e4, 1e4), "std": Range(1e-4, 1e4)}
_FROM_INIT = {"channels", "mean", "std", "eval_preprocessing"}  # the fields an --init file's metadata sets


@dataclass
class TrainConfig:
    """Every option of a classification run (JSON-serialisable; stored in the checkpoint).

    The defaults are the ``fmnist`` preset (:data:`repmlp.tasks.recipes.PRESETS`), the main job's recipe.
    """

    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    download: bool = False
    preset: str = "fmnist"
    model: str = _DEFAULT.model
    model_args: dict[str, Any] = field(default_factory=dict)
    epochs: int = _DEFAULT.epochs
    batch_size: int = _DEFAULT.batch_size  # global, split over the processes
    eval_batch_size: int = 512
    optimizer: str = _DEFAULT.optimizer
    lr: float = _DEFAULT.lr
    min_lr: float = _DEFAULT.min_lr
    momentum: float = _DEFAULT.momentum
    nesterov: bool = _DEFAULT.nesterov
    weight_decay: float = _DEFAULT.weight_decay
    schedule: str = _DEFAULT.schedule
    warmup_epochs: float = _DEFAULT.warmup_epochs
    label_smoothing: float = _DEFAULT.label_smoothing
    mixup: float = _DEFAULT.mixup
    pad: int = _DEFAULT.pad
    flip: bool = _DEFAULT.flip
    autoaugment: bool = _DEFAULT.autoaugment
    img_size: int | None = _DEFAULT.img_size
    init: str | None = None  # a model file whose weights start the run (--init)
    train_limit: int | None = None
    val_limit: int | None = None
    seed: int = 0
    # Mixed precision changes the maths: a resumed run keeps it (None: on for CUDA, fixed at the start).
    amp: bool | None = None
    # Runtime options: they do not change the maths, so a resumed run may change them.
    device: str = "auto"
    channels_last: bool | None = _DEFAULT.channels_last  # None: on for CUDA
    workers: int = 2
    ckpt_every: int = 0
    output: str = "runs/latest"

    compile: str = "auto"  # --compile: auto, on, off (see repmlp.engine.resolve_compile)
    cuda_graphs: str = "auto"  # --cuda-graphs: auto, on, off (see repmlp.engine.resolve_cuda_graphs)
    # Image folders: the images' channels and normalisation (None: RGB, ImageNet's mean/std); with --init
    # they default to the init file's (its recorded preprocessing), so they change the maths.
    channels: int | None = None
    mean: list[float] | None = None
    std: list[float] | None = None
    eval_preprocessing: dict[str, Any] | None = None
    # What the end of the run does; a resumed run keeps the original run's choices unless given again.
    no_export: bool = False
    no_bench: bool = False
    bench_batch_size: int = 128
    # The command that started the run, and those that resumed it (for the report).
    run_command: list[str] = field(default_factory=list)
    resumed_with: list[list[str]] = field(default_factory=list)

    RUNTIME = (
        "device",
        "workers",
        "ckpt_every",
        "output",
        "data_dir",
        "download",
        "eval_batch_size",
        "compile",
        "no_export",
        "no_bench",
        "bench_batch_size",
        "run_command",
        "resumed_with",
        "cuda_graphs",
    )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_state(cls, d: Any, where: object) -> TrainConfig:
        """The configuration a training state records, every field checked for its type and for the
        command line's range (:meth:`validate`): an edited or foreign state is a one-line
        :class:`CheckpointError` naming the file and the field."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{where} has no usable config (not a mapping)")
        hints = _type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in d and not _is_instance(d[f.name], hints[f.name]):
                raise CheckpointError(
                    f"{where}: config field {f.name!r} is {d[f.name]!r}, not of type {f.type}"
                )
        cfg = cls.from_dict(d)
        cfg.validate(where)
        return cfg

    def validate(self, where: object = None) -> None:
        """Refuse values out of the command line's ranges (:data:`OPTION_RANGES`, the bounds of ``repmlp
        train``'s parsers) and choices: a :class:`UserError` naming the option; for values read back from
        the training state ``where``, a :class:`CheckpointError` naming the file and the field (the command
        line never lets such a value into a state). A run from the command line is validated here too."""
        for name, why in self._problems():
            if where is None:
                origin = f" (from --init {self.init})" if name in _FROM_INIT and self.init else ""
                raise UserError(why + origin)
            raise CheckpointError(
                f"{where}: config field {name!r}: {why} (an edited or foreign state: resume a run's own "
                "checkpoint, or train into another --output)"
            )

    def _problems(self) -> Iterator[tuple[str, str]]:
        """``(field, why)`` of each value out of range: ranges and choices first, so that the later checks
        see values of the right kind (:meth:`validate` stops at the first)."""
        for name, (flag, rng) in OPTION_RANGES.items():
            value = getattr(self, name)
            if not (value is None and name in _OPTIONAL) and not rng.contains(value):
                yield name, f"{flag} must be in {rng.describe()}, got {value}"
        for name, (flag, choices) in _CHOICES.items():
            if getattr(self, name) not in choices:
                names = ", ".join(str(c) for c in choices if c is not None)
                yield name, f"{flag} must be one of {names}, got {getattr(self, name)!r}"
        if self.min_lr > self.lr:
            yield "min_lr", f"--min-lr must be at most --lr ({self.lr:g}), got {self.min_lr:g}"
        yield from self._normalisation_problems()

    def _normalisation_problems(self) -> Iterator[tuple[str, str]]:
        """The images' normalisation and evaluation preprocessing (an ``--init`` file's, kept by the run):
        a model file's checks, mean and std together, a std far enough from 0 to divide by (a std of 1e-300
        would make every input inf), at most one value per channel."""

        if (self.mean is None) != (self.std is None):
            missing = "mean" if self.mean is None else "std"
            yield missing, "the images' normalisation needs both mean and std"
        pre = self.eval_preprocessing
        if pre is not None:
            try:
                check_field(
                    "the recorded preprocessing", "extra.eval_preprocessing", pre, "eval_preprocessing"
                )
            except CheckpointError as exc:
                yield "eval_preprocessing", str(exc)
            if "mean" not in pre or "std" not in pre:
                yield "eval_preprocessing", "the evaluation preprocessing must hold the images' mean and std"
        pre = pre or {}
        for name, kind, values in (
            ("mean", "mean", self.mean), ("std", "std", self.std),
            ("eval_preprocessing", "mean", pre.get("mean")), ("eval_preprocessing", "std", pre.get("std")),
        ):  # fmt: skip
            rng = _NORMALISATION[kind]
            if values is not None and not (
                isinstance(values, list) and 1 <= len(values) <= 3 and all(rng.contains(v) for v in values)
            ):
                yield (
                    name,
                    (
                        f"the images' normalisation {kind} must be 1 to 3 numbers in {rng.describe()}, got {values}"
                    ),
                )


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """``cls``'s field annotations, evaluated once (they are strings under ``from __future__``)."""
    return typing.get_type_hints(cls)


def _is_instance(value: Any, hint: Any) -> bool:
    """Whether a JSON value read back from a state fits a :class:`TrainConfig` field's annotation."""
    import types

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_instance(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and all(_is_instance(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    return True  # Any


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
    return torch.optim.SGD(
        groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0
    )


@torch.no_grad()
def evaluate_model(
    model: nn.Module,
    loader,
    device: torch.device,
    *,
    amp: bool = False,
    dist_info: DistInfo | None = None,
    desc: str = "eval",
) -> dict[str, float]:
    """Loss, top-1 and top-5 accuracy (%) over ``loader``; sums are all-reduced across processes."""
    from tqdm import tqdm

    model.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # loss, top1, top5, n
    show = dist_info is None or dist_info.is_main
    for x, y in tqdm(
        loader.batches(0), total=len(loader), desc=desc, leave=False, disable=None if show else True
    ):
        with torch.autocast(device.type, dtype=amp_dtype(device), enabled=amp):
            logits = model(x)
        logits = logits.float()
        c1, c5 = topk_correct(logits, y)
        sums += torch.tensor(
            [F.cross_entropy(logits, y, reduction="sum").item(), c1, c5, len(y)], dtype=torch.float64
        )
    if dist_info is not None and dist_info.enabled:
        t = sums.to(device) if device.type == "cuda" else sums
        dist.all_reduce(t)
        sums = t.cpu()
    n = max(1.0, sums[3].item())
    return {
        "loss": sums[0].item() / n,
        "top1": 100 * sums[1].item() / n,
        "top5": 100 * sums[2].item() / n,
        "n": int(n),
    }


def write_metrics_csv(path: Path, history: list[dict[str, Any]]) -> None:
    """``metrics.csv``: one row per epoch (:data:`METRIC_FIELDS`)."""
    _write_csv(path, history, METRIC_FIELDS)


@dataclass
class TrainResult:
    model: nn.Module  # unwrapped, eval mode, on the training device
    model_kwargs: dict[str, Any]
    data: Data
    history: list[dict[str, Any]]
    config: TrainConfig
    train_seconds: float
    replica_hashes: list[str]
    dist_info: DistInfo
    init: dict[str, Any] | None = None  # repmlp.tasks.finetune.InitReport of --init, as a dict
    mode: str = "eager"  # how the training steps ran (repmlp.engine.LoopResult.mode)


def resumed_config(
    saved: TrainConfig, cfg: TrainConfig, given: Collection[str] | None, where: Path
) -> TrainConfig:
    """The configuration a resumed run continues with: the saved one, with ``cfg``'s runtime options.

    ``given`` names the fields the user set explicitly (``None``: all of ``cfg``). Those that change the
    maths must equal the saved values, else the checkpoint belongs to another model or recipe and resuming
    would silently train something else: :class:`UserError`. Runtime options (:attr:`TrainConfig.RUNTIME`:
    device, workers, data folder, ...) that were given replace the saved ones; the others keep the saved
    values. (:func:`repmlp.engine.check_resumable`'s rules, which the engine applies again on resume.)
    """
    merged = check_resumable(
        saved.to_dict(),
        cfg.to_dict(),
        where,
        runtime=TrainConfig.RUNTIME,
        given=given,
        hint="leave these options out to continue it, or train into another --output",
    )
    return TrainConfig.from_dict(merged)


def _open_run(
    cfg: TrainConfig, resume: bool, given: Collection[str] | None, di: DistInfo, finished_ok: bool = False
) -> tuple[TrainConfig, dict[str, Any] | None]:
    """The run's configuration and the state to resume from (``None`` for a new run); refuses to
    overwrite a run in ``cfg.output`` and to resume a finished one. A resumed run's saved configuration is
    checked like a model file's metadata (types, ranges, model options) before anything is built."""
    out = Path(cfg.output)
    state = check_output(out, resume, di, finished_ok=finished_ok)
    if state is None:
        return cfg, None
    where = out / STATE_FILE
    saved = TrainConfig.from_state(state.get("config"), where)
    check_model_kwargs(where, saved.model_args, "config.model_args")
    if not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{where} holds no model weights")
    merged = resumed_config(saved, cfg, given, out)
    # The report shows the command that started the run, then each that resumed it.
    merged.resumed_with = saved.resumed_with + ([cfg.run_command] if cfg.run_command else [])
    return merged, state


def _build_data_and_model(
    cfg: TrainConfig, di: DistInfo, state: dict[str, Any] | None = None
) -> tuple[Data, nn.Module, dict[str, Any]]:
    """Seed, then this process's data and the model on its device: ``(data, model, model_kwargs)``. A
    resumed run's model is sized on the ``meta`` device against the state's weights first."""
    device = di.device
    channels_last = cfg.channels_last if cfg.channels_last is not None else device.type == "cuda"
    seed_everything(cfg.seed)
    data = build_data(
        DataConfig(
            dataset=cfg.dataset,
            data_dir=cfg.data_dir,
            download=cfg.download,
            batch_size=cfg.batch_size // di.world,
            eval_batch_size=cfg.eval_batch_size,
            train_limit=cfg.train_limit,
            val_limit=cfg.val_limit,
            seed=cfg.seed,
            pad=cfg.pad,
            flip=cfg.flip,
            autoaugment=cfg.autoaugment,
            img_size=cfg.img_size,
            channels=cfg.channels,
            mean=cfg.mean,
            std=cfg.std,
            eval_preprocessing=cfg.eval_preprocessing,
            workers=cfg.workers,
            channels_last=channels_last,
        ),
        rank=di.rank,
        world=di.world,
        device=device,
    )
    if state is None:
        _check_init_fits(cfg, data)
    model, model_kwargs = build_model(
        cfg.model,
        num_classes=data.num_classes,
        in_chans=data.in_chans,
        img_size=data.img_size,
        model_args=cfg.model_args,
        check=None if state is None else functools.partial(_check_state_fits, cfg, state["model"]),
    )
    model.to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    return data, model, model_kwargs


def _check_state_fits(cfg: TrainConfig, weights: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """A resumed run's model, built on the ``meta`` device within the budget of its state's weights, must hold
    their keys and shapes: a state whose options describe a huge model is refused before anything is built."""
    what = f"this run ({cfg.model} with {kwargs})"
    check_fit(
        Path(cfg.output) / STATE_FILE, cfg.model, kwargs, weights, field_name="config.model_args", what=what
    )


def _check_init_fits(cfg: TrainConfig, data: Data) -> None:
    """A new ``--init`` run of the file's own model must give it inputs it was built for: the channels
    (image folders are converted to them; an in-memory data set has its own) and, for a model built for
    one input size, the size. A mismatch is one line saying which option to pass."""
    from repmlp.tasks.finetune import init_preprocessing

    if not cfg.init:
        return
    pre = init_preprocessing(cfg.init)
    size = pre["input_size"]
    file_model = pre["model"]
    if size is None or cfg.model != file_model:
        return
    c, h, w = size
    if c != data.in_chans:
        raise UserError(
            f"--init {cfg.init} takes {c}-channel images but {cfg.dataset} has {data.in_chans}: fine-tune it on "
            "an image folder (--dataset imagefolder --data-dir DIR; its images are converted to the file's "
            "channels), or pass --model to train another model from scratch"
        )
    if takes_img_size(cfg.model) and pre["fixed_size"] and (h, w) != (data.img_size, data.img_size):
        hint = f"pass --img-size {h}" if h == w else "give images of the file's size"
        raise UserError(
            f"--init {cfg.init} holds {file_model} built for {h}x{w} inputs, but this run's are "
            f"{data.img_size}x{data.img_size} (its weights would not fit): {hint}"
        )


def _log_start(cfg: TrainConfig, model: nn.Module, data: Data, di: DistInfo) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "training %s (%.2fM params) on %s: %d train / %d val examples, %d epochs x %d steps, batch %d, "
        "%s, device %s%s",
        cfg.model,
        n_params / 1e6,
        cfg.dataset,
        data.train.num_samples,
        data.val.num_samples,
        cfg.epochs,
        len(data.train),
        cfg.batch_size,
        cfg.optimizer,
        di.device,
        f", {di.world} processes" if di.enabled else "",
    )


@dataclass
class _Hooks:
    """Classification's part of the engine's loop (:class:`repmlp.engine.LoopHooks`)."""

    cfg: TrainConfig
    procs: DistInfo
    model: nn.Module  # unwrapped: evaluated without DDP
    data: Data
    total_steps: int

    def step(self, net: nn.Module, x: Tensor, y: Tensor, pos: Position) -> tuple[Tensor, dict[str, float]]:
        """Mixup (per-batch seeded) and label-smoothed cross-entropy of ``x`` ``(N, C, H, W)``, ``y`` ``(N,)``.

        Statistics: the loss and 100 x the correct count summed over the batch (``n`` images)."""
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

    def end_epoch(self, pos: Position) -> dict[str, Any]:
        """Evaluate on the validation set; the epoch's ``metrics.csv`` row (logged by rank 0)."""
        cfg, di = self.cfg, self.procs
        broadcast_buffers(self.model, di)
        val = evaluate_model(self.model, self.data.val, di.device, amp=bool(cfg.amp), dist_info=di,
                       desc=f"eval {pos.epoch + 1}")  # fmt: skip
        lr = lr_at(pos.step - 1, self.total_steps, cfg, len(self.data.train))
        return _epoch_row(cfg, pos, lr, val, di)


def _epoch_row(
    cfg: TrainConfig, pos: Position, lr: float, val: dict[str, float], di: DistInfo
) -> dict[str, Any]:
    """The metrics.csv row of the finished epoch ``pos.epoch``."""
    acc = pos.epoch_acc
    # Train-loss/accuracy sums are per rank; average them too so the metrics describe the whole run.
    sums = torch.tensor([acc.get("loss", 0.0), acc.get("acc", 0.0), acc.get("n", 0.0)], dtype=torch.float64)
    if di.enabled:
        dist.all_reduce(sums)
    row = {
        "epoch": pos.epoch + 1,
        "step": pos.step,
        "lr": lr,
        "train_loss": sums[0].item() / max(1, sums[2].item()),
        "train_acc": sums[1].item() / max(1, sums[2].item()),
        "val_loss": val["loss"],
        "val_top1": val["top1"],
        "val_top5": val["top5"],
        "epoch_s": acc.get("seconds", 0.0),
    }
    if di.is_main:
        log.info(
            "epoch %d/%d: train loss %.4f acc %.2f%% | val loss %.4f top-1 %.2f%% top-5 %.2f%% | %.0f s",
            pos.epoch + 1,
            cfg.epochs,
            row["train_loss"],
            row["train_acc"],
            val["loss"],
            val["top1"],
            val["top5"],
            row["epoch_s"],
        )
    return row


def run_training(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    stop_after_steps: int | None = None,
    given: Collection[str] | None = None,
    finished_ok: bool = False,
) -> TrainResult:
    """Train per ``cfg`` into ``cfg.output``; see the module docstring. Joins the process group.

    With ``resume``, the run continues from ``cfg.output``'s checkpoint with the saved configuration;
    ``given`` names the options the user set explicitly (see :func:`resumed_config`).
    ``stop_after_steps`` simulates a crash (``--stop-after-steps``, for tests of resuming). A finished
    run (its report written) is not resumed unless ``finished_ok`` (``repmlp study`` redoing the end).
    """
    cfg.validate()
    di = setup_distributed(cfg.device)
    if cfg.batch_size % di.world:
        raise UserError(f"--batch-size {cfg.batch_size} is not divisible by the {di.world} processes")
    amp = cfg.amp if cfg.amp is not None else di.device.type == "cuda"
    graphs = resolve_cuda_graphs(  # before anything is written: a refused --cuda-graphs on is a usage error
        cfg.cuda_graphs,
        di.device,
        world=di.world,
        compile_choice=cfg.compile,
        scaler=amp and amp_dtype(di.device) == torch.float16,
    )
    cfg, state = _open_run(cfg, resume, given, di, finished_ok)
    cfg.amp = (
        cfg.amp if cfg.amp is not None else di.device.type == "cuda"
    )  # saved resolved: a resume keeps it
    data, model, model_kwargs = _build_data_and_model(cfg, di, state)
    require_task_model(model, "cls", cfg.model)
    check_batchnorm_batch(model, cfg.batch_size, data.train.num_samples, di)
    init = _initialise(cfg, model, state, di)
    optimizer = make_optimizer(model, cfg)
    steps_per_epoch = len(data.train)
    total = steps_per_epoch * cfg.epochs
    if di.is_main:
        _log_start(cfg, model, data, di)

    opts = LoopOptions(
        output=Path(cfg.output),
        config=cfg.to_dict(),
        lr_at=lambda step: [lr_at(step, total, cfg, steps_per_epoch)] * len(optimizer.param_groups),
        epochs=cfg.epochs,
        ckpt_every=cfg.ckpt_every,
        amp=cfg.amp,
        runtime_keys=TrainConfig.RUNTIME,
        stop_after_steps=stop_after_steps,
        # The --init report travels in the checkpoint: a resumed run reports it without the file.
        extra_state={"model_kwargs": model_kwargs, **({"init": init} if init else {})},
        metric_fields=METRIC_FIELDS,
        cuda_graphs=graphs,
        compile=resolve_compile(cfg.compile, di.device, graphs),
    )
    task = _Hooks(cfg, di, model, data, total)
    # SyncBatchNorm on multi-GPU runs (see repmlp.engine.prepare_module); the parameters stay model's.
    net = prepare_module(model, di)
    loop = train_loop(net, optimizer, data.train, opts, di, state, LoopHooks(task.step, task.end_epoch))
    model.eval()
    return TrainResult(
        model, model_kwargs, data, loop.history, cfg, loop.seconds, loop.replica_hashes, di, init, loop.mode
    )


def _initialise(
    cfg: TrainConfig, model: nn.Module, state: dict[str, Any] | None, di: DistInfo
) -> dict[str, Any] | None:
    """``--init``: load the file's weights into ``model`` (a new run) or recall what was loaded (a resumed
    run, whose weights come from its checkpoint). Returns the :class:`repmlp.tasks.finetune.InitReport` dict."""
    if not cfg.init:
        return None
    if state is not None:
        return state.get("init")
    from repmlp.tasks.finetune import init_from_file

    report = init_from_file(model, cfg.init)
    if di.is_main:
        log.info("%s", report.summary())
        if report.reinitialised:
            log.info(
                "the file's classifier does not fit %s classes: %s re-initialised (as timm does)",
                getattr(model, "num_classes", "the new"),
                ", ".join(report.reinitialised),
            )
    return report.to_dict()


def config_json(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)


@dataclass
class EvalConfig:
    """``repmlp eval`` (``--task cls``): a model file and the data set to score it on (``dataset`` and
    ``data_dir`` default to the ones the file was trained on)."""

    checkpoint: str | None
    dataset: str | None = None
    data_dir: str | None = None
    download: bool = False
    val_limit: int | None = None
    img_size: int | None = None
    batch_size: int = 512
    workers: int = 2
    device: str = "auto"
    json: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EvalConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def evaluate(args: EvalConfig) -> int:
    """Top-1/top-5 and loss of a model file on a data set, printed (as JSON with ``json``). A file whose
    classes, channels or input size do not fit the data set is a :class:`CheckpointError`."""
    if not args.checkpoint:
        raise UserError("eval needs --checkpoint FILE (model.safetensors or deploy.safetensors)")
    from repmlp.data.for_model import model_data_config
    from repmlp.engine import resolve_device
    from repmlp.io.model_file import load_model

    device = resolve_device(args.device)
    model = load_model(args.checkpoint, device=device)
    meta = model.metadata
    extra = meta.extra
    dataset = args.dataset or extra.get("dataset") or "fashion-mnist"
    kwargs = meta.model_kwargs
    # The model's own input channels (a foreign model's checkpoint may not record in_chans).
    in_chans = meta.input_size[0]
    # The file's channels, input size and normalisation, as convert reads the data for it too (the
    # training run's data folder, recorded in the file, unless another is given).
    config = model_data_config(meta, dataset, data_dir=args.data_dir, img_size=args.img_size,
                               download=args.download, eval_batch_size=args.batch_size,
                               val_limit=args.val_limit, workers=args.workers, need_train=False)  # fmt: skip
    data = build_data(config, device=device)
    if kwargs.get("num_classes") not in (None, data.num_classes):
        raise CheckpointError(
            f"{args.checkpoint} predicts {kwargs['num_classes']} classes but {dataset} has {data.num_classes}"
        )
    if in_chans != data.in_chans:
        raise CheckpointError(
            f"{args.checkpoint} takes {in_chans}-channel images but {dataset} has {data.in_chans}"
        )
    if kwargs.get("img_size") not in (None, data.img_size):
        raise CheckpointError(
            f"{args.checkpoint} takes {kwargs['img_size']}px images but {dataset} has {data.img_size}px"
        )
    res = evaluate_model(model, data.val, device)
    res.update(
        model=meta.name,
        form=meta.form,
        precision=meta.precision,
        dataset=dataset,
        checkpoint=str(args.checkpoint),
    )
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        print(
            f"{meta.name} ({meta.form} form, {res['precision']}) on {dataset}, {res['n']} examples: "
            f"top-1 {res['top1']:.2f}%  top-5 {res['top5']:.2f}%  loss {res['loss']:.4f}"
        )
    return 0
