"""What a pipeline run watches on its stage workers: progress pushes, log level, profiling, trackers.

The driver side (:func:`observer_config`, called by ``fit_stage``) puts four keys into the
train loop config; the worker side (:func:`observer_hooks`) turns them into loop hooks. The
``tracking`` key holds the driver's :class:`~cascade_ray.tracking.TrackingContext` (MLflow
parent run, W&B group); rank 0 opens the ``loggers:`` of the stage from it.
Neither needs the other to exist: ``run_stage`` in-process (tests, benchmarks, diagnose)
runs without any of it, and a Tune trial's workers get no board and print as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.options import RunOptions
from cascade_ray.stage.hooks import LoopHooks, LoopState, chain_hooks
from cascade_ray.stage.profiler import StepProfiler, trace_path_for
from cascade_ray.stage.progress import ProgressHook, send_note
from cascade_ray.tracking import TrackingContext


def _quiet(state: LoopState) -> None:
    return None


def observer_config(
    cfg: PipelineConfig,
    index: int,
    run_dir: Any,
    options: RunOptions,
    board: Any,
    tracking: TrackingContext | None = None,
) -> dict[str, Any]:
    """The observing keys of stage `index`'s train loop config (driver side).

    `board` is the run's progress board handle (``None``: no display, e.g. a Tune trial);
    `tracking` the pipeline run's tracking context (``None``: no live loggers).
    """
    return {
        "progress": [board] if board is not None else [],  # inside a list: Ray passes the handle as is
        "log_level": options.log_level,
        "profile": trace_path_for(cfg.stages[index].name, run_dir, options.profile),
        "tracking": tracking.to_dict() if tracking is not None and cfg.loggers.any else None,
    }


def observer_hooks(
    loop_config: Mapping[str, Any],
    cfg: PipelineConfig,
    index: int,
    rank: int,
    world: int,
    device: torch.device,
    nodes: list[str] | None = None,
) -> tuple[LoopHooks, Callable[[bool], None]]:
    """Hooks for this worker, and what to call when the stage ends (with ``failed``).

    `nodes`: the worker group's node ids, one per rank (tags of the tracking runs).
    """
    stage = cfg.stages[index]
    board = (loop_config.get("progress") or [None])[0]
    hooks: list[LoopHooks] = []
    if rank == 0 and board is not None:
        samples = stage.train.batch_size * stage.solver.accumulation_steps * world
        progress = ProgressHook(
            board,
            stage=stage.name,
            index=index,
            stages=len(cfg.stages),
            epochs=stage.train.epochs,
            samples_per_step=samples,
        )
        hooks.append(LoopHooks(after_optimizer_step=progress, on_log=_quiet))  # the driver shows progress
    elif loop_config.get("log_level") == "warning" or (
        loop_config.get("trial") and loop_config.get("log_level") != "debug"
    ):  # a Tune trial's step lines: only with --log-level debug (the sweep's board shows each trial's epochs)
        hooks.append(LoopHooks(on_log=_quiet))
    profiler = None
    if rank == 0 and loop_config.get("profile"):
        profiler = StepProfiler(loop_config["profile"], device, stage.name, where=_where())
        hooks.append(profiler.hooks())

    trackers = None
    if rank == 0 and loop_config.get("tracking"):
        from cascade_ray.tracking.stage_runs import open_stage_loggers  # imports a tracker only when configured

        context = TrackingContext.from_dict(loop_config["tracking"])
        trackers = open_stage_loggers(cfg, index, context, nodes or [])
        hooks.append(
            LoopHooks(
                on_row=lambda s: trackers.log("step", s.row or {}),
                on_epoch=lambda s: trackers.log("epoch", s.metrics or {}),
            )
        )

    def finish(failed: bool = False) -> None:
        if trackers is not None:
            trackers.close(failed)
        if profiler is not None:
            send_note(board, profiler.finish())

    return chain_hooks(*hooks), finish


def _where() -> str:
    """Which node wrote the trace (it is a local file there)."""
    try:
        import ray

        return f" [node {ray.util.get_node_ip_address()}]"
    except Exception:  # noqa: BLE001
        return ""
