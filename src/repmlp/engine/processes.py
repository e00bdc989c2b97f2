"""The processes of a run: torchrun/DDP set-up, the module each process trains, collective helpers."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from repmlp.engine.devices import resolve_device

log = logging.getLogger(__name__)


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


def run_in_processes(args, body: Callable[[Any, DistInfo], int | None]) -> int:
    """``body(args, procs)`` with ``--threads`` applied, in the torchrun process group when there is one
    (left again whatever happens). Returns the exit status ``body`` returns (``None``: 0)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    procs = setup_distributed(args.device)
    try:
        return int(body(args, procs) or 0)
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
