"""Image classification (paper Sec. 4.1-4.2): data, model, loss, metrics, the training loop and the report.

The classification task that ``repmlp train`` (``--task cls``) runs:

- :func:`run_training` trains a model on a data set per a :class:`TrainConfig`, writing into the run folder
  ``checkpoint.safetensors`` (the whole training state, see :mod:`repmlp.checkpoint`) every ``ckpt_every``
  steps and at the end of every epoch, plus ``metrics.csv``. A killed run continues with ``resume=True``
  from its last checkpoint: model, optimizer, learning-rate position, gradient scaler, the
  torch/numpy/python RNG states and the position in the epoch's data order are restored, so the final
  weights equal those of an uninterrupted run. The learning rate is a pure function of the global step
  (:func:`lr_at`): the "scheduler state" is that step.
- :func:`finish_run` takes the finished :class:`TrainResult` and evaluates, converts, verifies the
  conversion, benchmarks, exports, plots and writes into the run folder ``model.safetensors``
  (training-time form), ``deploy.safetensors`` (converted; reloaded with ``deploy=True`` for the checks),
  ``deploy.onnx``, ``curves.png``, ``fc3.png`` and ``report.md``.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import platform
import random
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint import (
    CheckpointError,
    atomic_write_bytes,
    atomic_write_text,
    load_model,
    load_state,
    save_model,
    save_state,
)
from ..data import Data, DataConfig, build_data
from ..data.loader import batch_generator
from ..engine import DistInfo, build_model, optimizer_step, prepare_module, setup_distributed
from ..engine import amp_dtype as _amp_dtype
from ..errors import UserError

__all__ = [
    "TrainConfig",
    "DistInfo",
    "lr_at",
    "evaluate",
    "run_training",
    "build_model",
    "setup_distributed",
    "finish_run",
    "predict",
    "compare_logits",
    "plot_curves",
    "hardware_summary",
]

log = logging.getLogger(__name__)

STATE_FILE = "checkpoint.safetensors"
METRICS_FILE = "metrics.csv"
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


@dataclass
class TrainConfig:
    """Every option of a classification run (JSON-serialisable; stored in the checkpoint).

    The defaults are the ``fmnist`` preset (:data:`repmlp.recipes.PRESETS`), the main job's recipe.
    """

    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    download: bool = False
    preset: str = "fmnist"
    model: str = "repmlp_fmnist"
    model_args: dict[str, Any] = field(default_factory=dict)
    epochs: int = 5
    batch_size: int = 256  # global, split over the processes
    eval_batch_size: int = 512
    optimizer: str = "sgd"
    lr: float = 0.2
    min_lr: float = 0.0
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-5
    schedule: str = "cosine"
    warmup_epochs: float = 0.5
    label_smoothing: float = 0.1
    mixup: float = 0.0
    pad: int = 0
    flip: bool = True
    autoaugment: bool = False
    img_size: int | None = None
    train_limit: int | None = None
    val_limit: int | None = None
    seed: int = 0
    # Mixed precision changes the maths: a resumed run keeps it (None: on for CUDA, fixed at the start).
    amp: bool | None = None
    # Runtime options: they do not change the maths, so a resumed run may change them.
    device: str = "auto"
    channels_last: bool | None = True  # None: on for CUDA
    workers: int = 2
    ckpt_every: int = 0
    output: str = "runs/latest"

    RUNTIME = ("device", "workers", "ckpt_every", "output", "data_dir", "download", "eval_batch_size")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def validate(self) -> None:
        """Raise :class:`UserError` for options out of range."""
        checks = [
            (self.epochs >= 1, f"--epochs must be at least 1, got {self.epochs}"),
            (self.batch_size >= 1, f"--batch-size must be at least 1, got {self.batch_size}"),
            (self.eval_batch_size >= 1, f"--eval-batch-size must be at least 1, got {self.eval_batch_size}"),
            (math.isfinite(self.lr) and self.lr > 0, f"--lr must be positive, got {self.lr}"),
            (0 <= self.min_lr <= self.lr, f"--min-lr must be in [0, lr], got {self.min_lr}"),
            (0 <= self.momentum < 1, f"--momentum must be in [0, 1), got {self.momentum}"),
            (self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}"),
            (self.warmup_epochs >= 0, f"--warmup-epochs must be >= 0, got {self.warmup_epochs}"),
            (
                0 <= self.label_smoothing < 1,
                f"--label-smoothing must be in [0, 1), got {self.label_smoothing}",
            ),
            (self.mixup >= 0, f"--mixup must be >= 0, got {self.mixup}"),
            (self.pad >= 0, f"--pad must be >= 0, got {self.pad}"),
            (self.workers >= 0, f"--workers must be >= 0, got {self.workers}"),
            (self.ckpt_every >= 0, f"--ckpt-every must be >= 0, got {self.ckpt_every}"),
            (
                self.img_size is None or self.img_size >= 8,
                f"--img-size must be at least 8, got {self.img_size}",
            ),
            (self.optimizer in ("sgd", "adamw"), f"--optimizer must be sgd or adamw, got {self.optimizer}"),
            (
                self.schedule in ("cosine", "constant"),
                f"--schedule must be cosine or constant, got {self.schedule}",
            ),
            (
                self.train_limit is None or self.train_limit >= 1,
                f"--train-limit must be >= 1, got {self.train_limit}",
            ),
            (
                self.val_limit is None or self.val_limit >= 1,
                f"--val-limit must be >= 1, got {self.val_limit}",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise UserError(msg)


# ------------------------------------------------------------------------------------- distributed
# ----------------------------------------------------------------------------------------- pieces
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


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


def topk_correct(logits: Tensor, target: Tensor, ks: tuple[int, ...] = (1, 5)) -> list[int]:
    """Number of samples whose target is among the top-k logits, for each k (k clipped to #classes)."""
    kmax = min(max(ks), logits.shape[1])
    top = logits.topk(kmax, dim=1).indices
    hits = top == target[:, None]
    return [int(hits[:, : min(k, kmax)].any(dim=1).sum()) for k in ks]


@torch.no_grad()
def evaluate(
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
        with torch.autocast(device.type, dtype=_amp_dtype(device), enabled=amp):
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


def state_hash(model: nn.Module) -> str:
    """SHA-256 of a model's parameters and buffers (bitwise), to compare replicas or runs."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_metrics_csv(path: Path, history: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=METRIC_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    atomic_write_text(path, buf.getvalue())


# ------------------------------------------------------------------------------------------- loop
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


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _broadcast_buffers(model: nn.Module, dist_info: DistInfo) -> None:
    """Make every replica's BatchNorm statistics rank 0's (DDP syncs parameters, not running stats)."""
    if dist_info.enabled:
        for b in model.buffers():
            dist.broadcast(b.data, src=0)


def option_name(field_name: str) -> str:
    """The command-line spelling of a :class:`TrainConfig` field (``model_args`` -> ``--model-arg``)."""
    return "--model-arg" if field_name == "model_args" else "--" + field_name.replace("_", "-")


def resumed_config(
    saved: TrainConfig, cfg: TrainConfig, given: Collection[str] | None, where: Path
) -> TrainConfig:
    """The configuration a resumed run continues with: the saved one, with ``cfg``'s runtime options.

    ``given`` names the fields the user set explicitly (``None``: all of ``cfg``). Those that change the
    maths must equal the saved values, else the checkpoint belongs to another model or recipe and resuming
    would silently train something else: :class:`UserError`. Runtime options (device, workers, data folder,
    ...) that were given replace the saved ones; the others keep the saved values.
    """
    explicit = {f.name for f in dataclasses.fields(TrainConfig)} if given is None else set(given)
    conflicts = [
        f"{option_name(k)} {getattr(saved, k)!r}, not {getattr(cfg, k)!r}"
        for k in sorted(explicit)
        if k not in TrainConfig.RUNTIME and hasattr(saved, k) and getattr(saved, k) != getattr(cfg, k)
    ]
    if conflicts:
        raise UserError(
            f"cannot resume {where}: its checkpoint was trained with {'; '.join(conflicts[:4])}"
            f"{' ...' if len(conflicts) > 4 else ''} (leave these options out to continue it, or train into "
            "another --output)"
        )
    for k in TrainConfig.RUNTIME:
        if k in explicit:
            setattr(saved, k, getattr(cfg, k))
    return saved


def _open_run(
    cfg: TrainConfig, resume: bool, given: Collection[str] | None, di: DistInfo
) -> tuple[TrainConfig, dict[str, Any] | None]:
    """The run's configuration and the state to resume from (``None`` for a new run); refuses to
    overwrite a run in ``cfg.output``."""
    out = Path(cfg.output)
    state_path = out / STATE_FILE
    if resume:
        if not state_path.is_file():
            raise UserError(f"nothing to resume: {state_path} does not exist")
        state = load_state(state_path)
        try:
            saved = TrainConfig.from_dict(state["config"])
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"{state_path} has no usable config ({exc})") from None
        return resumed_config(saved, cfg, given, out), state
    if di.is_main and state_path.exists():
        raise UserError(
            f"{out} already holds a run ({STATE_FILE}); use --resume to continue it or another --output"
        )
    return cfg, None


def _build_data_and_model(cfg: TrainConfig, di: DistInfo) -> tuple[Data, nn.Module, dict[str, Any]]:
    """Seed, then this process's data and the model on its device: ``(data, model, model_kwargs)``."""
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
            workers=cfg.workers,
            channels_last=channels_last,
        ),
        rank=di.rank,
        world=di.world,
        device=device,
    )
    model, model_kwargs = build_model(
        cfg.model,
        num_classes=data.num_classes,
        in_chans=data.in_chans,
        img_size=data.img_size,
        model_args=cfg.model_args,
    )
    model.to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    return data, model, model_kwargs


def _restore(state: dict[str, Any], model: nn.Module, optimizer, scaler, di: DistInfo, state_path: Path):
    """Load a saved training state; returns ``(epoch, batch_in_epoch, step, history, epoch_acc)``."""
    try:
        model.load_state_dict(state["model"], strict=True)
        optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        epoch, batch_in_epoch, step = int(state["epoch"]), int(state["batch"]), int(state["step"])
        history, acc = list(state["history"]), dict(state["epoch_acc"])
        set_rng_state(
            state["rng"][str(di.rank)] if str(di.rank) in state["rng"] else state["rng"]["0"], di.device
        )
    except (KeyError, RuntimeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{state_path} does not fit this run: {str(exc).splitlines()[0]}") from None
    if di.is_main:
        log.info(
            "resuming %s at epoch %d, batch %d (step %d)", state_path.parent, epoch + 1, batch_in_epoch, step
        )
    return epoch, batch_in_epoch, step, history, acc


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


def _replica_hashes(model: nn.Module, di: DistInfo) -> list[str]:
    """Every process's :func:`state_hash` of ``model`` (rank order), logged: the check that DDP kept the
    processes in step (also in report.md)."""
    _broadcast_buffers(model, di)
    hashes = [state_hash(model)]
    if di.enabled:
        gathered: list[Any] = [None] * di.world
        dist.all_gather_object(gathered, hashes[0])
        hashes = gathered
        if len(set(hashes)) != 1:
            log.error("replicas differ after training: %s", hashes)
        elif di.is_main:
            log.info("final weights identical on all %d processes (sha256 %s)", di.world, hashes[0][:16])
    return hashes


def _epoch_row(cfg: TrainConfig, epoch: int, step: int, lr: float, acc, val, di: DistInfo) -> dict[str, Any]:
    """The metrics.csv row of a finished epoch (logged by rank 0)."""
    # Train-loss/accuracy sums are per rank; average them too so the metrics describe the whole run.
    sums = torch.tensor([acc["loss"], acc["correct"], acc["n"]], dtype=torch.float64)
    if di.enabled:
        dist.all_reduce(sums)
    row = {
        "epoch": epoch + 1,
        "step": step,
        "lr": lr,
        "train_loss": sums[0].item() / max(1, sums[2].item()),
        "train_acc": 100 * sums[1].item() / max(1, sums[2].item()),
        "val_loss": val["loss"],
        "val_top1": val["top1"],
        "val_top5": val["top5"],
        "epoch_s": acc["seconds"],
    }
    if di.is_main:
        log.info(
            "epoch %d/%d: train loss %.4f acc %.2f%% | val loss %.4f top-1 %.2f%% top-5 %.2f%% | %.0f s",
            epoch + 1,
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
) -> TrainResult:
    """Train per ``cfg`` into ``cfg.output``; see the module docstring. Joins/leaves the process group.

    With ``resume``, the run continues from ``cfg.output``'s checkpoint with the saved configuration;
    ``given`` names the options the user set explicitly (see :func:`resumed_config`).
    """
    from tqdm import tqdm

    cfg.validate()
    di = setup_distributed(cfg.device)
    if cfg.batch_size % di.world:
        raise UserError(f"--batch-size {cfg.batch_size} is not divisible by the {di.world} processes")
    cfg, state = _open_run(cfg, resume, given, di)
    out = Path(cfg.output)
    state_path = out / STATE_FILE
    device = di.device
    amp = cfg.amp if cfg.amp is not None else device.type == "cuda"
    cfg.amp = amp  # saved resolved, so that a resume on another device keeps it
    data, model, model_kwargs = _build_data_and_model(cfg, di)
    optimizer = make_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=amp and _amp_dtype(device) == torch.float16)
    steps_per_epoch = len(data.train)
    total_steps = steps_per_epoch * cfg.epochs
    epoch, batch_in_epoch, step = 0, 0, 0
    history: list[dict[str, Any]] = []
    acc = {"loss": 0.0, "correct": 0.0, "n": 0.0, "seconds": 0.0}
    if state is not None:
        epoch, batch_in_epoch, step, history, acc = _restore(state, model, optimizer, scaler, di, state_path)
    if di.is_main:
        out.mkdir(parents=True, exist_ok=True)
        _log_start(cfg, model, data, di)
    # SyncBatchNorm on multi-GPU runs (see repmlp.engine.prepare_module); the parameters stay model's.
    ddp = prepare_module(model, di)

    def save_checkpoint() -> None:
        rngs = [rng_state(device)]
        if di.enabled:
            gathered: list[Any] = [None] * di.world
            dist.all_gather_object(gathered, rngs[0])
            rngs = gathered
        if not di.is_main:
            return
        save_state(
            state_path,
            {
                "config": cfg.to_dict(),
                "model_kwargs": model_kwargs,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict() if scaler.is_enabled() else {},
                "epoch": epoch,
                "batch": batch_in_epoch,
                "step": step,
                "history": history,
                "epoch_acc": acc,
                "rng": {str(r): s for r, s in enumerate(rngs)},
            },
        )

    t_start = time.perf_counter()
    while epoch < cfg.epochs:
        ddp.train()
        t_epoch = time.perf_counter()
        bar = tqdm(
            data.train.batches(epoch, batch_in_epoch),
            total=steps_per_epoch,
            initial=batch_in_epoch,
            desc=f"epoch {epoch + 1}/{cfg.epochs}",
            disable=None if di.is_main else True,
            leave=False,
        )
        for x, y in bar:
            lr = lr_at(step, total_steps, cfg, steps_per_epoch)
            for g in optimizer.param_groups:
                g["lr"] = lr
            target = y
            lam = 1.0
            if cfg.mixup > 0:
                gen = batch_generator(cfg.seed, epoch, batch_in_epoch, di.rank, 1)
                lam = float(
                    np.random.default_rng(int(torch.randint(2**31, (1,), generator=gen))).beta(
                        cfg.mixup, cfg.mixup
                    )
                )
                perm = torch.randperm(len(y), generator=gen).to(device)
                x = lam * x + (1 - lam) * x[perm]
                target2 = y[perm]
            with torch.autocast(device.type, dtype=_amp_dtype(device), enabled=amp):
                logits = ddp(x)
                loss = F.cross_entropy(logits.float(), target, label_smoothing=cfg.label_smoothing)
                if cfg.mixup > 0:
                    loss = lam * loss + (1 - lam) * F.cross_entropy(
                        logits.float(), target2, label_smoothing=cfg.label_smoothing
                    )
            optimizer_step(loss, optimizer, scaler, step)
            step += 1
            batch_in_epoch += 1
            acc["loss"] += loss.item() * len(y)
            acc["correct"] += (logits.argmax(1) == y).sum().item()
            acc["n"] += len(y)
            if di.is_main:
                bar.set_postfix(
                    loss=f"{acc['loss'] / acc['n']:.3f}",
                    acc=f"{100 * acc['correct'] / acc['n']:.1f}",
                    lr=f"{lr:.3g}",
                    refresh=False,
                )
            if cfg.ckpt_every and step % cfg.ckpt_every == 0 and batch_in_epoch < steps_per_epoch:
                acc["seconds"] += time.perf_counter() - t_epoch
                t_epoch = time.perf_counter()
                save_checkpoint()
            if stop_after_steps is not None and step >= stop_after_steps:
                bar.close()
                # Simulates a crash (tests of --resume): no cleanup, no final checkpoint.
                log.warning("--stop-after-steps %d reached: exiting without cleanup", stop_after_steps)
                logging.shutdown()
                os._exit(3)
        bar.close()
        acc["seconds"] += time.perf_counter() - t_epoch
        _broadcast_buffers(model, di)
        val = evaluate(model, data.val, device, amp=amp, dist_info=di, desc=f"eval {epoch + 1}")
        lr_end = lr_at(step - 1, total_steps, cfg, steps_per_epoch)
        history.append(_epoch_row(cfg, epoch, step, lr_end, acc, val, di))
        epoch, batch_in_epoch = epoch + 1, 0
        acc = {"loss": 0.0, "correct": 0.0, "n": 0.0, "seconds": 0.0}
        save_checkpoint()
        if di.is_main:
            write_metrics_csv(out / METRICS_FILE, history)
    train_seconds = time.perf_counter() - t_start
    if di.is_main:
        # Again after the loop: a run killed between its last checkpoint and this file resumes past the loop.
        write_metrics_csv(out / METRICS_FILE, history)
    hashes = _replica_hashes(model, di)
    model.eval()
    return TrainResult(model, model_kwargs, data, history, cfg, train_seconds, hashes, di)


def config_json(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)


# ----------------------------------------------------------------- the end of a run: evaluate, convert, report

# Converted logits must match the training-time ones to float rounding: max |diff| relative to max |logit|.
EQUIVALENCE_RTOL = 1e-4


@torch.no_grad()
def predict(model: nn.Module, loader, device: torch.device, *, amp: bool = False) -> tuple[Tensor, Tensor]:
    """Logits ``(N, K)`` (float32, CPU) and labels ``(N,)`` of every example of ``loader`` on this process."""
    from tqdm import tqdm

    model.eval().to(device)
    logits, labels = [], []
    for x, y in tqdm(loader.batches(0), total=len(loader), desc="predict", leave=False, disable=None):
        with torch.autocast(device.type, dtype=_amp_dtype(device), enabled=amp):
            out = model(x)
        logits.append(out.float().cpu())
        labels.append(y.cpu())
    return torch.cat(logits), torch.cat(labels)


def accuracy(logits: Tensor, labels: Tensor) -> dict[str, float]:
    c1, c5 = topk_correct(logits, labels)
    n = max(1, len(labels))
    return {"top1": 100 * c1 / n, "top5": 100 * c5 / n, "n": len(labels)}


def compare_logits(ref: Tensor, out: Tensor) -> dict[str, float]:
    """Max abs and relative difference, and how many predictions (argmax) differ."""
    diff = (ref - out).abs().max().item()
    scale = max(ref.abs().max().item(), 1e-12)
    return {
        "max_abs_diff": diff,
        "max_rel_diff": diff / scale,
        "changed_predictions": int((ref.argmax(1) != out.argmax(1)).sum()),
    }


def plot_curves(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """Loss and top-1 accuracy per epoch (train and validation) as a PNG, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    # The training loss includes label smoothing (and mixup), so it can sit above the validation loss.
    ax1.plot(epochs, [r["train_loss"] for r in history], "o-", label="train (as optimised)")
    ax1.plot(epochs, [r["val_loss"] for r in history], "s-", label="validation")
    ax1.set(xlabel="epoch", ylabel="cross-entropy loss", title="loss")
    ax2.plot(epochs, [r["train_acc"] for r in history], "o-", label="train")
    ax2.plot(epochs, [r["val_top1"] for r in history], "s-", label="validation top-1")
    ax2.set(xlabel="epoch", ylabel="accuracy (%)", title="accuracy")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def hardware_summary(device: torch.device) -> str:
    """One line naming the processor (or GPU), core count, threads and library versions."""
    if device.type == "cuda":
        hw = torch.cuda.get_device_name(device)
    else:
        from ..engine import cpu_name

        hw = cpu_name() + f", {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{hw}; torch {torch.__version__}, Python {platform.python_version()}"


def _missing_export_packages() -> list[str]:
    from ..export import missing_onnx_packages

    return missing_onnx_packages()


def _step(name: str, fn, notes: list[str]):
    """Run an optional final step; a failure is logged and noted in the report instead of aborting."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the run's weights are saved; report what failed
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.error("%s failed: %s", name, msg)
        notes.append(f"{name} failed: {msg}")
        return None


def finish_run(
    result: TrainResult,
    *,
    command: list[str],
    started: float,
    bench_batch_size: int = 128,
    export: bool = True,
    bench: bool = True,
) -> bool:
    """Evaluate, convert, verify, benchmark, export and report (rank 0). Returns whether all checks passed."""
    from .. import reparameterize_model

    cfg, data, model = result.config, result.data, result.model
    out = Path(cfg.output)
    device = result.dist_info.device
    notes: list[str] = []
    name = cfg.model
    input_size = (data.in_chans, data.img_size, data.img_size)
    # Rank 0 alone finishes the run: it needs the whole validation set, not its shard.
    val = copy.copy(data.val)
    val.rank, val.world = 0, 1
    # Recorded so that eval / convert of these files find the data without --data-dir.
    extra = {
        "dataset": cfg.dataset,
        "data_dir": str(Path(cfg.data_dir).resolve()) if cfg.data_dir else None,
        "classes": data.classes,
        "input_size": list(input_size),
    }

    # Float32 for the equivalence check: AMP rounding would hide (or fake) conversion errors.
    model = model.float().to(memory_format=torch.contiguous_format).eval()
    save_model(
        out / "model.safetensors",
        model,
        name=name,
        model_kwargs=result.model_kwargs,
        form="train",
        extra=extra,
    )
    log.info("evaluating the training-time model ...")
    ref_logits, labels = predict(model, val, device)
    train_acc = accuracy(ref_logits, labels)

    t = time.perf_counter()
    deployed = reparameterize_model(model.eval())
    convert_s = time.perf_counter() - t
    save_model(
        out / "deploy.safetensors",
        deployed,
        name=name,
        model_kwargs=result.model_kwargs,
        form="deploy",
        extra=extra,
    )
    # Check the file, not the in-memory object: a deploy=True model must load it strictly.
    deployed, _ = load_model(out / "deploy.safetensors", device=device, form="deploy")
    dep_logits, _ = predict(deployed, val, device)
    dep_acc = accuracy(dep_logits, labels)
    cmp = compare_logits(ref_logits, dep_logits)
    # No separate test on changed predictions: a flip moves two logits' difference by at least their
    # margin, so with every logit within max_abs_diff only pairs tied within 2 * max_abs_diff can flip.
    equivalent = cmp["max_rel_diff"] <= EQUIVALENCE_RTOL
    log.info(
        "top-1 %.2f%% (training-time) vs %.2f%% (converted); max |logit diff| %.2e (relative %.2e), "
        "%d predictions changed -> %s",
        train_acc["top1"],
        dep_acc["top1"],
        cmp["max_abs_diff"],
        cmp["max_rel_diff"],
        cmp["changed_predictions"],
        "equivalent" if equivalent else "NOT EQUIVALENT",
    )

    def run_bench():
        from ..bench import benchmark, render_markdown

        rows = benchmark({name: model}, input_size, bench_batch_size, device=device, warmup=3, repeats=10)
        return rows, render_markdown(rows)

    bench_out = _step("benchmark", run_bench, notes) if bench else None
    onnx_diff = None
    missing = _missing_export_packages() if export else []
    if missing:
        # Optional packages: the run itself succeeded, so a missing one skips the export, not the job.
        log.warning(
            "ONNX export skipped: %s not installed (pip install 'repmlp[export]')", ", ".join(missing)
        )
        notes.append(
            f"ONNX export skipped: {', '.join(missing)} not installed (pip install 'repmlp[export]')"
        )
    elif export:
        from ..export import export_onnx

        onnx_diff = _step(
            "ONNX export", lambda: export_onnx(deployed, out / "deploy.onnx", input_size), notes
        )

    def fc3():
        from ..viz import find_repmlp_blocks, plot_fc3

        if not find_repmlp_blocks(model):
            notes.append("FC3 figure skipped: the model has no RepMLP block")
            return None
        return plot_fc3(
            model, out / "fc3.png", title=f"{name}: FC3 before / after merging the Local Perceptron"
        )

    fc3_sample = _step("FC3 figure", fc3, notes)
    _step(
        "training curves",
        lambda: plot_curves(result.history, out / "curves.png", f"{name} on {cfg.dataset}"),
        notes,
    )
    total_s = time.perf_counter() - started
    report = _report(
        result,
        command,
        train_acc,
        dep_acc,
        cmp,
        equivalent,
        convert_s,
        bench_out,
        onnx_diff,
        fc3_sample,
        notes,
        total_s,
        device,
    )
    atomic_write_text(out / "report.md", report)
    log.info("run folder: %s (report.md); total %.0f s", out, total_s)
    replicas_ok = len(set(result.replica_hashes)) == 1
    return equivalent and replicas_ok and not any("failed" in n for n in notes)


def _report(
    result,
    command,
    train_acc,
    dep_acc,
    cmp,
    equivalent,
    convert_s,
    bench_out,
    onnx_diff,
    fc3_sample,
    notes,
    total_s,
    device,
) -> str:
    cfg = result.config
    h = result.history
    out = Path(cfg.output)
    lines = [
        f"# repmlp run: {cfg.model} on {cfg.dataset}",
        "",
        f"- Command: `{' '.join(command)}`",
        f"- Hardware: {hardware_summary(device)}"
        + (f"; {result.dist_info.world} processes (DDP)" if result.dist_info.enabled else ""),
        f"- Date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- Data: {result.data.train.num_samples} training / {result.data.val.num_samples} validation examples",
        f"- Recipe (preset `{cfg.preset}`): {cfg.epochs} epochs, batch {cfg.batch_size}, {cfg.optimizer} "
        f"lr {cfg.lr:g} ({cfg.schedule}, warm-up {cfg.warmup_epochs:g} epochs, to {cfg.min_lr:g}), momentum "
        f"{cfg.momentum:g}, weight decay {cfg.weight_decay:g}, label smoothing {cfg.label_smoothing:g}, mixup "
        f"{cfg.mixup:g}, crop padding {cfg.pad}, flip {cfg.flip}, autoaugment {cfg.autoaugment}, seed {cfg.seed}",
        f"- Model options: `{result.model_kwargs}`",
        f"- Replicas: {len(result.replica_hashes)} process(es), final weights sha256 "
        + ", ".join(f"rank {r}: `{h[:16]}`" for r, h in enumerate(result.replica_hashes))
        + (" (identical)" if len(set(result.replica_hashes)) == 1 else " (DIFFERENT)"),
        f"- Time: training {sum(r['epoch_s'] for r in h):.0f} s (this process: {result.train_seconds:.0f} s), "
        f"whole command {total_s:.0f} s",
        "",
        "## Accuracy",
        "",
        "| form | top-1 (%) | top-5 (%) |",
        "|---|---|---|",
        f"| training-time (`model.safetensors`) | {train_acc['top1']:.2f} | {train_acc['top5']:.2f} |",
        f"| converted (`deploy.safetensors`) | {dep_acc['top1']:.2f} | {dep_acc['top5']:.2f} |",
        "",
        f"Conversion ({convert_s:.2f} s): max |logit difference| {cmp['max_abs_diff']:.2e} "
        f"(relative {cmp['max_rel_diff']:.2e}), {cmp['changed_predictions']} of {train_acc['n']} predictions "
        f"changed: **{'equivalent' if equivalent else 'NOT equivalent'}** (tolerance {EQUIVALENCE_RTOL:g} relative).",
        "",
        "## Training curve",
        "",
        "![curves](curves.png)",
        "",
        "| epoch | lr | train loss | train acc (%) | val loss | val top-1 (%) | val top-5 (%) | time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in h:
        lines.append(
            f"| {r['epoch']} | {r['lr']:.4g} | {r['train_loss']:.4f} | {r['train_acc']:.2f} | {r['val_loss']:.4f} | "
            f"{r['val_top1']:.2f} | {r['val_top5']:.2f} | {r['epoch_s']:.0f} |"
        )
    lines += ["", "## Speed", ""]
    if bench_out:
        rows, table = bench_out
        lines += [
            f"Batch {rows[0].batch_size}, input {tuple(rows[0].input_size)}, {rows[0].device}:",
            "",
            table,
        ]
    else:
        lines.append("not measured")
    lines += ["", "## Files", ""]
    files = {
        "model.safetensors": "training-time weights (`repmlp eval --checkpoint`)",
        "deploy.safetensors": "converted weights, loads into `create_model(..., deploy=True)`",
        "deploy.onnx": "ONNX of the converted model"
        + (
            f" (onnxruntime max abs diff {onnx_diff:.2e})"
            if isinstance(onnx_diff, float) and math.isfinite(onnx_diff)
            else ""
        ),
        STATE_FILE: "training state for `--resume`",
        METRICS_FILE: "per-epoch metrics",
        "curves.png": "training curves",
        "fc3.png": "FC3 before / after merging the Local Perceptron"
        + (f" (block `{fc3_sample.block_name}`)" if getattr(fc3_sample, "block_name", None) else ""),
    }
    for f, what in files.items():
        if (out / f).exists():
            lines.append(f"- `{f}`: {what}")
    if (out / "fc3.png").exists():
        lines += ["", "![FC3](fc3.png)"]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
