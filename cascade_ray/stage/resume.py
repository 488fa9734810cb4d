"""Everything a restarted worker group needs to continue a stage exactly where it stopped.

Saved with every checkpoint (``trainer_state.pt``, read back with ``weights_only=True``):
optimizer, lr schedule, fp16 scaler, early-stopping and RNG state, the epoch and step
counters and the metric history. Restoring checks that the schedule's position agrees with
the optimizer step counter, so a run can never silently continue at the wrong step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from cascade_ray.errors import CascadeError
from cascade_ray.solver.schedule import LrSchedule
from cascade_ray.solver.step import Precision
from cascade_ray.solver.stopping import EarlyStopping

TRAINER_STATE = "trainer_state.pt"


def trainer_state(
    optimizer: torch.optim.Optimizer,
    scheduler: LrSchedule,
    precision: Precision,
    stopper: EarlyStopping,
    *,
    epochs_done: int,
    step: int,
    skipped: int,
    history: list[dict[str, float]],
    optimizer_state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The resumable state after `epochs_done` full epochs.

    `optimizer_state`: the full optimizer state of a sharded (fsdp) stage, keyed by parameter
    name (:func:`cascade_ray.stage.sharding.full_optimizer_state`); default ``optimizer.state_dict()``.
    """
    return {
        "epochs_done": epochs_done,
        "step": step,
        "skipped": skipped,
        "history": [dict(m) for m in history],
        "optimizer": optimizer_state if optimizer_state is not None else optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": precision.scaler.state_dict() if precision.scaler is not None else None,
        "stopper": {"best": stopper.best, "bad_epochs": stopper.bad_epochs},
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_trainer_state(
    state: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    scheduler: LrSchedule,
    precision: Precision,
    stopper: EarlyStopping,
    stage: str,
    load_optimizer: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[int, int, int, list[dict[str, float]]]:
    """Load :func:`trainer_state` into the solver pieces; return (start epoch, step, skipped, history).

    `load_optimizer` loads the optimizer state instead of ``optimizer.load_state_dict`` (a sharded stage).
    """
    (load_optimizer or optimizer.load_state_dict)(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if precision.scaler is not None and state["scaler"] is not None:
        precision.scaler.load_state_dict(state["scaler"])
    stopper.best, stopper.bad_epochs = state["stopper"]["best"], int(state["stopper"]["bad_epochs"])
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    step, skipped = int(state["step"]), int(state["skipped"])
    if scheduler.steps != step - skipped:
        raise CascadeError(
            f"stage {stage!r}: checkpoint is inconsistent: the lr schedule is at step {scheduler.steps}, but the "
            f"optimizer took {step} steps ({skipped} skipped by the fp16 scaler); resuming would continue at the "
            "wrong step. Retrain the stage (delete its Ray run folder or rerun without --resume)."
        )
    return int(state["epochs_done"]), step, skipped, list(state["history"])


def frozen_reference(
    state: Mapping[str, torch.Tensor], before: Mapping[str, str], now: Mapping[str, str]
) -> dict[str, str] | None:
    """The frozen entries a ``train.checkpoint.frozen: reference`` checkpoint names by digest instead
    of holding (key -> digest): those of `state` still as they were before training (`now` ==
    `before`). A drifted tensor stays in the file, so the driver's bit comparison with the upstream
    sees it, as with ``copy``. None when there are none."""
    kept = {k: d for k, d in now.items() if before.get(k) == d and k in state}
    return kept or None
