"""Callbacks into ``run_stage``, for tools (``diagnose``) and failure simulations (tests).

Hooks see a :class:`LoopState` that the loop updates in place. A healthy run never
needs them; ``cascade-ray diagnose`` uses them to tabulate gradients and updates per
module, and the pitfall suite (``tests/pitfalls``) uses them to reproduce bugs a
config cannot express:

- a scheduler stepped per micro-batch: ``LoopHooks(after_backward=lambda s: s.scheduler.step())``;
- fp16 loss-scale collapse on CPU: ``make_scaler`` returns ``torch.amp.GradScaler("cpu")``
  and ``after_backward`` writes ``inf`` into a gradient;
- BatchNorm of a frozen stage left in train mode: ``on_setup`` calls
  ``s.model.set_frozen_modules([])``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from cascade_ray.config.schema import StageConfig
    from cascade_ray.health.monitor import HealthMonitor
    from cascade_ray.models.cascade import CascadeModel
    from cascade_ray.solver.schedule import LrSchedule
    from cascade_ray.solver.step import Precision, ScalerFactory
    from cascade_ray.stage.freeze import TrainablePlan


@dataclass
class LoopState:
    """What the stage loop exposes to hooks, updated in place.

    Attributes:
        stage: the stage's config; index: its position.
        model: the composed model (unwrapped); net: what forward runs on (DDP or the model).
        plan: what the stage trains and what is frozen.
        named_params: the trainable (name, parameter) pairs, in optimizer order.
        optimizer, scheduler, precision, monitor: the stage's solver pieces.
        epoch: 0-based epoch; step: optimizer steps taken so far.
        loss: the last micro-batch's loss (before division by the window size).
    """

    stage: StageConfig
    index: int
    model: CascadeModel
    net: nn.Module
    plan: TrainablePlan
    named_params: list[tuple[str, nn.Parameter]]
    optimizer: torch.optim.Optimizer
    scheduler: LrSchedule
    precision: Precision
    monitor: HealthMonitor
    epoch: int = 0
    step: int = 0
    loss: torch.Tensor | None = None


def _noop(state: LoopState) -> Any:
    return None


@dataclass(frozen=True)
class LoopHooks:
    """Optional callbacks; each receives the :class:`LoopState`.

    Attributes:
        on_setup: once, after model, optimizer, schedule and precision are built.
        after_backward: after every micro-batch's backward (fp16 gradients still scaled).
        before_optimizer_step: once per window: gradients complete and unscaled, not yet clipped.
        after_optimizer_step: after the optimizer (and schedule) step; gradients are zeroed.
        make_scaler: replaces the CUDA GradScaler under fp16 (lifts the CUDA requirement).
    """

    on_setup: Callable[[LoopState], Any] = _noop
    after_backward: Callable[[LoopState], Any] = _noop
    before_optimizer_step: Callable[[LoopState], Any] = _noop
    after_optimizer_step: Callable[[LoopState], Any] = _noop
    make_scaler: ScalerFactory | None = None
