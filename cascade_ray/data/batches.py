"""Batches from in-memory arrays: a distributed sampler over indices, then one slice per batch.

Slicing whole batches out of the (shared, read-only) numpy arrays avoids the per-sample
collate of a ``DataLoader`` over a ``TensorDataset``, which dominates step time for
small images on CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import TypeVar

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


def accumulation_windows(batches: Sequence[T], steps: int) -> Iterator[tuple[T, int, bool]]:
    """Yield ``(micro_batch, window_size, is_last_in_window)`` over one epoch's micro-batches.

    Windows hold `steps` micro-batches; the epoch's last window holds what is left, so
    its loss is divided by its own size and no micro-batch is dropped or carried over.
    """
    n = len(batches)
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


class ArraySource:
    """Images and labels of one split, normalized per batch on the way to the device."""

    def __init__(self, x: np.ndarray, y: np.ndarray, mean: float, std: float, device: torch.device):
        with warnings.catch_warnings():
            # object-store arrays are read-only; indexing below always copies
            warnings.simplefilter("ignore", UserWarning)
            self.x = torch.from_numpy(np.asarray(x))
            self.y = torch.from_numpy(np.asarray(y))
        self.mean, self.std, self.device = float(mean), float(std), device

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (self.x[index].to(torch.float32) - self.mean) / self.std
        return x.to(self.device, non_blocking=True), self.y[index].to(self.device, non_blocking=True)
