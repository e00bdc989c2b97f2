"""The one training loop of every task (classification, face recognition, segmentation); it knows no task.

A task hands :func:`train_loop` its module (prepared by :func:`prepare_module`), an optimizer, its loader,
:class:`LoopOptions` and :class:`LoopHooks`: the step (forward and loss of one batch, plus statistics to sum
up), an optional end-of-epoch callback (classification evaluates there and returns its metrics row) and the
learning rate of every parameter group as a pure function of the step (so the "scheduler state" is the
step). A run counts epochs (classification) or iterations (face, segmentation). The engine runs the
processes (torchrun/DDP, only rank 0 writes), turns BatchNorms into ``SyncBatchNorm`` for multi-GPU runs,
runs AMP, writes ``checkpoint.safetensors`` every ``ckpt_every`` steps, after every epoch of an epoch-counted
run and at the end, continues a killed run bitwise with ``resume`` (model, optimizer, gradient scaler,
every process's python/numpy/torch/CUDA RNG states, position in the epoch's data order, the history and
the epoch's sums are restored; options that change the maths must be repeated, ``runtime_keys`` may
change), refuses to overwrite a finished run, shows a progress bar with the task's statistics, writes
``metrics.csv`` and checks that DDP replicas end identical. :func:`write_run_report` writes ``curves.png``
and ``report.md`` for tasks that log a loss (with the task's own report section).
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import os
import random
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from .errors import UserError

__all__ = [
    "DistInfo",
    "LoopOptions",
    "LoopHooks",
    "LoopResult",
    "Position",
    "loss_step",
    "check_resumable",
    "option_flag",
    "rng_state",
    "set_rng_state",
    "gather_object",
    "state_hash",
    "broadcast_buffers",
    "replica_hashes",
    "amp_dtype",
    "write_metrics_csv",
    "setup_distributed",
    "cleanup_distributed",
    "all_reduce_sum",
    "prepare_module",
    "unwrap",
    "progress",
    "check_output",
    "train_loop",
    "write_run_report",
    "STATE_FILE",
    "resolve_device",
    "build_model",
    "cpu_name",
    "hardware_summary",
    "optimizer_step",
    "run_in_processes",
]

log = logging.getLogger(__name__)

STATE_FILE = "checkpoint.safetensors"
METRICS_FILE = "metrics.csv"


def resolve_device(text: str) -> torch.device:
    """``--device`` -> ``torch.device`` (``auto``: CUDA when available); a device this machine lacks is a
    :class:`UserError`."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UserError(f"--device: unknown device {text!r} (use cpu, cuda, cuda:N, mps or auto)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {text}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {text}: Apple's MPS is not available on this machine")
    elif device.type not in ("cpu", "mps"):
        raise UserError(f"--device {text}: only cpu, cuda and mps are supported")
    return device


def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def hardware_summary(device: torch.device) -> str:
    """One line naming the processor (or GPU), core count, threads and library versions."""
    import platform

    if device.type == "cuda":
        hw = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        hw = cpu_name() + f", {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{hw}; torch {torch.__version__}, Python {platform.python_version()}"


def build_model(
    name: str,
    model_args: dict[str, Any] | None = None,
    *,
    num_classes: int | None = None,
    in_chans: int | None = None,
    img_size: int | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """``create_model(name, **model_args)`` sized for the data; returns ``(model, kwargs used)``.

    ``img_size`` is passed only to models built for one input size (:func:`takes_img_size`); other CNNs
    take any size. An unknown name or an option the model rejects (``ValueError``/``TypeError`` from its
    constructor) is a :class:`UserError`; any other exception is a bug and propagates with its traceback.
    """
    from .models import create_model

    kwargs = dict(model_args or {})
    kwargs.update({k: v for k, v in (("num_classes", num_classes), ("in_chans", in_chans)) if v is not None})
    if img_size is not None and takes_img_size(name):
        kwargs = {"img_size": img_size, **kwargs}
    try:
        return create_model(name, **kwargs), kwargs
    except (TypeError, ValueError) as exc:
        first = str(exc).strip("'\" \n").splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot build model {name!r}: {first}") from exc


def takes_img_size(name: str) -> bool:
    """Whether model ``name`` is built for one input size: every repmlp model (FC3 and the partitions
    depend on it), and timm models whose config says ``fixed_input_size`` (vision transformers...)."""
    from .models import is_model

    source, _, bare = name.rpartition(":")
    if source in ("", "repmlp") and is_model(bare):
        return True
    if source in ("", "timm"):
        import timm

        if timm.is_model(bare):
            cfg = timm.models.get_pretrained_cfg(bare)
            return bool(cfg is not None and getattr(cfg, "fixed_input_size", False))
    return False


@dataclass
class DistInfo:
    """This process's place in a (possibly single-process) run: ``rank`` of ``world``, its device."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def setup_distributed(device_name: str) -> DistInfo:
    """Join the process group when started by ``torchrun`` (``WORLD_SIZE`` > 1): NCCL on GPU, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(device_name)
    if world <= 1:
        return DistInfo(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank, world, local_rank, device)


def cleanup_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_in_processes(args, body: Callable[[Any, DistInfo], None]) -> int:
    """``body(args, procs)`` with ``--threads`` applied, in the torchrun process group when there is one
    (left again whatever happens). Returns exit status 0."""
    if args.threads:
        torch.set_num_threads(args.threads)
    procs = setup_distributed(args.device)
    try:
        body(args, procs)
        return 0
    finally:
        cleanup_distributed()


def all_reduce_sum(t: torch.Tensor, procs: DistInfo) -> torch.Tensor:
    """Sum ``t`` over processes (identity for one process)."""
    if procs.enabled:
        t = t.clone()
        dist.all_reduce(t)
    return t


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def prepare_module(module: nn.Module, procs: DistInfo) -> nn.Module:
    """``module`` on the run's device; for multi-GPU runs with ``SyncBatchNorm`` and wrapped in DDP.

    SyncBatchNorm because the paper's per-GPU batches are small (2 images for PSPNet): BatchNorm needs
    the global batch. The converted model takes it (``reparameterize_model`` folds any BatchNorm).
    """
    module = module.to(procs.device)
    if not procs.enabled:
        return module
    if procs.device.type == "cuda":
        module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
    ids = [procs.device.index] if procs.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(module, device_ids=ids)


def progress(iterable, total: int, desc: str, enabled: bool, initial: int = 0) -> Any:
    """tqdm progress bar on the main process only; use it in a ``with`` so that an error clears it."""
    from tqdm import tqdm

    # disable=None: off where stderr is not a terminal (log files), as for every bar of the project.
    return tqdm(
        iterable, total=total, initial=initial, desc=desc, disable=None if enabled else True, leave=False
    )


LOSS_FIELDS = ("iteration", "epoch", "loss", "lr", "seconds")


@dataclass
class Position:
    """Where a run stands (saved in the checkpoint): ``step`` optimizer steps done in all, ``batch`` of
    them in epoch ``epoch`` (0-based); the history so far; the sums of the task's step statistics over
    this epoch (``epoch_acc``, with its training ``seconds``) and since the last loss log line (``window``)."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    epoch_acc: dict[str, float] = field(default_factory=dict)
    window: dict[str, float] = field(default_factory=dict)


def loss_step(
    net: nn.Module, images: Tensor, labels: Tensor, pos: Position
) -> tuple[Tensor, dict[str, float]]:
    """The step of a module that computes its own loss (``net(images, labels)`` -> scalar): the loss, and
    as statistics the loss per step (``n`` counts steps)."""
    loss = net(images, labels).float()
    return loss, {"loss": float(loss.detach()), "n": 1.0}


@dataclass
class LoopHooks:
    """What a task plugs into :func:`train_loop`.

    - ``step(net, images, labels, pos) -> (loss, stats)``: the forward pass and loss of one batch, run
      under autocast; ``stats`` are sums over the batch (``n``: how many things were summed) that the
      engine adds up per epoch and per log interval and shows in the progress bar as means.
    - ``end_epoch(pos) -> row or None``: called when an epoch's batches are used up, before the position
      moves on (``pos.epoch_acc`` holds the epoch's sums); a returned row is appended to the history.
    """

    step: Callable[[nn.Module, Tensor, Tensor, Position], tuple[Tensor, dict[str, float]]] = loss_step
    end_epoch: Callable[[Position], dict[str, Any] | None] | None = None


@dataclass
class LoopOptions:
    """What the engine needs to know of a run besides its module, optimizer, data and hooks.

    A run counts either ``epochs`` (classification: a checkpoint after every epoch; the run ends with an
    epoch) or ``iterations`` (face, segmentation: the run may end inside an epoch); give one of the two.
    """

    output: Path
    config: dict[str, Any]  # JSON-able; saved; a resume must repeat every key but the runtime_keys
    lr_at: Callable[[int], list[float]]  # learning rate of each parameter group at a 0-based step
    iterations: int | None = None
    epochs: int | None = None
    ckpt_every: int = 0
    log_interval: int = 0  # append the mean step statistics to the history every N steps (0: never)
    amp: bool = False
    runtime_keys: Collection[str] = ()  # config keys that do not change the maths (device, workers, ...)
    stop_after_steps: int | None = None  # a simulated crash (tests of --resume): exit 3 after N steps
    extra_state: dict[str, Any] = field(default_factory=dict)  # saved into the checkpoint as it is
    metric_fields: Sequence[str] = LOSS_FIELDS  # the columns of metrics.csv

    def __post_init__(self) -> None:
        if (self.iterations is None) == (self.epochs is None):
            raise ValueError("LoopOptions needs exactly one of iterations and epochs")

    def total_steps(self, steps_per_epoch: int) -> int:
        return self.iterations if self.epochs is None else self.epochs * steps_per_epoch


@dataclass
class LoopResult:
    history: list[dict[str, Any]]
    seconds: float  # training time of this process (this invocation)
    replica_hashes: list[str]  # every process's state_hash of the final model, in rank order


def check_output(out: Path, resume: bool, procs: DistInfo) -> dict[str, Any] | None:
    """The saved state to resume from (``None`` for a new run); refuses to overwrite a run in ``out``."""
    from .checkpoint import load_state

    state_path = out / STATE_FILE
    if resume:
        if not state_path.is_file():
            raise UserError(f"nothing to resume: {state_path} does not exist")
        return load_state(state_path)
    if procs.is_main and (state_path.exists() or (out / "model.safetensors").exists()):
        raise UserError(f"{out} already holds a run; use --resume to continue it or another --output")
    return None


def option_flag(key: str) -> str:
    """A config key's command-line spelling (``model_args`` -> ``--model-arg``, ``lr_steps`` -> ``--lr-steps``)."""
    return "--model-arg" if key in ("model_args", "model_arg") else "--" + key.replace("_", "-")


def check_resumable(
    saved: dict[str, Any],
    config: dict[str, Any],
    where: Path,
    *,
    runtime: Collection[str] = (),
    given: Collection[str] | None = None,
    hint: str = "repeat the run's options, or train into another --output",
) -> dict[str, Any]:
    """The configuration a resumed run continues with: ``saved``, with ``config``'s runtime options.

    ``given`` names the keys the user set (``None``: all of ``config``). Those outside ``runtime`` (they
    change the maths) must equal the saved values, else the checkpoint belongs to another model or recipe
    and resuming would silently train something else: :class:`UserError`. Given runtime keys (device,
    workers, data folder, ...) replace the saved values; the others keep them.
    """
    keys = set(config) if given is None else set(given)
    conflicts = [
        f"{option_flag(k)} {saved[k]!r}, not {config[k]!r}"
        for k in sorted(keys)
        if k not in runtime and k in saved and k in config and saved[k] != config[k]
    ]
    if conflicts:
        raise UserError(
            f"cannot resume {where}: its checkpoint was trained with {'; '.join(conflicts[:4])}"
            f"{' ...' if len(conflicts) > 4 else ''} ({hint})"
        )
    return {**saved, **{k: config[k] for k in runtime if k in keys and k in config}}


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch (CPU) and, on a GPU, CUDA."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Inverse of :func:`rng_state` (after a round trip through a state file: tuples came back as lists)."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def gather_object(obj: Any, procs: DistInfo) -> list[Any]:
    """``obj`` of every process, in rank order (``[obj]`` for one process); every process must call it."""
    if not procs.enabled:
        return [obj]
    gathered: list[Any] = [None] * procs.world
    dist.all_gather_object(gathered, obj)
    return gathered


def state_hash(model: nn.Module) -> str:
    """SHA-256 of a model's parameters and buffers (bitwise), to compare replicas or runs."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def broadcast_buffers(model: nn.Module, procs: DistInfo) -> None:
    """Make every replica's BatchNorm statistics rank 0's (DDP syncs parameters, not running stats)."""
    if procs.enabled:
        for b in model.buffers():
            dist.broadcast(b.data, src=0)


def replica_hashes(model: nn.Module, procs: DistInfo) -> list[str]:
    """Every process's :func:`state_hash` of ``model`` (rank order), logged: the check that DDP kept the
    processes in step (after :func:`broadcast_buffers`)."""
    broadcast_buffers(model, procs)
    hashes = gather_object(state_hash(model), procs)
    if len(set(hashes)) != 1:
        log.error("replicas differ after training: %s", hashes)
    elif procs.enabled and procs.is_main:
        log.info("final weights identical on all %d processes (sha256 %s)", procs.world, hashes[0][:16])
    return hashes


def amp_dtype(device: torch.device) -> torch.dtype:
    """The autocast dtype: bfloat16, or float16 on GPUs without bfloat16 (which then need a GradScaler)."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def optimizer_step(loss: torch.Tensor, optimizer, scaler: torch.amp.GradScaler, step: int) -> None:
    """Backward and one (gradient-scaled) optimizer step; a non-finite loss is a :class:`UserError`."""
    if not torch.isfinite(loss):
        raise UserError(f"the loss became {loss.item()} at step {step} (try a smaller --lr)")
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def train_loop(
    net: nn.Module,
    optimizer,
    loader,
    opts: LoopOptions,
    procs: DistInfo,
    state: dict[str, Any] | None = None,
    hooks: LoopHooks | None = None,
) -> LoopResult:
    """Train ``net`` (prepared by :func:`prepare_module`) over ``loader`` (``loader.batches(epoch, start)``
    yields this process's ``(images, labels)`` of an epoch from batch ``start``; ``len(loader)`` batches an
    epoch) per ``opts``, with the task's ``hooks``; continue from ``state`` (:func:`check_output`) if given.

    Every step: learning rates from ``opts.lr_at``, the task's step under autocast, :func:`optimizer_step`.
    Checkpoints every ``ckpt_every`` steps, after every epoch of an epoch-counted run and at the end (every
    process's RNG states included); ``metrics.csv`` holds the history.
    """
    return _Loop(net, optimizer, loader, opts, procs, hooks or LoopHooks()).run(state)


class _Loop:
    """One run of :func:`train_loop`: the objects it trains and where it stands."""

    def __init__(
        self, net: nn.Module, optimizer, loader, opts: LoopOptions, procs: DistInfo, hooks: LoopHooks
    ):
        self.net, self.optimizer, self.loader = net, optimizer, loader
        self.opts, self.procs, self.hooks = opts, procs, hooks
        fp16 = opts.amp and amp_dtype(procs.device) == torch.float16
        self.scaler = torch.amp.GradScaler(procs.device.type, enabled=fp16)
        self.steps_per_epoch = len(loader)
        self.total = opts.total_steps(self.steps_per_epoch)
        self.path = opts.output / STATE_FILE
        self.pos = Position()
        self.saved_at = -1  # the step of the last checkpoint
        self.bar: Any = None
        self.start = self.mark = 0.0  # the run's start; the start of this epoch's unrecorded time

    def run(self, state: dict[str, Any] | None) -> LoopResult:
        if state is not None:
            self.restore(state)
        if self.procs.is_main:
            self.opts.output.mkdir(parents=True, exist_ok=True)
        self.start = time.perf_counter()
        with progress(None, self.total, "train", self.procs.is_main, initial=self.pos.step) as self.bar:
            while self.pos.step < self.total and self.epoch():
                pass
        seconds = time.perf_counter() - self.start
        if self.saved_at != self.pos.step:
            self.save()
        self.write_metrics()  # again: a run killed between its last checkpoint and this file resumes here
        return LoopResult(self.pos.history, seconds, replica_hashes(unwrap(self.net), self.procs))

    def epoch(self) -> bool:
        """Train the rest of the current epoch; returns ``False`` if the run ended inside it."""
        pos, epochs = self.pos, self.opts.epochs
        self.bar.set_description(f"epoch {pos.epoch + 1}" + (f"/{epochs}" if epochs else ""), refresh=False)
        self.net.train()
        self.mark = time.perf_counter()
        for images, labels in self.loader.batches(pos.epoch, pos.batch):
            lr = self.step(images, labels)
            self.after_step(lr)
            if pos.step >= self.total and pos.batch < self.steps_per_epoch:
                self.add_seconds()
                return False
        self.add_seconds()
        self.end_epoch()
        return True

    def step(self, images: Tensor, labels: Tensor) -> float:
        """One optimizer step at ``pos.step``'s learning rates; adds up the task's statistics."""
        pos = self.pos
        lrs = self.opts.lr_at(pos.step)
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        device = images.device
        with torch.autocast(device.type, dtype=amp_dtype(device), enabled=self.opts.amp):
            loss, stats = self.hooks.step(self.net, images, labels, pos)
        optimizer_step(loss.float(), self.optimizer, self.scaler, pos.step)
        pos.step, pos.batch = pos.step + 1, pos.batch + 1
        for sums in (pos.epoch_acc, pos.window):
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
        return lrs[0]

    def after_step(self, lr: float) -> None:
        """Progress bar, loss log, checkpoint, simulated crash."""
        pos, opts = self.pos, self.opts
        self.bar.update(1)
        if self.procs.is_main:
            n = max(1.0, pos.epoch_acc.get("n", 1.0))
            means = {k: f"{v / n:.4g}" for k, v in pos.epoch_acc.items() if k != "n"}
            self.bar.set_postfix(**means, lr=f"{lr:.3g}", refresh=False)
        if opts.log_interval and (pos.step % opts.log_interval == 0 or pos.step == self.total):
            self.log_window()
        epoch_end = opts.epochs is not None and pos.batch == self.steps_per_epoch  # saved after end_epoch
        if opts.ckpt_every and pos.step % opts.ckpt_every == 0 and pos.step < self.total and not epoch_end:
            self.add_seconds()
            self.save()
        if opts.stop_after_steps and pos.step >= opts.stop_after_steps:
            self.bar.close()
            log.warning("--stop-after-steps %d reached: exiting without cleanup", opts.stop_after_steps)
            logging.shutdown()
            os._exit(3)  # a simulated crash (tests of --resume): no cleanup, no final checkpoint

    def add_seconds(self) -> None:
        now = time.perf_counter()
        self.pos.epoch_acc["seconds"] = self.pos.epoch_acc.get("seconds", 0.0) + now - self.mark
        self.mark = now

    def end_epoch(self) -> None:
        """The task's end-of-epoch hook, then the next epoch; checkpoint after each epoch if counting them."""
        pos = self.pos
        row = self.hooks.end_epoch(pos) if self.hooks.end_epoch is not None else None
        if row is not None:
            pos.history.append(row)
        pos.epoch, pos.batch, pos.epoch_acc = pos.epoch + 1, 0, {}
        if self.opts.epochs is not None:
            self.save()
            self.write_metrics()

    def log_window(self) -> None:
        """Append the mean statistics since the last log line, over all processes, to the history."""
        pos, procs = self.pos, self.procs
        keys = sorted(k for k in pos.window if k != "n")
        sums = torch.tensor([pos.window[k] for k in keys] + [pos.window.get("n", 1.0)], dtype=torch.float64)
        total = all_reduce_sum(sums.to(procs.device), procs).cpu()
        entry = {"iteration": pos.step, "epoch": pos.epoch}
        entry.update({k: float(total[i] / total[-1]) for i, k in enumerate(keys)})
        entry.update({"lr": self.opts.lr_at(pos.step - 1)[0], "seconds": time.perf_counter() - self.start})
        pos.history.append(entry)
        pos.window = {}
        if procs.is_main:
            stats = "  ".join(f"{k} {entry[k]:.4f}" for k in keys)
            log.info("epoch %d iter %d/%d  %s  lr %.2e", pos.epoch, pos.step, self.total, stats, entry["lr"])

    def save(self) -> None:
        """``checkpoint.safetensors``: everything a resume needs (rank 0 writes; every process's RNG)."""
        from .checkpoint import save_state

        rngs = gather_object(rng_state(self.procs.device), self.procs)
        self.saved_at = self.pos.step
        if not self.procs.is_main:
            return
        state = {
            **self.opts.extra_state,
            "config": self.opts.config,
            "model": unwrap(self.net).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            **vars(self.pos),
            "rng": {str(r): s for r, s in enumerate(rngs)},
        }
        save_state(self.path, state)

    def restore(self, state: dict[str, Any]) -> None:
        from .files import CheckpointError

        opts, procs = self.opts, self.procs
        check_resumable(state.get("config", {}), opts.config, opts.output, runtime=opts.runtime_keys)
        try:
            unwrap(self.net).load_state_dict(state["model"], strict=True)
            self.optimizer.load_state_dict(state["optimizer"])
            if state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            self.pos = Position(
                step=int(state["step"]),
                epoch=int(state["epoch"]),
                batch=int(state["batch"]),
                history=list(state["history"]),
                epoch_acc=dict(state["epoch_acc"]),
                window=dict(state.get("window", {})),
            )
            rngs = state["rng"]
            set_rng_state(rngs[str(procs.rank)] if str(procs.rank) in rngs else rngs["0"], procs.device)
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{self.path} does not fit this run: {str(exc).splitlines()[0]}") from None
        self.saved_at = self.pos.step
        if procs.is_main:
            pos = self.pos
            log.info(
                "resuming %s at epoch %d, batch %d (step %d)", opts.output, pos.epoch + 1, pos.batch, pos.step
            )

    def write_metrics(self) -> None:
        if self.procs.is_main:
            write_metrics_csv(self.opts.output / METRICS_FILE, self.pos.history, self.opts.metric_fields)


def write_metrics_csv(path: Path, history: list[dict[str, Any]], fields: Sequence[str] = LOSS_FIELDS) -> None:
    """The history as CSV (floats to 6 significant digits), written atomically."""
    from .checkpoint import atomic_write_text

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    atomic_write_text(path, buf.getvalue())


def write_run_report(out: Path, title: str, history: list[dict[str, Any]], section: list[str]) -> None:
    """``curves.png`` (loss against iteration) and ``report.md`` of a run with a loss log (the loop wrote
    ``metrics.csv``): the task's own ``section`` (markdown lines), then the loss log."""
    from .checkpoint import atomic_write_text

    curves = _plot_loss(history, out / "curves.png", title)
    lines = [f"# {title}", "", *section, "", "## Training loss", ""]
    if curves:
        lines += ["![curves](curves.png)", ""]
    lines += ["| iteration | epoch | loss | lr |", "|---|---|---|---|"]
    lines += [f"| {r['iteration']} | {r['epoch']} | {r['loss']:.4f} | {r['lr']:.4g} |" for r in history]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")


def _plot_loss(history: list[dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: curves.png skipped")
        return False
    from .checkpoint import atomic_write_bytes

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["iteration"] for r in history], [r["loss"] for r in history], "o-")
    ax.set(xlabel="iteration", ylabel="training loss", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return True
