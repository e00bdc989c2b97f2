"""The one training loop of every task (:func:`train_loop`), its options, hooks and position, and the CUDA
graphs of a training step (:func:`graph_module`)."""

from __future__ import annotations

import logging
import math
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn
from tqdm import tqdm

from repmlp.engine.devices import amp_dtype
from repmlp.engine.processes import (
    DistInfo,
    all_reduce_sum,
    gather_object,
    replica_hashes,
    restart_count,
    unwrap,
)
from repmlp.engine.report import LOSS_FIELDS, write_metrics_csv
from repmlp.engine.state import (
    METRICS_FILE,
    STATE_FILE,
    check_resumable,
    check_state,
    lock_output,
    rng_state,
    set_rng_state,
)
from repmlp.errors import UserError, first_line
from repmlp.io import state as state_file
from repmlp.io.model_file import CheckpointError

log = logging.getLogger(__name__)

# Without a terminal (a log file, CI, a notebook) the training bar is off; the loop logs a progress line after
# each epoch's first step and then at most every PROGRESS_SECONDS, as timm's and Lightning's loggers do.
PROGRESS_SECONDS = 30.0


def progress(iterable, total: int, desc: str, enabled: bool, initial: int = 0) -> Any:
    """tqdm progress bar on the main process only (and where stderr is a terminal: ``disable=None``); use it
    in a ``with`` so that an error clears it."""
    return tqdm(
        iterable, total=total, initial=initial, desc=desc, disable=None if enabled else True, leave=False
    )


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


def loss_step(net: nn.Module, images: Tensor, labels: Tensor,
              pos: Position) -> tuple[Tensor, dict[str, float]]:  # fmt: skip
    """The step of a module that computes its own loss (``net(images, labels)`` -> scalar): the loss, and
    as statistics the loss per step (``n`` counts steps)."""
    loss = net(images, labels).float()
    return loss, {"loss": float(loss.detach()), "n": 1.0}


@dataclass
class LoopHooks:
    """What a task plugs into :func:`train_loop`: ``step(net, images, labels, pos) -> (loss, stats)``, the
    forward pass and loss of one batch under autocast, ``stats`` sums over the batch (``n``: how many) that
    the engine adds up per epoch and log interval; ``end_epoch(pos) -> row or None`` when an epoch's batches
    are used up (``pos.epoch_acc``: its sums), a row for the history; a NaN/inf number in it (weights can be
    finite and still overflow) is :class:`Diverged`, with no checkpoint of it."""

    step: Callable[[nn.Module, Tensor, Tensor, Position], tuple[Tensor, dict[str, float]]] = loss_step
    end_epoch: Callable[[Position], dict[str, Any] | None] | None = None


@dataclass
class LoopOptions:
    """What the engine needs to know of a run besides its module, optimizer, data and hooks. A run counts
    either ``epochs`` (a checkpoint after every epoch; it ends with an epoch) or ``iterations`` (it may end
    inside an epoch): exactly one of the two."""

    output: Path
    config: dict[str, Any]  # JSON-able; saved; a resume must repeat every key but the runtime_keys
    lr_at: Callable[[int], list[float]]  # learning rate of each parameter group at a 0-based step
    iterations: int | None = None
    epochs: int | None = None
    ckpt_every: int = 0
    log_interval: int = 0  # append the mean step statistics to the history every N steps (0: never)
    amp: bool = False
    runtime_keys: Collection[str] = ()  # config keys that do not change the maths (device, workers, ...)
    extra_state: dict[str, Any] = field(default_factory=dict)  # saved into the checkpoint as it is
    metric_fields: Sequence[str] = LOSS_FIELDS  # the columns of metrics.csv
    compile: bool = False  # torch.compile the task's step on the module (see resolve_compile)
    cuda_graphs: bool = False  # the module's forward and backward as CUDA graphs (see resolve_cuda_graphs)

    def __post_init__(self) -> None:
        if (self.iterations is None) == (self.epochs is None):
            raise ValueError("LoopOptions needs exactly one of iterations and epochs")
        if self.compile and self.cuda_graphs:
            raise ValueError("LoopOptions takes compile or cuda_graphs, not both")

    def total_steps(self, steps_per_epoch: int) -> int:
        return self.iterations if self.epochs is None else self.epochs * steps_per_epoch


@dataclass
class LoopResult:
    history: list[dict[str, Any]]
    seconds: float  # training time of this process (this invocation)
    replica_hashes: list[str]  # every process's state_hash of the final model, in rank order
    # how the steps ran: "eager", "compiled", "CUDA graphs" or "eager (compilation failed)" / "(capture failed)"
    mode: str = "eager"


def _snapshot(net: nn.Module, device: torch.device) -> Callable[[], None]:
    """A function that puts ``net``'s buffers (BatchNorm statistics) and the RNG states back as they are now:
    a step tried and abandoned (a capture, a failed compilation) leaves the run as it would have been."""
    rngs, buffers = rng_state(device), {k: b.clone() for k, b in net.named_buffers()}

    def restore() -> None:
        with torch.no_grad():
            for k, b in net.named_buffers():
                b.copy_(buffers[k])
        set_rng_state(rngs, device)

    return restore


class _Captured(nn.Module):
    """The module whose forward :func:`graph_module` captures: ``net`` called with the step's inputs. A
    wrapper, so that ``torch.cuda.make_graphed_callables`` patches its forward and not ``net``'s (a copy of
    ``net``, such as the converted model, must keep its own forward)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, *inputs: Tensor) -> Tensor:
        return self.net(*inputs)


class GraphedModule(nn.Module):
    """``net`` whose calls with inputs of the captured shapes replay CUDA graphs of its forward and backward
    (``torch.cuda.make_graphed_callables``); any other call runs ``net`` itself. Training mode only: built
    by :func:`graph_module`. Shapes: as ``net``."""

    def __init__(self, net: nn.Module, graphed: nn.Module, example: tuple[Tensor, ...]) -> None:
        super().__init__()
        # Plain attributes, not submodules: the parameters are net's, listed once by whoever owns it.
        self._calls = (net, graphed)
        self._signature = [(t.shape, t.dtype, t.device) for t in example]

    def forward(self, *inputs: Tensor) -> Tensor:
        net, graphed = self._calls
        if net.training and [(t.shape, t.dtype, t.device) for t in inputs] == self._signature:
            return graphed(*inputs)
        return net(*inputs)


def graph_module(
    net: nn.Module, example: tuple[Tensor, ...], autocast_dtype: torch.dtype | None
) -> GraphedModule:
    """``net`` (in training mode, on a CUDA device) with its forward and backward captured as CUDA graphs for
    inputs like ``example``: a step then costs the host two graph launches instead of one launch per kernel.

    The capture runs ``net`` a few times (warm-up, then the capture itself) without touching gradients; its
    buffers and the RNG states are put back afterwards (:func:`_snapshot`). ``autocast_dtype``: the AMP dtype
    the steps run under (``None``: none); the graphs keep it. ``RuntimeError`` if an operation cannot be
    captured.
    """
    device = example[0].device
    if device.type != "cuda":
        raise RuntimeError(f"CUDA graphs need a CUDA device, not {device}")
    restore = _snapshot(net, device)
    wrapper = _Captured(net).train()
    static = tuple(t.detach().clone() for t in example)  # the graphs' input buffers
    amp = autocast_dtype is not None
    try:
        # No autocast cache inside a capture: its cast weights would be baked into the graph.
        with (
            torch.autocast(
                device.type, dtype=autocast_dtype or torch.float32, enabled=amp, cache_enabled=False
            ),
            _quiet_capture(),
        ):
            graphed = torch.cuda.make_graphed_callables(wrapper, static, allow_unused_input=True)
    finally:
        restore()
    return GraphedModule(net, graphed, example)


@contextmanager
def _quiet_capture() -> Iterator[None]:
    """Silence the two warnings PyTorch raises for what a capture does on purpose: its warm-up runs the
    backward on a side stream (the accumulate-grad stream mismatch), whose thread makes its own cuBLAS
    context current."""
    mismatch = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*AccumulateGrad node's stream does not match.*")
        warnings.filterwarnings("ignore", message=".*no current CUDA context.*")
        if mismatch is not None:
            mismatch(False)
        try:
            yield
        finally:
            if mismatch is not None:
                mismatch(True)  # PyTorch's default; it has no getter to restore another setting


class Diverged(UserError):
    """A run whose loss or weights became NaN/inf: a user's recipe (learning rate) that does not fit."""


class ProcessLost(UserError):
    """A run stopped because a process it needs died: one of its data loading workers, or (torchrun) another
    process of the run, killed (out of memory, a node lost) or failed; the message says what is kept."""


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT (Ctrl-C) or SIGTERM (``kill``, a batch system's time limit): its message says
    at which step and where the checkpoint is; the CLI exits with ``128 + signum`` (130, 143)."""

    def __init__(self, message: str, signum: int, *, quiet: bool = False) -> None:
        super().__init__(message)
        self.signum = signum
        self.quiet = quiet  # a process other than 0 of a run: process 0 says it, once for the run


def train_loop(net: nn.Module, optimizer, loader, opts: LoopOptions, procs: DistInfo,
               state: dict[str, Any] | None = None, hooks: LoopHooks | None = None) -> LoopResult:  # fmt: skip
    """Train ``net`` (prepared by :func:`~repmlp.engine.processes.prepare_module`) over ``loader``
    (``loader.batches(epoch, start)``: this process's ``(images, labels)`` of an epoch from batch ``start``;
    ``len(loader)`` batches an epoch) per ``opts``, with the task's ``hooks``; continue bitwise from ``state``
    (:func:`~repmlp.engine.state.check_output`) if given. ``checkpoint.safetensors`` every ``ckpt_every``
    steps, after every epoch of an epoch-counted run and at the end; SIGINT or SIGTERM stops the run at the
    next step boundary with a checkpoint (:class:`RunInterrupted`); NaN/inf is :class:`Diverged`."""
    return _Loop(net, optimizer, loader, opts, procs, hooks or LoopHooks()).run(state)


class _Loop:
    """One run of :func:`train_loop`: the objects it trains and where it stands."""

    def __init__(self, net: nn.Module, optimizer, loader, opts: LoopOptions, procs: DistInfo,
                 hooks: LoopHooks) -> None:  # fmt: skip
        self.net, self.optimizer, self.loader = net, optimizer, loader
        self.opts, self.procs, self.hooks = opts, procs, hooks
        fp16 = opts.amp and amp_dtype(procs.device) == torch.float16
        self.scaler = torch.amp.GradScaler(procs.device.type, enabled=fp16)
        self.steps_per_epoch = len(loader)
        self.total = opts.total_steps(self.steps_per_epoch)
        self.path = opts.output / STATE_FILE
        self.pos = Position()
        self.saved_at = -1  # the step of the last checkpoint
        self.received: int | None = None  # the first SIGINT/SIGTERM of this process (on_signal)
        self.saving = False  # writing the interrupt checkpoint: another signal waits for it
        self.stopping = False  # a signal came (on any process): stop at the next step boundary
        self.bar: Any = None
        self.start = self.mark = 0.0  # the run's start; the start of this epoch's unrecorded time
        # The module the steps call: compiled, or captured as CUDA graphs, by the first step.
        self.step_net = torch.compile(net) if opts.compile else net
        self.mode = "compiled" if opts.compile else "eager"
        self.first = self.compiled_step if opts.compile else self.graphed_step if opts.cuda_graphs else None

    def run(self, state: dict[str, Any] | None) -> LoopResult:
        if state is not None:
            self.restore(state)
        try:
            return self._run()
        except (RuntimeError, ConnectionError, EOFError) as exc:
            died = isinstance(exc, (ConnectionError, EOFError)) or "DataLoader worker" in str(exc)
            if died and threading.current_thread() is threading.main_thread():
                # First: once a worker has died, torch's SIGCHLD handler raises anew as any child process
                # ends, even while this error is read. The run is over.
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            if (lost := self.lost(exc, died)) is None:
                raise
            raise lost from exc

    def lost(self, exc: Exception, worker_died: bool) -> ProcessLost | None:
        """:class:`ProcessLost` for ``exc`` raised by a data loading worker's death (``worker_died``: torch's
        DataLoader says so, or its pipes broke) or by a collective whose peer died (torch.distributed, gloo,
        NCCL), else ``None``."""
        raw = first_line(exc)
        text = re.sub(r"^\[[^\]]*\]\s*", "", raw)[:160]  # without gloo's source file and line
        step = f"step {self.pos.step + 1}"
        if worker_died:
            what = (
                f"a data loading worker process died during {step} ({text}; out of memory? fewer --workers)"
            )
        elif self.procs.enabled and (isinstance(exc, dist.DistError) or "gloo" in raw or "NCCL" in raw):
            what = f"process {self.procs.rank} of {self.procs.world}: another process stopped during {step} ({text})"
        else:
            return None
        return ProcessLost(f"{what}; {self.kept()}; continue with --resume")

    @contextmanager
    def signal_handlers(self) -> Iterator[None]:
        """SIGINT and SIGTERM handlers (:meth:`on_signal`) while the run trains, in the main thread (the only
        one Python delivers signals to); the previous handlers come back afterwards."""
        main = threading.current_thread() is threading.main_thread()
        previous = (
            {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        )
        try:
            yield
        finally:
            for signum, handler in previous.items():  # None: not set from Python; the default is closest
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    def on_signal(self, signum: int, frame: object) -> None:
        """The first signal is recorded: the loop stops at the next step boundary with a checkpoint. A second
        Ctrl-C stops the run at once (a step that hangs), unless the interrupt checkpoint is being written;
        another SIGTERM does not (torchrun passes on the SIGTERM that a scheduler sent every process)."""
        if self.received is not None and signum == signal.SIGINT and not self.saving:
            raise self.interrupted_again(signum)
        self.received = self.received or signum

    def _run(self) -> LoopResult:
        with self.signal_handlers():  # first: once the run folder exists, a signal keeps the run
            lock_output(self.opts.output, self.procs)  # made and locked by rank 0: one writer per run
            self.start = time.perf_counter()
            while self.pos.step < self.total and self.epoch():
                pass
            seconds = time.perf_counter() - self.start
            if self.saved_at != self.pos.step:
                self.save()
            self.write_metrics()  # again: a run killed between its last checkpoint and this file resumes here
            if self.stop_requested():  # during the last step or its checkpoint: the run's end is left to do
                self.stop()
        hashes = replica_hashes(unwrap(self.net), self.procs)
        return LoopResult(self.pos.history, seconds, hashes, self.mode)

    def epoch(self) -> bool:
        """Train the rest of the current epoch; returns ``False`` if the run ended inside it."""
        pos = self.pos
        self.net.train()
        self.mark = time.perf_counter()
        # An epoch-counted run's bar counts the epoch's batches, an iteration-counted one's the run's steps;
        # closed (its line cleared) before the epoch's end logs its line.
        main, epochs = self.procs.is_main, self.opts.epochs
        if epochs is not None:
            bar = progress(None, self.steps_per_epoch, f"epoch {pos.epoch + 1}/{epochs}", main, pos.batch)
        else:
            bar = progress(None, self.total, f"train (epoch {pos.epoch + 1})", main, pos.step)
        self.said: float | None = None  # when the last progress line was logged, where the bar is off
        with bar as self.bar:
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
        first, self.first = self.first, None
        stats = first(images, labels) if first else self.forward_backward(self.step_net, images, labels)
        pos.step, pos.batch = pos.step + 1, pos.batch + 1
        for sums in (pos.epoch_acc, pos.window):
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
        return lrs[0]

    def forward_backward(self, net: nn.Module, images: Tensor, labels: Tensor) -> dict[str, float]:
        """The task's step on ``net`` under autocast, backward and the (gradient-scaled) optimizer step; a
        non-finite loss is :class:`Diverged`. Returns the step's statistics."""
        device, pos = images.device, self.pos
        with torch.autocast(device.type, dtype=amp_dtype(device), enabled=self.opts.amp):
            loss, stats = self.hooks.step(net, images, labels, pos)
        loss = loss.float()
        bad = (~torch.isfinite(loss.detach())).float().reshape(1)
        if all_reduce_sum(bad, self.procs).item() > 0:  # on any process: every process stops at this step
            where = f"step {pos.step + 1} (epoch {pos.epoch + 1}, batch {pos.batch + 1})"
            value = f"{loss.item()}" if bad.item() else "NaN/inf on another process"
            raise self.diverged(f"the loss became {value} at {where}")
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return stats

    def compiled_step(self, images: Tensor, labels: Tensor) -> dict[str, float]:
        """The first step through ``torch.compile``. If compiling fails (no C++ compiler, an unsupported
        operator): one logged line, and the run goes on eagerly, bitwise (RNG states and buffers put back)."""
        # Imported here: torch._dynamo takes seconds to import, and only compiled runs need it.
        from torch._dynamo.exc import TorchDynamoException
        from torch._inductor.exc import InductorError

        restore = _snapshot(self.net, images.device)  # the task's step may draw (dropout, mixup) first
        try:
            return self.forward_backward(self.step_net, images, labels)
        except (TorchDynamoException, InductorError) as exc:
            log.warning("torch.compile failed (%s): training eagerly", first_line(exc)[:200])
            self.step_net, self.mode = self.net, "eager (compilation failed)"
            restore()
            return self.forward_backward(self.net, images, labels)

    def graphed_step(self, images: Tensor, labels: Tensor) -> dict[str, float]:
        """Capture the module as CUDA graphs of this batch's shape (:func:`graph_module`), then the step
        through them. If an operation cannot be captured: one logged line, and the run goes on eagerly."""
        try:
            amp = amp_dtype(images.device) if self.opts.amp else None
            self.step_net, self.mode = graph_module(self.net, (images,), amp), "CUDA graphs"
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            reason = first_line(exc)[:200]
            log.warning("capturing the training step as CUDA graphs failed (%s): training eagerly", reason)
            self.mode = "eager (capture failed)"
        return self.forward_backward(self.step_net, images, labels)

    def after_step(self, lr: float) -> None:
        """Progress bar, loss log, checkpoint, stop on a signal."""
        pos, opts = self.pos, self.opts
        self.bar.update(1)
        if self.procs.is_main:
            n = max(1.0, pos.epoch_acc.get("n", 1.0))
            # The task's statistics; not the engine's own sums (the count, the epoch's seconds so far).
            means = {k: f"{v / n:.4g}" for k, v in pos.epoch_acc.items() if k not in ("n", "seconds")}
            self.bar.set_postfix(**means, lr=f"{lr:.3g}", refresh=False)
            now = time.perf_counter()
            if self.bar.disable and (self.said is None or now - self.said >= PROGRESS_SECONDS):
                self.said = now
                where = (f"epoch {pos.epoch + 1}/{opts.epochs} batch {pos.batch}/{self.steps_per_epoch}"
                         if opts.epochs is not None else f"step {pos.step}/{self.total}")  # fmt: skip
                stats = "  ".join(f"{k} {v}" for k, v in means.items())
                log.info("%s  %s  lr %.3g  %.0f s since the start", where, stats, lr, now - self.start)
        if opts.log_interval and (pos.step % opts.log_interval == 0 or pos.step == self.total):
            self.log_window()
        epoch_end = opts.epochs is not None and pos.batch == self.steps_per_epoch  # saved after end_epoch
        if opts.ckpt_every and pos.step % opts.ckpt_every == 0 and pos.step < self.total and not epoch_end:
            self.add_seconds()
            self.save()
        # At an epoch's end the run stops after the epoch's evaluation and checkpoint (end_epoch); at the
        # last step after the final checkpoint (run): a checkpoint before those would skip them on resuming.
        if not epoch_end and pos.step < self.total and self.stop_requested():
            self.add_seconds()  # the epoch's time so far: the resumed run's history has the whole epoch's
            self.stop()

    def stop_requested(self) -> bool:
        """Whether a signal came, to this process or (torchrun) any other: every process then stops at the
        same step, as saving needs all of them (one small all-reduce a step; none for one process)."""
        if not self.stopping and not self.procs.enabled:
            self.stopping = self.received is not None
        elif not self.stopping:
            # Which signals came, anywhere: every process then names the same one (SIGTERM before SIGINT).
            came = torch.tensor([float(self.received == s) for s in (signal.SIGTERM, signal.SIGINT)])
            came = all_reduce_sum(came.to(self.procs.device), self.procs).cpu()
            if came.any():
                self.stopping, self.received = True, signal.SIGTERM if came[0] > 0 else signal.SIGINT
        return self.stopping

    def stop(self) -> NoReturn:
        """The checkpoint of this step (unless written already), then :class:`RunInterrupted`."""
        self.saving = True  # another Ctrl-C now waits for the file
        if self.saved_at != self.pos.step:
            self.save()
        pos, signum = self.pos, self.received or signal.SIGINT
        raise RunInterrupted(
            f"interrupted by {signal.Signals(signum).name} at epoch {pos.epoch + 1}, batch {pos.batch} "
            f"(step {pos.step}): checkpoint saved to {self.path}; continue with --resume",
            signum,
            quiet=not self.procs.is_main,
        )

    def interrupted_again(self, signum: int) -> RunInterrupted:
        """A second signal before the step boundary: the run stops without a checkpoint of this step."""
        name, step = signal.Signals(signum).name, self.pos.step + 1
        text = f"interrupted again by {name} before step {step} ended: stopped without a checkpoint of it"
        return RunInterrupted(f"{text}; {self.kept()}", signum)

    def kept(self) -> str:
        """What a run that stops without a checkpoint of its step leaves to resume from."""
        if self.saved_at < 0:
            return f"no checkpoint was written to {self.opts.output}"
        return f"the checkpoint of step {self.saved_at} is kept in {self.path}"

    def diverged(self, what: str) -> Diverged:
        elsewhere = " into another --output" if self.saved_at >= 0 else ""
        return Diverged(f"training diverged: {what}; {self.kept()} (try a smaller --lr{elsewhere})")

    def check_finite(self) -> None:
        """:class:`Diverged` (on every process alike) if the module's parameters or buffers hold NaN/inf:
        checked before every checkpoint and at each epoch's end, as weights can diverge while the loss (checked
        every step) stays finite (BatchNorm statistics, an update that overflows)."""
        module = unwrap(self.net)
        named = [
            (k, t) for k, t in [*module.named_parameters(), *module.named_buffers()] if t.is_floating_point()
        ]
        if not named:
            return
        finite = torch.stack([torch.isfinite(t.detach()).all() for _, t in named])
        # Every process raises, or none.
        if all_reduce_sum((~finite).sum().reshape(1), self.procs).item() == 0:
            return
        names = [k for (k, _), ok in zip(named, finite.tolist(), strict=True) if not ok]
        shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "") if names else "on another process"
        pos = self.pos
        raise self.diverged(
            f"the weights hold NaN/inf after step {pos.step} (epoch {pos.epoch + 1}, batch {pos.batch}: "
            f"{shown}) although the loss was finite"
        )

    def add_seconds(self) -> None:
        now = time.perf_counter()
        self.pos.epoch_acc["seconds"] = self.pos.epoch_acc.get("seconds", 0.0) + now - self.mark
        self.mark = now

    def end_epoch(self) -> None:
        """The task's end-of-epoch hook, then the next epoch; checkpoint after each epoch if counting them."""
        pos = self.pos
        self.check_finite()  # before the task evaluates diverged weights
        row = self.hooks.end_epoch(pos) if self.hooks.end_epoch is not None else None
        if row is not None:
            overflowed = [f"{k} {v}" for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
            if overflowed:
                raise self.diverged(
                    f"the evaluation after step {pos.step} (epoch {pos.epoch + 1}) gave "
                    f"{', '.join(overflowed)} (finite weights whose outputs overflow)"
                )
            pos.history.append(row)
        pos.epoch, pos.batch, pos.epoch_acc = pos.epoch + 1, 0, {}
        if self.opts.epochs is not None:
            self.save()
            self.write_metrics()
            if pos.step < self.total and self.stop_requested():
                self.stop()

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
        self.check_finite()  # a diverged run keeps its last finite checkpoint
        rngs = gather_object(rng_state(self.procs.device), self.procs)
        if self.procs.is_main:
            state = {
                **self.opts.extra_state,
                "config": self.opts.config,
                "model": unwrap(self.net).state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
                **vars(self.pos),
                "rng": {str(r): s for r, s in enumerate(rngs)},
            }
            state_file.save_state(self.path, state)  # atomic: an interrupted write leaves the previous one
        self.saved_at = self.pos.step

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: checked first (:func:`check_state`; its config must agree with this run's,
        :func:`check_resumable`), then loaded; a state that does not fit is one :class:`CheckpointError` line."""
        opts, procs = self.opts, self.procs
        trained_by = len(state["rng"]) if isinstance(state.get("rng"), dict) else procs.world
        if trained_by != procs.world:  # each process's batches and BatchNorm statistics depend on the count
            raise UserError(
                f"cannot resume {opts.output}: it was trained by {trained_by} process(es), this run has "
                f"{procs.world}; resume it with {trained_by} in all (torchrun --nnodes x --nproc-per-node), "
                "or train into another --output"
            )
        try:
            position = check_state(
                state, self.optimizer, self.steps_per_epoch, self.total, opts.metric_fields, self.path
            )
            check_resumable(state["config"], opts.config, opts.output, runtime=opts.runtime_keys)
            unwrap(self.net).load_state_dict(state["model"], strict=True)
            self.optimizer.load_state_dict(state["optimizer"])
            if state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            set_rng_state(state["rng"][str(procs.rank)], procs.device)
        except CheckpointError:
            raise  # names the file already
        except (LookupError, ArithmeticError, RuntimeError, ValueError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{self.path} does not fit this run: {first_line(exc)}") from None
        pos = self.pos = Position(**position)
        self.saved_at = pos.step
        if procs.is_main:
            restarts = restart_count()
            why = f" (torchrun restarted the processes: restart {restarts})" if restarts else ""
            log.info("resuming %s at epoch %d, batch %d (step %d)%s", opts.output, pos.epoch + 1, pos.batch,
                     pos.step, why)  # fmt: skip

    def write_metrics(self) -> None:
        if self.procs.is_main:
            write_metrics_csv(self.opts.output / METRICS_FILE, self.pos.history, self.opts.metric_fields)
