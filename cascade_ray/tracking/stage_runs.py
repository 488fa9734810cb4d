"""The loggers rank 0 of a stage fit opens, from ``loggers:`` and the driver's :class:`TrackingContext`."""

from __future__ import annotations

from collections.abc import Callable

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.tracking import Logger, Loggers, TrackingContext, flatten, open_guarded, run_label


def open_stage_loggers(
    cfg: PipelineConfig,
    index: int,
    context: TrackingContext,
    nodes: list[str],
    warn: Callable[[str], None] = print,
) -> Loggers:
    """Every configured logger of stage `index`, each opened behind the one-warning guard.

    MLflow and W&B runs are opened only when the driver's pipeline run opened (its id / group is
    in `context`): a server the driver could not use is reported there, once.
    """
    loggers_cfg, stage = cfg.loggers, cfg.stages[index]
    where = f"[{run_label(stage.name, context.trial)}] tracking"
    params = flatten(stage.model_dump(mode="json"))
    tags = {
        "cascade.pipeline": cfg.name,
        "cascade.stage": stage.name,
        "cascade.stage_index": str(index),
        "cascade.fingerprint": context.fingerprint or "",
        "cascade.nodes": ",".join(nodes),
        "cascade.world_size": str(len(nodes)),
        **({"cascade.trial_id": context.trial} if context.trial is not None else {}),
    }
    opened: list[Logger | None] = []
    if loggers_cfg.tensorboard:

        def tensorboard() -> Logger:
            from cascade_ray.tracking.tensorboard_live import TensorBoardLogger, tensorboard_dir

            return TensorBoardLogger(tensorboard_dir(context.run_dir, stage.name, context.trial))

        opened.append(open_guarded(tensorboard, "tensorboard", where, warn))
    settings = loggers_cfg.mlflow
    if settings is not None and context.mlflow_parent is not None:
        parent, experiment = context.mlflow_parent, context.mlflow_experiment or "0"

        def mlflow() -> Logger:
            from cascade_ray.tracking.mlflow_runs import MlflowStageLogger

            return MlflowStageLogger(
                settings.tracking_uri, experiment, parent, run_label(stage.name, context.trial), params, tags
            )

        opened.append(open_guarded(mlflow, "mlflow", where, warn))
    wandb_cfg = loggers_cfg.wandb
    if wandb_cfg is not None and context.wandb_group is not None:
        group = context.wandb_group

        def wandb() -> Logger:
            from cascade_ray.tracking.wandb_runs import WandbStageLogger

            return WandbStageLogger(
                wandb_cfg,
                context.run_dir,
                name=run_label(stage.name, context.trial),
                group=group,
                job_type="trial" if context.trial is not None else "stage",
                config={**params, **tags},
                tags=[stage.name],
            )

        opened.append(open_guarded(wandb, "wandb", where, warn))
    return Loggers([lg for lg in opened if lg is not None], where, warn)
