"""The processes of a run: torchrun/DDP set-up, the module each process trains, collective helpers."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from repmlp.engine.devices import resolve_device
from repmlp.engine.forms import training_form
from repmlp.errors import UserError, first_line

log = logging.getLogger(__name__)
_R = TypeVar("_R")
_MAX_WORLD = 1 << 16  # processes of one run: far beyond any cluster
_HINT = "start the processes with torchrun, or unset WORLD_SIZE for one process"


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


def _env_int(name: str, lo: int, hi: int, default: str | None = None, hint: str = _HINT) -> int:
    """The environment variable ``name`` as an integer in ``lo..hi``, else a :class:`UserError` naming it and
    ending in ``hint``."""
    text = os.environ.get(name, default)
    if text is None:
        raise UserError(f"{name} is not set: a run of several processes needs it ({lo}..{hi}); {hint}")
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        shown = repr(text) if len(text) <= 40 else repr(text[:40]) + "..."  # a value of any length: cut
        raise UserError(f"{name}={shown}: expected an integer in {lo}..{hi}; {hint}")
    return value


def process_environment() -> tuple[int, int, int]:
    """``(rank, world, local_rank)`` from torchrun's environment, each variable checked: ``WORLD_SIZE``
    (unset: one process); with several, ``RANK`` below it, ``LOCAL_RANK`` (default 0), ``MASTER_ADDR`` and
    ``MASTER_PORT``."""
    world = _env_int("WORLD_SIZE", 1, _MAX_WORLD, default="1")
    if world == 1:
        return 0, 1, 0
    rank = _env_int("RANK", 0, world - 1)
    local_rank = _env_int("LOCAL_RANK", 0, world - 1, default="0")
    if not os.environ.get("MASTER_ADDR", "").strip():
        raise UserError(f"MASTER_ADDR is not set: WORLD_SIZE={world} needs the rendezvous host; {_HINT}")
    _env_int("MASTER_PORT", 1, 65535)
    return rank, world, local_rank


def restart_count() -> int:
    """How often torchrun restarted this run's processes (``--max-restarts``): 0 when it did not, or without
    torchrun."""
    text = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
    return int(text) if text.isdigit() else 0


def setup_distributed(device_name: str) -> DistInfo:
    """Join the process group when started by ``torchrun`` (``WORLD_SIZE`` > 1): NCCL on GPU, gloo on CPU."""
    rank, world, local_rank = process_environment()
    device = resolve_device(device_name)
    if world <= 1:
        return DistInfo(device=device)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"LOCAL_RANK={local_rank}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                "start at most that many processes per machine (torchrun --nproc_per_node)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend, store = "nccl" if device.type == "cuda" else "gloo", _rendezvous(rank, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    return DistInfo(rank, world, local_rank, device)


def _rendezvous(rank: int, world: int) -> dist.Store:
    """torchrun's ``env://`` rendezvous, said in one line, bounded by ``REPMLP_DIST_TIMEOUT`` s (default 300)."""
    timeout = _env_int("REPMLP_DIST_TIMEOUT", 1, 86_400, default="300",
                       hint="the seconds the processes wait for each other (default 300)")  # fmt: skip
    # torchrun's processes carry its run id: the hint to start them with torchrun is for the others
    hint = "" if os.environ.get("TORCHELASTIC_RUN_ID") else f"; {_HINT}"
    where = f"{os.environ['MASTER_ADDR'].strip()}:{os.environ['MASTER_PORT'].strip()}"
    (log.info if rank == 0 else log.debug)("process %d of %d: waiting for the other %d at %s, timeout %d s",
                                           rank, world, world - 1, where, timeout)  # fmt: skip
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=timeout)))
    except (RuntimeError, OSError) as exc:  # torch's DistStoreError (a timeout) is a RuntimeError
        raise UserError(f"process {rank} of {world}: the others did not all join at {where} within {timeout} s "
                        f"({first_line(exc)[:200]}){hint}; REPMLP_DIST_TIMEOUT sets the wait") from None  # fmt: skip
    store.set_timeout(dist.default_pg_timeout)  # later store operations: torch's default
    # torchrun's agent keeps its store across restarts: a restarted group must not read the old one's keys
    return dist.PrefixStore(f"repmlp/attempt_{restart_count()}", store)


def cleanup_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_in_processes(args, body: Callable[[Any, DistInfo], _R]) -> _R:
    """``body(args, procs)`` with ``args.threads`` applied, in the torchrun process group when there is one
    (left again whatever happens)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    procs = setup_distributed(args.device)
    try:
        return body(args, procs)
    finally:
        cleanup_distributed()


def all_reduce_sum(t: torch.Tensor, procs: DistInfo) -> torch.Tensor:
    """Sum ``t`` over processes (identity for one process)."""
    if procs.enabled:
        t = t.clone()
        dist.all_reduce(t)
    return t


def gather_object(obj: Any, procs: DistInfo) -> list[Any]:
    """``obj`` of every process, in rank order (``[obj]`` for one process); every process must call it."""
    if not procs.enabled:
        return [obj]
    gathered: list[Any] = [None] * procs.world
    dist.all_gather_object(gathered, obj)
    return gathered


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def prepare_module(module: nn.Module, procs: DistInfo, *, form: bool = True) -> nn.Module:
    """``module`` on the run's device as the steps call it: its training form
    (:func:`~repmlp.engine.forms.training_form`, sharing its parameters and buffers) unless ``form`` is false;
    for multi-GPU runs with ``SyncBatchNorm`` (the paper's per-GPU batches are small: 2 images for PSPNet) and
    wrapped in DDP. ``module`` itself is moved to the device and otherwise left as it is."""
    module = module.to(procs.device)
    if form:
        module = training_form(module)
    if not procs.enabled:
        return module
    if procs.device.type == "cuda":
        module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
    ids = [procs.device.index] if procs.device.type == "cuda" else None
    for p in module.parameters():
        if p.requires_grad and p.dim() > 1:
            p.register_hook(functools.partial(_in_layout_of, p))
    return nn.parallel.DistributedDataParallel(module, device_ids=ids)


def _in_layout_of(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``param``'s strides where the two differ only in dimensions of size 1 (the same memory,
    another label: a conv weight of one input channel or a 1x1 kernel is both NCHW and channels_last, and
    which of the two labels a kernel gives its gradient depends on oneDNN's layout for the CPU). autograd keeps
    such a gradient as it comes; DDP's bucket views take the parameter's strides and compare them exactly
    (torch's "Grad strides do not match bucket view strides" warning)."""
    same = all(g == s for n, g, s in zip(grad.shape, grad.stride(), param.stride(), strict=True) if n != 1)
    return grad.as_strided(grad.shape, param.stride()) if same and grad.stride() != param.stride() else grad


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
    """Every process's :func:`state_hash` of ``model`` after :func:`broadcast_buffers`, in rank order, and
    logged: the check that DDP kept the processes in step."""
    broadcast_buffers(model, procs)
    hashes = gather_object(state_hash(model), procs)
    if len(set(hashes)) != 1:
        log.error("replicas differ after training: %s", hashes)
    elif procs.enabled and procs.is_main:
        log.info("final weights identical on all %d processes (sha256 %s)", procs.world, hashes[0][:16])
    return hashes
