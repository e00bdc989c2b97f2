"""Batch iterators with a resumable, distributed, seeded data order.

Both loaders' ``batches(epoch, start)`` yield ``(x, y)`` for batches ``start, start+1, ...`` of ``epoch`` on
this rank: ``x`` a normalised float batch ``(B, C, H, W)`` on the target device, ``y`` int64 labels ``(B,)``.
The order is a pure function of ``(seed, epoch)`` (``DistributedSampler``'s) and augmentation is seeded per
batch or per sample, so skipping ``start`` batches after a resume reproduces the uninterrupted run exactly.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["rank_indices", "InMemoryLoader", "FolderLoader", "batch_generator", "pad_crop_flip",
           "default_workers", "normalize_on_device"]  # fmt: skip


def default_workers() -> int:
    """Decoding processes when ``--workers`` is not given: one per CPU core this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def normalize_on_device(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """uint8 (or 0..255 float) ``(B, C, H, W)`` -> ``(x / 255 - mean) / std`` in float32 (``ToTensor`` and
    ``Normalize``'s operations, the same bits); ``mean``/``std`` ``(1, C, 1, 1)``."""
    return x.float().div_(255.0).sub_(mean).div_(std)


def batch_generator(*key: int) -> torch.Generator:
    """A CPU generator seeded from integers (seed, epoch, step, ...): independent streams per key."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence(list(key)).generate_state(1)[0]))


def rank_indices(n: int, *, epoch: int, seed: int, rank: int, world: int, shuffle: bool, pad: bool) -> Tensor:
    """This rank's sample indices for one epoch (``DistributedSampler``'s order; ``pad`` repeats the head)."""
    order = (
        torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        if shuffle
        else torch.arange(n)
    )
    if pad and world > 1:
        total = math.ceil(n / world) * world
        if total > n:
            order = torch.cat([order, order[: total - n]])
    return order[rank::world]


def pad_crop_flip(x: Tensor, pad: int, flip: bool, gen: torch.Generator) -> Tensor:
    """Random ``pad``-pixel crop (zero padding) and left-right flip of each image of ``(B, C, H, W)``."""
    b, c, h, w = x.shape
    if pad > 0:
        padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
        oy = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
        ox = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
        rows = (oy[:, None] + torch.arange(h))[:, None, :, None]
        cols = (ox[:, None] + torch.arange(w))[:, None, None, :]
        x = padded[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]
    if flip:
        mask = torch.rand(b, generator=gen) < 0.5
        x = torch.where(mask[:, None, None, None], x.flip(-1), x)
    return x


def _channel_stats(values: Sequence[float], device: torch.device | str = "cpu") -> Tensor:
    return torch.tensor(values, dtype=torch.float32).reshape(1, -1, 1, 1).to(device)


class _ShardedBatches:
    """What both loaders share: this process's shard of ``num_samples`` examples, and its batch count (from
    ``batch_size``, ``train``, ``seed``, ``rank`` and ``world``, set by the loader)."""

    def _indices(self, epoch: int) -> Tensor:
        return rank_indices(self.num_samples, epoch=epoch, seed=self.seed, rank=self.rank, world=self.world,
                            shuffle=self.train, pad=self.train)  # fmt: skip

    def __len__(self) -> int:
        n = len(self._indices(0))
        # Training drops the last partial batch (BatchNorm dislikes tiny batches); evaluation keeps it.
        return max(1, n // self.batch_size) if self.train else math.ceil(n / self.batch_size)


class InMemoryLoader(_ShardedBatches):
    """Batches of uint8 images held in memory (Fashion-MNIST, CIFAR-10), no per-sample Python:
    ``images`` ``(N, C, H, W)`` uint8, ``labels`` ``(N,)`` int64, ``batch_size`` per rank."""

    def __init__(self, images: Tensor, labels: Tensor, *, batch_size: int, mean: tuple[float, ...],
                 std: tuple[float, ...], train: bool, seed: int = 0, rank: int = 0, world: int = 1,
                 pad: int = 0, flip: bool = False, device: torch.device | str = "cpu",
                 channels_last: bool = False) -> None:  # fmt: skip
        self.images, self.labels = images, labels
        self.batch_size, self.train, self.seed, self.rank, self.world = batch_size, train, seed, rank, world
        self.pad, self.flip = pad, flip
        self.device, self.channels_last = torch.device(device), channels_last
        self.mean, self.std = _channel_stats(mean), _channel_stats(std)

    @property
    def num_samples(self) -> int:
        return len(self.labels)

    def batches(self, epoch: int, start: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
        idx = self._indices(epoch)
        for step in range(start, len(self)):
            sel = idx[step * self.batch_size : (step + 1) * self.batch_size]
            x = self.images[sel].float().div_(255.0)
            if self.train and (self.pad or self.flip):
                x = pad_crop_flip(x, self.pad, self.flip, batch_generator(self.seed, epoch, step, self.rank))
            x = (x - self.mean) / self.std
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x.to(self.device, non_blocking=True), self.labels[sel].to(self.device, non_blocking=True)


def _die_with_parent(worker_id: int) -> None:
    """``worker_init_fn``: the worker dies with its parent (Linux's ``PR_SET_PDEATHSIG``), not at the
    DataLoader's watchdog, holding memory and files meanwhile."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the watchdog alone
        pass


def _collate_list(items: list[tuple[Any, int]]) -> tuple[list[Any], Tensor]:
    """A batch as ``([item payloads], labels (B,))``: the payloads of the device pipeline differ in size."""
    return [x for x, _ in items], torch.tensor([y for _, y in items], dtype=torch.int64)


# The GPU pipeline's batch maker: (item payloads, labels, device) -> float batch (B, C, H, W) on the device.
OnDevice = Callable[[list[Any], Tensor, torch.device], Tensor]


def _normalizing_collate(mean: Tensor, std: Tensor, items: list[Any]) -> tuple[Tensor, Tensor]:
    """A ``collate_fn`` (with ``functools.partial``) that normalises in the worker: on a CPU device the main
    process would otherwise do it alone while the workers wait."""
    x, y = torch.utils.data.default_collate(items)
    return normalize_on_device(x, mean, std), y


class FolderLoader(_ShardedBatches):
    """Batches decoded from files by one ``DataLoader`` (image folder, face, segmentation) with persistent
    workers; items ``(index, epoch)`` are seeded per example. With ``mean``/``std`` the items are uint8
    ``(C, H, W)``, travel as uint8 and are normalised on the device; without them they are the model's input.
    ``on_device(payloads, labels, device)`` replaces collation (the GPU decoding pipeline).
    """

    def __init__(self, dataset: torch.utils.data.Dataset, *, batch_size: int, train: bool, seed: int = 0,
                 rank: int = 0, world: int = 1, workers: int | None = None,
                 device: torch.device | str = "cpu", channels_last: bool = False,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 on_device: OnDevice | None = None) -> None:  # fmt: skip
        self.dataset, self.batch_size, self.train = dataset, batch_size, train
        self.seed, self.rank, self.world = seed, rank, world
        self.workers = default_workers() if workers is None else workers
        self.device, self.channels_last = torch.device(device), channels_last
        self.on_device = on_device
        self.mean = self.std = None
        if mean is not None and std is not None:
            self.mean, self.std = _channel_stats(mean, self.device), _channel_stats(std, self.device)
        # The DataLoader's sampler: (index, epoch) items of the epoch being read, set before each iter(loader)
        # (which reads it afresh, persistent workers too): one DataLoader serves every epoch.
        self._order: list[tuple[int, int]] = []
        self._loader: torch.utils.data.DataLoader | None = None
        # On a CPU device "on the device" would be the main process alone: the workers normalise instead.
        self._normalizes_in_workers = (
            self.device.type == "cpu" and self.workers > 0 and self.mean is not None and not on_device
        )

    @property
    def num_samples(self) -> int:
        return len(self.dataset)

    def _data_loader(self) -> torch.utils.data.DataLoader:
        if self._loader is None:
            collate = _collate_list if self.on_device is not None else None
            if self._normalizes_in_workers:
                collate = functools.partial(_normalizing_collate, self.mean, self.std)
            self._loader = torch.utils.data.DataLoader(
                self.dataset,
                batch_size=self.batch_size,
                sampler=self._order,
                num_workers=self.workers,
                collate_fn=collate,
                pin_memory=self.device.type == "cuda" and self.on_device is None,
                drop_last=False,
                persistent_workers=self.workers > 0,
                worker_init_fn=_die_with_parent,
                prefetch_factor=4 if self.workers > 0 else None,
                # Its own generator: a DataLoader iterator otherwise draws its base seed from the global
                # torch RNG, so starting mid-epoch (--resume) would shift dropout's random numbers.
                generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank),
            )
        return self._loader

    def batches(self, epoch: int, start: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
        idx = self._indices(epoch)[start * self.batch_size : len(self) * self.batch_size].tolist()
        if not idx:
            return
        loader = self._data_loader()
        self._order[:] = [(i, epoch) for i in idx]  # read by iter(loader) below
        for x, y in loader:
            if self.on_device is not None:
                x = self.on_device(x, y, self.device)
            else:
                x = x.to(self.device, non_blocking=True)
            if self.mean is not None and not self._normalizes_in_workers:
                x = normalize_on_device(x, self.mean, self.std)
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x, y.to(self.device, non_blocking=True)
