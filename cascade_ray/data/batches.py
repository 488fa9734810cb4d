"""Batches from in-memory arrays: a distributed sampler over indices, then one slice per batch.

:class:`BatchSource` is what the stage loop reads batches from; :class:`ArraySource` is the
in-memory one.

Slicing whole batches out of the (shared, read-only) numpy arrays avoids the per-sample
collate of a ``DataLoader`` over a ``TensorDataset``, which dominates step time for
small images on CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from cascade_ray.config.schema import AugmentConfig

T = TypeVar("T")


def train_batches(n: int, batch_size: int, *, rank: int, world: int, seed: int, epoch: int) -> Iterator[torch.Tensor]:
    """Shuffled index batches for one rank; every rank gets the same number of batches.

    Uses ``DistributedSampler`` (padding by repetition) so DDP ranks step in lock-step.
    """
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    order = torch.tensor(list(sampler), dtype=torch.long)
    yield from order.split(batch_size)


def eval_batches(n: int, batch_size: int, *, rank: int, world: int) -> Iterator[torch.Tensor]:
    """This rank's share of an evaluation split, each sample exactly once across ranks."""
    yield from torch.arange(rank, n, world, dtype=torch.long).split(batch_size)


def num_train_batches(n: int, batch_size: int, world: int) -> int:
    """Batches per epoch per rank, matching :func:`train_batches`."""
    per_rank = -(-n // world)
    return -(-per_rank // batch_size)


def num_optimizer_steps(n: int, batch_size: int, world: int, accumulation_steps: int) -> int:
    """Optimizer steps per epoch: micro-batches per rank / accumulation_steps, rounded up."""
    return -(-num_train_batches(n, batch_size, world) // accumulation_steps)


def accumulation_windows(batches: Iterable[T], n: int, steps: int) -> Iterator[tuple[T, int, bool]]:
    """Yield ``(micro_batch, window_size, is_last_in_window)`` over one epoch's `n` micro-batches.

    Windows hold `steps` micro-batches; the epoch's last window holds what is left, so
    its loss is divided by its own size and no micro-batch is dropped or carried over.
    `batches` may be a stream: only its count `n` must be known up front.
    """
    for i, batch in enumerate(batches):
        start = i - i % steps
        size = min(steps, n - start)
        yield batch, size, i - start == size - 1


def augment(x: torch.Tensor, cfg: AugmentConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """Per-image random horizontal flip and random-offset crop of a (B, C, H, W) batch."""
    b, c, h, w = x.shape
    if cfg.hflip:
        flip = torch.rand(b, generator=generator, device=x.device) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
    p = cfg.crop_padding
    if p:
        padded = torch.nn.functional.pad(x, (p, p, p, p))
        oy = torch.randint(0, 2 * p + 1, (b, 1), generator=generator, device=x.device)
        ox = torch.randint(0, 2 * p + 1, (b, 1), generator=generator, device=x.device)
        rows = (oy + torch.arange(h, device=x.device))[:, None, :, None]
        cols = (ox + torch.arange(w, device=x.device))[:, None, None, :]
        x = padded[
            torch.arange(b, device=x.device)[:, None, None, None],
            torch.arange(c, device=x.device)[None, :, None, None],
            rows,
            cols,
        ]
    return x


Batch = tuple[torch.Tensor, torch.Tensor]


class BatchSource(Protocol):
    """Where a stage's batches come from: in-memory arrays (:class:`ArraySource`) or a Ray Data
    stream (:mod:`cascade_ray.data.stream`). Inputs come out normalized, float32, on the device."""

    def __len__(self) -> int:
        """Rows of the split, over all ranks."""

    def num_train_batches(self, batch_size: int, world: int) -> int:
        """Micro-batches per epoch per rank, the same on every rank (DDP steps in lock-step)."""

    def train_epoch(self, batch_size: int, *, rank: int, world: int, seed: int, epoch: int) -> Iterator[Batch]:
        """This rank's shuffled batches of one epoch (the order depends on `seed` and `epoch`)."""

    def eval_epoch(self, batch_size: int, *, rank: int, world: int) -> Iterator[Batch]:
        """This rank's share of the split, every row exactly once across ranks."""


class ArraySource:
    """Inputs and targets of one split in memory, normalized per batch on the way to the device.

    `mean` / `std` broadcast to one row (per channel (C, 1, 1), per feature (D,), or a scalar).
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, mean: Any, std: Any, device: torch.device):
        with warnings.catch_warnings():
            # object-store arrays are read-only; indexing below always copies
            warnings.simplefilter("ignore", UserWarning)
            self.x = torch.from_numpy(np.asarray(x))
            self.y = torch.from_numpy(np.asarray(y))
        self.mean = torch.as_tensor(np.asarray(mean, dtype=np.float32))
        self.std = torch.as_tensor(np.asarray(std, dtype=np.float32))
        self.device = device

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, index: torch.Tensor) -> Batch:
        x = (self.x[index].to(torch.float32) - self.mean) / self.std
        return x.to(self.device, non_blocking=True), self.y[index].to(self.device, non_blocking=True)

    def num_train_batches(self, batch_size: int, world: int) -> int:
        return num_train_batches(len(self), batch_size, world)

    def train_epoch(self, batch_size: int, *, rank: int, world: int, seed: int, epoch: int) -> Iterator[Batch]:
        for index in train_batches(len(self), batch_size, rank=rank, world=world, seed=seed, epoch=epoch):
            yield self.batch(index)

    def eval_epoch(self, batch_size: int, *, rank: int, world: int) -> Iterator[Batch]:
        for index in eval_batches(len(self), batch_size, rank=rank, world=world):
            yield self.batch(index)
