"""Batch iterators with a resumable, distributed, seeded data order.

Both loaders share one contract: ``batches(epoch, start)`` yields ``(x, y)`` for batches ``start, start+1,
...`` of ``epoch`` on this rank, with ``x`` a normalised float batch ``(B, C, H, W)`` on the target device
and ``y`` int64 labels ``(B,)``. The order is a pure function of ``(seed, epoch)`` (the same permutation
as ``DistributedSampler``: shuffle, pad to a multiple of the world size, take every ``world``-th index),
and augmentation is seeded per batch or per sample, so skipping ``start`` batches after a resume
reproduces the uninterrupted run exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

__all__ = ["rank_indices", "InMemoryLoader", "FolderLoader", "batch_generator", "pad_crop_flip"]


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
    """Random ``pad``-pixel crop (zero padding) and left-right flip of each image in ``x`` ``(B, C, H, W)``."""
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


class _ShardedBatches:
    """What both loaders share: this process's shard of the examples, and how many batches it makes.

    Subclasses set ``batch_size``, ``train``, ``seed``, ``rank``, ``world`` and define ``num_samples``.
    """

    batch_size: int
    train: bool
    seed: int
    rank: int
    world: int

    @property
    def num_samples(self) -> int:
        raise NotImplementedError

    def _indices(self, epoch: int) -> Tensor:
        return rank_indices(
            self.num_samples,
            epoch=epoch,
            seed=self.seed,
            rank=self.rank,
            world=self.world,
            shuffle=self.train,
            pad=self.train,
        )

    def __len__(self) -> int:
        n = len(self._indices(0))
        # Training drops the last partial batch (BatchNorm dislikes tiny batches); evaluation keeps it.
        return max(1, n // self.batch_size) if self.train else math.ceil(n / self.batch_size)


class InMemoryLoader(_ShardedBatches):
    """Batches from uint8 image tensors held in memory (Fashion-MNIST, CIFAR-10): no per-sample Python.

    ``images``: ``(N, C, H, W)`` uint8; ``labels``: ``(N,)`` int64. ``batch_size`` is per rank.
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        *,
        batch_size: int,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        train: bool,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        pad: int = 0,
        flip: bool = False,
        device: torch.device | str = "cpu",
        channels_last: bool = False,
    ) -> None:
        self.images, self.labels = images, labels
        self.batch_size, self.train, self.seed, self.rank, self.world = batch_size, train, seed, rank, world
        self.pad, self.flip = pad, flip
        self.device, self.channels_last = torch.device(device), channels_last
        c = images.shape[1]
        self.mean = torch.tensor(mean, dtype=torch.float32).reshape(1, c, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).reshape(1, c, 1, 1)

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


class _EpochSampler(torch.utils.data.Sampler):
    """Yields ``(index, epoch)`` pairs from a precomputed index list (so items know their epoch)."""

    def __init__(self, indices: list[int], epoch: int) -> None:
        self.indices, self.epoch = indices, epoch

    def __iter__(self):
        return iter((i, self.epoch) for i in self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class FolderLoader(_ShardedBatches):
    """Batches decoded from image files by a ``DataLoader`` (ImageFolder); same contract as above."""

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        *,
        batch_size: int,
        train: bool,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        workers: int = 2,
        device: torch.device | str = "cpu",
        channels_last: bool = False,
        collate: Callable | None = None,
    ) -> None:
        self.dataset, self.batch_size, self.train = dataset, batch_size, train
        self.seed, self.rank, self.world, self.workers = seed, rank, world, workers
        self.device, self.channels_last = torch.device(device), channels_last

    @property
    def num_samples(self) -> int:
        return len(self.dataset)

    def batches(self, epoch: int, start: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
        idx = self._indices(epoch)[start * self.batch_size : len(self) * self.batch_size].tolist()
        if not idx:
            return
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=_EpochSampler(idx, epoch),
            num_workers=self.workers,
            pin_memory=self.device.type == "cuda",
            drop_last=False,
            # Its own generator: a DataLoader iterator otherwise draws its base seed from the global torch
            # RNG, so starting mid-epoch (--resume) would shift dropout's random numbers.
            generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch),
        )
        for x, y in loader:
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
