"""``cascade-ray lr-find``: an exponential learning-rate range test for one stage.

The stage's real model (upstream frozen), optimizer, parameter groups, loss (``loss.weights``
and uncertainty weighting included), precision and clipping come from the same
:func:`~cascade_ray.stage.setup.setup_stage` as ``run_stage``'s; then the lr grows geometrically from
`start_lr` to `end_lr`, one optimizer step per micro-batch (no accumulation), until the
smoothed loss exceeds `diverge` x its minimum. Every parameter group keeps its lr ratio
to ``solver.lr``. The suggestion is the lr of the steepest descent of the smoothed loss
(before its minimum), the usual "fastest still-stable learning" point.

    cascade-ray lr-find pipelines/configs/debug.yaml --stage features --out lr_find.png
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.data import DataSplits


@dataclass(frozen=True)
class LrFindResult:
    """The range test: lr and loss per step, and the suggestion.

    Attributes:
        lrs: the solver-level lr of every step.
        losses: the raw training loss of every step.
        smoothed: the bias-corrected exponential moving average of the loss.
        suggestion: lr at the steepest descent of the smoothed loss.
        min_loss_lr: lr at the smoothed loss's minimum (one tenth of it is the other common pick).
        diverged: True when the test stopped because the loss blew up.
    """

    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    suggestion: float
    min_loss_lr: float
    diverged: bool


def _endless_batches(n: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    from cascade_ray.data.batches import train_batches

    epoch = 0
    while True:
        yield from train_batches(n, batch_size, rank=0, world=1, seed=seed, epoch=epoch)
        epoch += 1


def lr_find(
    cfg: PipelineConfig,
    index: int,
    data: DataSplits,
    *,
    upstream: Mapping[str, np.ndarray] | None = None,
    device: torch.device | None = None,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    steps: int = 200,
    smoothing: float = 0.9,
    diverge: float = 4.0,
) -> LrFindResult:
    """Run the range test on stage `index` (see the module docstring)."""
    from cascade_ray.data.batches import ArraySource
    from cascade_ray.solver import clip_gradients
    from cascade_ray.stage.setup import setup_stage, stage_seed

    device = device or torch.device("cpu")
    # the stage's model, parameter groups, loss and precision, exactly as run_stage builds them;
    # its lr schedule is not used: the range test sets every group's lr itself
    setup = setup_stage(cfg, index, data, upstream, device)
    stage, solver, optimizer, precision = setup.stage, setup.stage.solver, setup.optimizer, setup.precision
    model, params = setup.model.train(), setup.params
    ratios = [base / solver.lr for base in setup.scheduler.base_lrs]  # each group's lr before any schedule
    source = ArraySource(data.x_train, data.y_train, data.mean, data.std, device)
    batches = _endless_batches(len(source), stage.train.batch_size, stage_seed(cfg, index))
    gamma = (end_lr / start_lr) ** (1.0 / max(1, steps - 1))
    lrs, losses, smoothed = [], [], []
    avg, best, diverged = 0.0, math.inf, False
    for k in range(steps):
        lr = start_lr * gamma**k
        for group, ratio in zip(optimizer.param_groups, ratios):
            group["lr"] = lr * ratio
        x, y = source.batch(next(batches))
        with precision.autocast():
            loss, _ = setup.loss(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        precision.backward(loss)
        precision.unscale(optimizer)
        clip_gradients(params, solver.grad_clip)
        precision.step(optimizer)
        value = float(loss.detach())
        if not math.isfinite(value):
            diverged = True
            break
        avg = smoothing * avg + (1.0 - smoothing) * value
        smooth = avg / (1.0 - smoothing ** (k + 1))
        lrs.append(lr)
        losses.append(value)
        smoothed.append(smooth)
        best = min(best, smooth)
        if k > 10 and smooth > diverge * best:
            diverged = True
            break
    suggestion, min_lr = suggest(lrs, smoothed)
    return LrFindResult(lrs, losses, smoothed, suggestion, min_lr, diverged)


def suggest(lrs: list[float], smoothed: list[float], skip: int = 5) -> tuple[float, float]:
    """(lr of the steepest descent before the minimum, lr of the minimum) of a smoothed loss curve."""
    if not lrs:
        return math.nan, math.nan
    low = int(np.argmin(smoothed))
    if low - skip < 2:
        return lrs[low] / 10.0, lrs[low]
    slope = np.gradient(np.asarray(smoothed[skip : low + 1]), np.log10(np.asarray(lrs[skip : low + 1])))
    return lrs[skip + int(np.argmin(slope))], lrs[low]


def plot_lr_find(result: LrFindResult, path: str | Path, title: str = "") -> Path:
    """Write loss vs lr (log scale) with the suggestion marked, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(result.lrs, result.losses, color="0.75", linewidth=0.8, label="loss")
    ax.plot(result.lrs, result.smoothed, color="C0", label="smoothed loss")
    ax.axvline(result.suggestion, color="C3", linestyle="--", label=f"suggested lr {result.suggestion:.2g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    if result.smoothed:
        ax.set_ylim(top=max(result.smoothed[0], min(result.smoothed)) * 1.5 if result.diverged else None)
    ax.set_title(title or "lr range test")
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
