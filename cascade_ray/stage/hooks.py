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
    from cascade_ray.models.cascade import CascadeModel
    from cascade_ray.models.freeze import TrainablePlan
    from cascade_ray.solver.schedule import LrSchedule
    from cascade_ray.solver.step import Precision, ScalerFactory
    from cascade_ray.stage.monitor import HealthMonitor


@dataclass(kw_only=True)
class LoopState:
    """What the stage loop exposes to hooks, updated in place (built with keywords only).

    Attributes:
        stage: the stage's config; index: its position.
        model: the composed model (unwrapped); net: what forward runs on (DDP or the model).
        plan: what the stage trains and what is frozen.
        named_params: the trainable (name, parameter) pairs, in optimizer order.
        optimizer, scheduler, precision, monitor: the stage's solver pieces.
        epoch: 0-based epoch; step: optimizer steps taken so far.
        loss: the last micro-batch's loss (before division by the window size).
        rank, world: this worker's rank and the worker count.
        total_steps: optimizer steps the stage plans (all epochs).
        row: the latest per-step metrics row (rank 0, every ``train.log_interval`` steps).
        metrics: the latest epoch's metrics (every rank, after its validation).
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
    rank: int = 0
    world: int = 1
    total_steps: int = 0
    row: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


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
        on_log: rank 0, every ``train.log_interval`` optimizer steps, with ``state.row`` set;
            None prints the progress line (a driver-side progress board replaces it).
        on_row: rank 0, with each new ``state.row`` (before ``on_log``); unlike ``on_log``, every
            chained callback runs (live trackers, :mod:`cascade_ray.tracking`).
        on_epoch: every rank, after an epoch's validation, with ``state.metrics`` set.
    """

    on_setup: Callable[[LoopState], Any] = _noop
    after_backward: Callable[[LoopState], Any] = _noop
    before_optimizer_step: Callable[[LoopState], Any] = _noop
    after_optimizer_step: Callable[[LoopState], Any] = _noop
    make_scaler: ScalerFactory | None = None
    on_log: Callable[[LoopState], Any] | None = None
    on_row: Callable[[LoopState], Any] = _noop
    on_epoch: Callable[[LoopState], Any] = _noop


_EVENTS = ("on_setup", "after_backward", "before_optimizer_step", "after_optimizer_step", "on_row", "on_epoch")


def chain_hooks(*hooks: LoopHooks) -> LoopHooks:
    """One :class:`LoopHooks` running each event's callbacks in the order given.

    ``make_scaler`` and ``on_log`` are single slots: the last one set wins.
    """

    def run_all(callbacks: list[Callable[[LoopState], Any]]) -> Callable[[LoopState], Any]:
        if not callbacks:
            return _noop
        if len(callbacks) == 1:
            return callbacks[0]  # no wrapper on the per-step path

        def run(state: LoopState) -> None:
            for callback in callbacks:
                callback(state)

        return run

    events = {name: run_all([getattr(h, name) for h in hooks if getattr(h, name) is not _noop]) for name in _EVENTS}
    scalers = [h.make_scaler for h in hooks if h.make_scaler is not None]
    logs = [h.on_log for h in hooks if h.on_log is not None]
    return LoopHooks(**events, make_scaler=scalers[-1] if scalers else None, on_log=logs[-1] if logs else None)
