"""What a classification run takes and returns (paper Sec. 4.1-4.2): :class:`TrainConfig`, :class:`EvalConfig`
and :class:`TrainResult`, below both :mod:`.classification` (which trains and evaluates) and
:mod:`.classification_report` (which ends a run), so that neither imports the other's types."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from repmlp.data import Data
from repmlp.engine import DistInfo
from repmlp.io.model_file import CheckpointError, check_field
from repmlp.tasks.config import EvalOptions, TrainOptions
from repmlp.tasks.recipes import PRESETS

__all__ = ["TrainConfig", "EvalConfig", "TrainResult"]

_DEFAULT = PRESETS["fmnist"]  # the main job's recipe: TrainConfig's defaults


@dataclass(kw_only=True)
class TrainConfig(TrainOptions):
    """Every option of a classification run; the defaults are the ``fmnist`` preset, the main job's recipe."""

    dataset: str = "fashion-mnist"
    download: bool = False
    preset: str = "fmnist"
    model: str = _DEFAULT.model
    epochs: int = _DEFAULT.epochs
    batch_size: int = _DEFAULT.batch_size
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
    val_limit: int | None = None
    channels_last: bool | None = _DEFAULT.channels_last  # None: on for CUDA
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

    RUNTIME = TrainOptions.RUNTIME | {"download", "eval_batch_size", "no_export", "no_bench", "bench_batch_size",
                                      "run_command", "resumed_with"}  # fmt: skip

    def rules(self) -> Iterator[tuple[str, str]]:
        """``--min-lr`` at most ``--lr``; the images' channels (1 or 3) and normalisation (an ``--init`` file's,
        kept by the run): mean and std together, as a model file's (a std far enough from 0 to divide by)."""
        if self.min_lr > self.lr:
            yield "min_lr", f"--min-lr must be at most --lr ({self.lr:g}), got {self.min_lr:g}"
        origin = f" (from --init {self.init})" if self.init else ""
        if self.channels not in (None, 1, 3):
            yield "channels", f"the images' channels must be 1 or 3, got {self.channels}{origin}"
        own = {k: v for k, v in (("mean", self.mean), ("std", self.std)) if v is not None} or None
        for name, value in (("mean", own), ("eval_preprocessing", self.eval_preprocessing)):
            if value is not None and set(value) & {"mean", "std"} != {"mean", "std"}:
                yield name, f"the images' normalisation needs both mean and std{origin}"
            try:
                check_field("the images' normalisation", "extra.eval_preprocessing", value or None, name)
            except CheckpointError as exc:
                yield name, f"{exc}{origin}"
            if any(isinstance((value or {}).get(k), list) and len(value[k]) > 3 for k in ("mean", "std")):
                yield name, f"the images' normalisation has more values than channels{origin}"


@dataclass
class TrainResult:
    """What :func:`repmlp.tasks.classification.train` returns."""

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
    ok: bool = True  # the end of the run's checks passed (repmlp.tasks.classification_report.finish_run)


@dataclass(kw_only=True)
class EvalConfig(EvalOptions):
    """``repmlp eval``: a model file and the data set to score it on (by default the file's)."""

    dataset: str | None = None
    data_dir: str | None = None
    download: bool = False
    val_limit: int | None = None
    img_size: int | None = None
    batch_size: int = 512
