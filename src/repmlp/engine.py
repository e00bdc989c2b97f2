"""The iteration-counted training loop the face and segmentation tasks share; it knows nothing of a task.

A task hands :func:`train_loop` a module whose ``forward(images, labels)`` returns the loss, an optimizer,
the learning rate of every parameter group as a pure function of the step (so the "scheduler state" is
the step), and its loader. The engine runs the processes (torchrun/DDP, only rank 0 writes), turns
BatchNorms into ``SyncBatchNorm`` for multi-GPU runs, runs AMP, writes ``checkpoint.safetensors`` every
``ckpt_every`` steps and at the end, continues a killed run bitwise with ``resume`` (model, optimizer,
gradient scaler, RNG, position in the epoch's data order and the loss log are restored), refuses to
overwrite a finished run, shows a progress bar and writes ``metrics.csv``, ``curves.png`` and
``report.md`` (with the task's own report section).
"""

from __future__ import annotations

import csv
import io
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import UserError

__all__ = [
    "DistInfo",
    "LoopOptions",
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
    "optimizer_step",
    "run_in_processes",
]

log = logging.getLogger(__name__)

STATE_FILE = "checkpoint.safetensors"
METRICS_FILE = "metrics.csv"
# Set by tests to simulate a crash after N optimizer steps (no cleanup, no final checkpoint).
STOP_ENV = "REPMLP_STOP_AFTER_STEPS"


def resolve_device(text: str) -> torch.device:
    """``--device`` -> ``torch.device`` (``auto``: CUDA when available); a device this machine lacks is a
    :class:`UserError`."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UserError(f"--device: unknown device {text!r} (use cpu, cuda, cuda:N or auto)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {text}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type not in ("cpu", "mps"):
        raise UserError(f"--device {text}: only cpu and cuda are supported")
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


def build_model(
    name: str,
    model_args: dict[str, Any] | None = None,
    *,
    num_classes: int | None = None,
    in_chans: int | None = None,
    img_size: int | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """``create_model(name, **model_args)`` sized for the data; returns ``(model, kwargs used)``.

    ``img_size`` is passed only to models that take it (repmlp's do; most timm/torchvision CNNs take any
    input size without it). An unknown name or a bad option is a :class:`UserError`.
    """
    from .models import create_model

    kwargs = dict(model_args or {})
    kwargs.update({k: v for k, v in (("num_classes", num_classes), ("in_chans", in_chans)) if v is not None})
    attempts = [{"img_size": img_size, **kwargs}, kwargs] if img_size is not None else [kwargs]
    for i, attempt in enumerate(attempts):
        try:
            return create_model(name, **attempt), attempt
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - unknown name / bad kwargs surface as many types
            if isinstance(exc, TypeError) and "img_size" in str(exc) and i + 1 < len(attempts):
                continue  # the model does not take img_size: retry without it
            first = str(exc).strip("'\" \n").splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"cannot build model {name!r}: {first}") from None
    raise AssertionError("unreachable")


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

    return tqdm(iterable, total=total, initial=initial, desc=desc, disable=not enabled, leave=False)


@dataclass
class LoopOptions:
    """What the engine needs to know of a run besides its module, optimizer and data."""

    output: Path
    iterations: int
    config: dict[str, Any]  # the options that change the maths: a resume must repeat them
    ckpt_every: int = 0
    log_interval: int = 20
    resume: bool = False
    amp: bool = False
    lr_at: Callable[[int], list[float]] = field(default=lambda step: [])


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


def _check_resumable(state: dict[str, Any], opts: LoopOptions) -> None:
    saved = state.get("config", {})
    diff = [f"{k}={saved.get(k)!r}, not {v!r}" for k, v in sorted(opts.config.items()) if saved.get(k) != v]
    if diff:
        raise UserError(
            f"cannot resume {opts.output}: it was trained with {'; '.join(diff[:4])}"
            f"{' ...' if len(diff) > 4 else ''} (repeat the run's options, or train into another --output)"
        )


@dataclass
class _Position:
    step: int = 0
    epoch: int = 0
    batch: int = 0  # batches of this epoch already used
    history: list[dict[str, float]] = field(default_factory=list)
    running: list[float] = field(default_factory=lambda: [0.0, 0.0])  # sum of losses, count


def _save(path: Path, net: nn.Module, optimizer, scaler, pos: _Position, opts: LoopOptions, procs) -> None:
    from .checkpoint import save_state

    if not procs.is_main:
        return
    state = {
        "config": opts.config,
        "model": unwrap(net).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler.is_enabled() else {},
        "position": {k: v for k, v in vars(pos).items()},
        "rng": {"torch": torch.get_rng_state()},
    }
    if procs.device.type == "cuda":
        state["rng"]["cuda"] = torch.cuda.get_rng_state(procs.device)
    save_state(path, state)


def _restore(state: dict[str, Any], net: nn.Module, optimizer, scaler, opts: LoopOptions, procs) -> _Position:
    from .checkpoint import CheckpointError

    _check_resumable(state, opts)
    try:
        unwrap(net).load_state_dict(state["model"], strict=True)
        optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        pos = _Position(**state["position"])
        torch.set_rng_state(state["rng"]["torch"])
        if procs.device.type == "cuda" and "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"], procs.device)
    except (KeyError, RuntimeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{opts.output / STATE_FILE} does not fit this run: {exc}") from None
    if procs.is_main:
        log.info("resuming %s at iteration %d (epoch %d)", opts.output, pos.step, pos.epoch)
    return pos


def amp_dtype(device: torch.device) -> torch.dtype:
    """The autocast dtype: bfloat16, or float16 on GPUs without bfloat16 (which then need a GradScaler)."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def train_loop(net: nn.Module, optimizer, loader, opts: LoopOptions, procs: DistInfo, state=None) -> list:
    """Train ``net`` (``net(images, labels)`` -> loss) for ``opts.iterations`` steps over as many epochs
    of ``loader`` as that takes; continue from ``state`` (:func:`check_output`) if given.

    Returns the log: the mean loss over all processes every ``log_interval`` steps, with the learning
    rate of the first parameter group.
    """
    scaler = torch.amp.GradScaler(
        procs.device.type, enabled=opts.amp and amp_dtype(procs.device) == torch.float16
    )
    pos = _restore(state, net, optimizer, scaler, opts, procs) if state is not None else _Position()
    if procs.is_main:
        opts.output.mkdir(parents=True, exist_ok=True)
    path = opts.output / STATE_FILE
    stop = int(os.environ.get(STOP_ENV, "0"))
    net.train()
    start = time.perf_counter()
    with progress(None, opts.iterations, "train", procs.is_main, initial=pos.step) as bar:
        while pos.step < opts.iterations:
            for images, labels in loader.batches(pos.epoch, pos.batch):
                loss = _step(net, optimizer, scaler, images, labels, opts, pos)
                pos.step, pos.batch = pos.step + 1, pos.batch + 1
                bar.update(1)
                pos.running = [pos.running[0] + float(loss), pos.running[1] + 1]
                if pos.step % opts.log_interval == 0 or pos.step == opts.iterations:
                    _log(pos, opts, procs, time.perf_counter() - start)
                if opts.ckpt_every and pos.step % opts.ckpt_every == 0 and pos.step < opts.iterations:
                    _save(path, net, optimizer, scaler, pos, opts, procs)
                if stop and pos.step >= stop:
                    bar.close()
                    logging.shutdown()
                    os._exit(3)  # a simulated crash (tests of --resume): no cleanup, no final checkpoint
                if pos.step >= opts.iterations:
                    break
            else:
                pos.epoch, pos.batch = pos.epoch + 1, 0
    _save(path, net, optimizer, scaler, pos, opts, procs)
    return pos.history


def _step(net, optimizer, scaler, images, labels, opts: LoopOptions, pos: _Position) -> torch.Tensor:
    """One optimizer step at ``pos.step``'s learning rate; returns the (detached) loss."""
    for group, lr in zip(optimizer.param_groups, opts.lr_at(pos.step), strict=True):
        group["lr"] = lr
    device = images.device
    with torch.autocast(device.type, dtype=amp_dtype(device), enabled=opts.amp):
        loss = net(images, labels).float()
    optimizer_step(loss, optimizer, scaler, pos.step)
    return loss.detach()


def optimizer_step(loss: torch.Tensor, optimizer, scaler: torch.amp.GradScaler, step: int) -> None:
    """Backward and one (gradient-scaled) optimizer step; a non-finite loss is a :class:`UserError`."""
    if not torch.isfinite(loss):
        raise UserError(f"the loss became {loss.item()} at step {step} (try a smaller --lr)")
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def _log(pos: _Position, opts: LoopOptions, procs: DistInfo, seconds: float) -> None:
    total = all_reduce_sum(torch.tensor(pos.running, dtype=torch.float64, device=procs.device), procs)
    entry = {
        "iteration": pos.step,
        "epoch": pos.epoch,
        "loss": float(total[0] / total[1]),
        "lr": opts.lr_at(pos.step - 1)[0],
        "seconds": seconds,
    }
    pos.history.append(entry)
    pos.running = [0.0, 0.0]
    if procs.is_main:
        log.info(
            "epoch %d iter %d/%d  loss %.4f  lr %.2e",
            pos.epoch,
            pos.step,
            opts.iterations,
            entry["loss"],
            entry["lr"],
        )


def write_run_report(out: Path, title: str, history: list[dict[str, Any]], section: list[str]) -> None:
    """``metrics.csv`` (the loss log), ``curves.png`` (loss against iteration) and ``report.md``: the
    run's options and the loss log, then the task's own ``section`` (markdown lines)."""
    from .checkpoint import atomic_write_text

    buf = io.StringIO()
    fields = ["iteration", "epoch", "loss", "lr", "seconds"]
    writer = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    atomic_write_text(out / METRICS_FILE, buf.getvalue())
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
