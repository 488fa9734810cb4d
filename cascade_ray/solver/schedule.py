"""Learning-rate schedules counted in optimizer steps.

The length of a schedule is the stage's real number of optimizer steps (epochs x
batches per rank, capped by ``max_steps``), computed here once, so a schedule can
neither end early nor stop short of decaying.
"""

from __future__ import annotations

import math

import torch

from cascade_ray.config.schema import SchedulerConfig, StageConfig
from cascade_ray.stage.batches import num_train_batches


def total_optimizer_steps(stage: StageConfig, n_train: int, world: int) -> int:
    """Optimizer steps the stage will take: epochs x batches per rank, capped by max_steps."""
    steps = stage.train.epochs * num_train_batches(n_train, stage.train.batch_size, world)
    return min(steps, stage.train.max_steps) if stage.train.max_steps is not None else steps


def lr_factor(cfg: SchedulerConfig, step: int, total: int) -> float:
    """Multiplier on the base lr at optimizer step `step` (0-based) of `total`."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.type == "constant":
        return 1.0
    span = max(1, total - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following :func:`lr_factor`; call ``.step()`` once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step, total))
