"""The training loop of one stage, readable top to bottom.

``run_stage`` knows nothing about Ray: a :class:`Reporter` carries metrics and
checkpoints out and does cross-rank sums, so the same loop runs under Ray Train
(:mod:`cascade_ray.stage.worker`) and in-process in tests and tools.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cascade_ray.config.schema import PipelineConfig, StageConfig
from cascade_ray.data import DataSplits
from cascade_ray.models.cascade import CascadeModel, build_cascade, module_stage_names
from cascade_ray.preflight import require_plans
from cascade_ray.solver import build_optimizer
from cascade_ray.solver.schedule import build_scheduler, total_optimizer_steps
from cascade_ray.stage.batches import ArraySource, augment, eval_batches, train_batches
from cascade_ray.stage.freeze import TrainablePlan, apply_freeze, check_frozen, frozen_digest, plan_trainable
from cascade_ray.stage.weights import load_numpy_state, load_state_file


class Reporter(Protocol):
    """Where a stage loop sends its results (Ray Train, or a list in tests)."""

    rank: int
    world: int

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks."""

    def report(self, metrics: dict[str, float], state: Mapping[str, torch.Tensor] | None) -> None:
        """Publish one epoch's metrics; rank 0 passes the model state to checkpoint."""


@dataclass(frozen=True)
class StageOutcome:
    """What rank 0 returns to the driver."""

    trainable_params: int
    frozen_params: int
    frozen_digest: dict[str, str]
    steps: int
    world_size: int
    history: list[dict[str, float]]


def stage_seed(cfg: PipelineConfig, index: int) -> int:
    """Seed of stage `index`: distinct per stage, fixed by the pipeline seed."""
    return cfg.seed * 1009 + index


def build_stage_model(cfg: PipelineConfig, index: int, data: DataSplits, upstream: Mapping[str, np.ndarray] | None) -> tuple[CascadeModel, TrainablePlan]:
    """The composed model for stage `index` with upstream weights loaded and frozen."""
    plans = require_plans(cfg, data.image_shape, data.num_classes)
    torch.manual_seed(stage_seed(cfg, index))
    model = build_cascade(cfg, plans, data.num_classes, upto=index)
    stage = cfg.stages[index]
    if stage.pretrained is not None:
        model.blocks[stage.name].load_state_dict(load_state_file(stage.pretrained))
    if upstream is not None:
        own = {k for k in model.state_dict() if k.split(".")[1] == stage.name}
        missing, unexpected = _load_upstream(model, upstream)
        if set(missing) != own or unexpected:
            raise RuntimeError(f"upstream weights do not fit stage {stage.name!r}: missing {sorted(set(missing) - own)[:5]}, unexpected {unexpected[:5]}")
    plan = plan_trainable(model, cfg, index)
    apply_freeze(model, plan)
    return model, plan


def _load_upstream(model: nn.Module, upstream: Mapping[str, np.ndarray]) -> tuple[list[str], list[str]]:
    keys = set(model.state_dict())
    load_numpy_state(model, {k: v for k, v in upstream.items() if k in keys}, strict=False)
    missing = [k for k in keys if k not in upstream]
    return missing, [k for k in upstream if k not in keys]


def run_stage(cfg: PipelineConfig, index: int, data: DataSplits, upstream: Mapping[str, np.ndarray] | None, reporter: Reporter, device: torch.device, wrap=None) -> StageOutcome:
    """Train stage `index` on top of the frozen `upstream` weights.

    Args:
        cfg: the validated pipeline config.
        index: which stage to train.
        data: the splits (arrays may be read-only object-store views).
        upstream: numpy state dict of every earlier stage, or None for the first.
        reporter: receives per-epoch metrics and checkpoints.
        device: where to train.
        wrap: optional callable that wraps the model for distributed training (DDP).
    """
    stage = cfg.stages[index]
    model, plan = build_stage_model(cfg, index, data, upstream)
    model.to(device)
    digest = frozen_digest(model, plan)
    params = [p for p in model.parameters() if p.requires_grad]
    log_vars = nn.Parameter(torch.zeros(len(model.order), device=device)) if stage.loss.weighting == "uncertainty" else None
    optimizer = build_optimizer(params + ([log_vars] if log_vars is not None else []), stage.solver)
    total_steps = total_optimizer_steps(stage, len(data.y_train), reporter.world)
    scheduler = build_scheduler(optimizer, stage.solver.lr_scheduler, total_steps)
    net = wrap(model) if wrap is not None else model
    train_src = ArraySource(data.x_train, data.y_train, data.mean, data.std, device)
    val_src = ArraySource(data.x_val, data.y_val, data.mean, data.std, device)
    heads = module_stage_names(cfg, index) if stage.type == "joint" else [stage.name]
    scales = {n: cfg.stages[cfg.stage_index(n)].loss.scale for n in heads}
    step, stop, history = 0, False, []
    for epoch in range(stage.train.epochs):
        model.train()
        started, seen, loss_sum = time.perf_counter(), 0, torch.zeros(len(heads) + 1, device=device)
        for batch in train_batches(len(train_src), stage.train.batch_size, rank=reporter.rank, world=reporter.world, seed=stage_seed(cfg, index), epoch=epoch):
            x, y = train_src.batch(batch)
            if stage.train.augment.enabled:
                x = augment(x, stage.train.augment)
            terms = [F.cross_entropy(out, y, label_smoothing=stage.loss.label_smoothing) for out in net(x, heads=heads).values()]
            loss = _combine(terms, [scales[n] for n in heads], log_vars)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            seen += len(y)
            loss_sum += torch.stack([loss.detach(), *[t.detach() for t in terms]]) * len(y)
            if reporter.rank == 0 and step % stage.train.log_interval == 0:
                print(f"[{stage.name}] epoch {epoch + 1}/{stage.train.epochs} step {step} loss {loss.item():.4f}", flush=True)
            if stage.train.max_steps is not None and step >= stage.train.max_steps:
                stop = True
                break
        train_s = time.perf_counter() - started
        sums = reporter.all_sum([float(seen), *loss_sum.tolist()])
        metrics = {"epoch": epoch + 1, "step": step, "train_loss": sums[1] / sums[0], "lr": scheduler.get_last_lr()[0], "samples_per_s": sums[0] / train_s}
        if stage.type == "joint":
            metrics |= {f"loss/{n}": sums[2 + i] / sums[0] for i, n in enumerate(heads)}
        metrics |= evaluate(model, val_src, heads[-1], stage, reporter, prefix="val_")
        check_frozen(digest, frozen_digest(model, plan), stage.name)
        history.append(metrics)
        reporter.report(metrics, model.state_dict() if reporter.rank == 0 else None)
        if stop:
            break
    trainable = sum(p.numel() for p in params)
    return StageOutcome(trainable, sum(p.numel() for p in model.parameters()) - trainable, digest, step, reporter.world, history)


def _combine(terms: list[torch.Tensor], scales: list[float], log_vars: torch.Tensor | None) -> torch.Tensor:
    if log_vars is None:
        return sum(s * t for s, t in zip(scales, terms))  # type: ignore[return-value]
    # learned uncertainty weighting: exp(-s_i) * scale_i * L_i + s_i
    return sum(torch.exp(-log_vars[i]) * s * t + log_vars[i] for i, (s, t) in enumerate(zip(scales, terms)))  # type: ignore[return-value]


@torch.no_grad()
def evaluate(model: CascadeModel, source: ArraySource, head: str, stage: StageConfig, reporter: Reporter, prefix: str) -> dict[str, float]:
    """Loss and accuracy of `head` over a split, summed across ranks."""
    was_training = model.training
    model.eval()
    loss, correct, count = 0.0, 0.0, 0.0
    for batch in eval_batches(len(source), stage.train.eval_batch_size, rank=reporter.rank, world=reporter.world):
        x, y = source.batch(batch)
        logits = model(x, heads=[head])[head]
        loss += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        count += len(y)
    model.train(was_training)
    loss, correct, count = reporter.all_sum([loss, correct, count])
    return {f"{prefix}loss": loss / count if count else math.nan, f"{prefix}accuracy": correct / count if count else math.nan}
