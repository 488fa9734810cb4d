"""Batches from in-memory arrays: a distributed sampler over indices, then one slice per batch.

Slicing whole batches out of the (shared, read-only) numpy arrays avoids the per-sample
collate of a ``DataLoader`` over a ``TensorDataset``, which dominates step time for
small images on CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DistributedSampler


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
