"""Solver checks: at config time (no data), and once the training-set size is known.

:func:`stage_solver_issues` runs with every config validation. Lengths in optimizer steps
(``T_max``, ``total_steps``, ``step_size``, ``milestones``, ``warmup_steps``) can only be
compared with the real step count once the number of training samples is known:
:func:`step_count_issues` takes it and returns ``(errors, warnings)``; the driver calls it
right after loading the data (before Ray starts) and ``run_stage`` calls
:func:`stage_step_issues` for its own stage before building anything.
"""

from __future__ import annotations

from cascade_ray.config.metrics import metric_mode
from cascade_ray.config.schema import MAX_OPTIMIZER_STEPS, PipelineConfig, StageConfig
from cascade_ray.data.batches import num_optimizer_steps, num_train_batches
from cascade_ray.errors import ConfigIssue
from cascade_ray.solver.optim import solver_issues
from cascade_ray.solver.schedule import total_optimizer_steps
from cascade_ray.solver.step import precision_issues

# An explicit length off from the real step count by more than this factor is an error.
LENGTH_ERROR_FACTOR = 2.0
# A micro-batch this many times the whole training split is a mistake, not a small dataset.
BATCH_ERROR_FACTOR = 16


def stage_solver_issues(stage: StageConfig, path: str) -> list[ConfigIssue]:
    """Config-time problems of a stage's solver, precision and training-loop keys."""
    issues = solver_issues(stage.solver, f"{path}.solver") + precision_issues(stage, f"{path}.solver")
    stop = stage.train.early_stopping
    if stop is not None and stop.mode is not None:
        natural = metric_mode(stop.metric)
        if stop.mode != natural:
            issues.append(
                ConfigIssue(
                    f"{path}.train.early_stopping.mode",
                    f"{stop.metric} improves by going {'up' if natural == 'max' else 'down'}, but mode is {stop.mode!r}",
                    f"set mode: {natural}, or remove it (inferred from the metric)",
                )
            )
    return issues


def step_count_issues(cfg: PipelineConfig, n_train: int) -> tuple[list[ConfigIssue], list[ConfigIssue]]:
    """Step-count checks of every stage, given the number of training samples.

    Args:
        cfg: the validated pipeline config.
        n_train: samples in the training split (``len(data.y_train)``).

    Returns:
        ``(errors, warnings)``: raise ``ConfigError(errors)`` when there are errors; print warnings.
    """
    errors: list[ConfigIssue] = []
    warnings: list[ConfigIssue] = []
    for i, stage in enumerate(cfg.stages):
        if stage.train.epochs == 0:
            continue  # an import-only stage takes no optimizer step: nothing to check
        e, w = stage_step_issues(stage, i, n_train, stage.scaling.num_workers)
        errors += e
        warnings += w
    return errors, warnings


def stage_step_issues(
    stage: StageConfig, index: int, n_train: int, world: int
) -> tuple[list[ConfigIssue], list[ConfigIssue]]:
    """:func:`step_count_issues` for one stage trained by `world` ranks."""
    path = f"stages[{index}]"
    sched = stage.solver.lr_scheduler
    accum = stage.solver.accumulation_steps
    total = total_optimizer_steps(stage, n_train, world)
    micro = num_train_batches(n_train, stage.train.batch_size, world)
    per_epoch = num_optimizer_steps(n_train, stage.train.batch_size, world, accum)
    how = (
        f"{stage.train.epochs} epoch(s) x {per_epoch} optimizer steps ({n_train} samples, batch_size {stage.train.batch_size}, "
        f"{world} worker(s), accumulation_steps {accum})"
        + (
            f", capped by max_steps {stage.train.max_steps}"
            if stage.train.max_steps is not None and stage.train.max_steps < stage.train.epochs * per_epoch
            else ""
        )
    )
    main = total - sched.warmup_steps
    errors: list[ConfigIssue] = []
    warnings: list[ConfigIssue] = []
    errors += _size_errors(stage, path, n_train, world, total, how)
    warnings += _size_warnings(stage, path, n_train, world)

    def length(key: str, value: int | None, what: str) -> None:
        if value is None or value == main:
            return
        ratio = value / max(1, main)
        issue = ConfigIssue(
            f"{path}.solver.lr_scheduler.{key}",
            f"{key} {value} optimizer steps, but the stage takes {main} optimizer steps after warmup ({how}): {what} {ratio:.3g}x of the run",
            f"remove {key} (auto = the real step count, {main}), or set {key}: {main}",
        )
        (errors if ratio > LENGTH_ERROR_FACTOR or ratio < 1 / LENGTH_ERROR_FACTOR else warnings).append(issue)

    if sched.warmup_steps >= total:
        errors.append(
            ConfigIssue(
                f"{path}.solver.lr_scheduler.warmup_steps",
                f"warmup_steps {sched.warmup_steps} >= the stage's {total} optimizer steps ({how}): the lr never reaches its planned value",
                f"set warmup_steps below {total}, e.g. {max(0, total // 10)}",
            )
        )
        return errors, warnings
    if sched.type in ("CosineAnnealingLR", "cosine"):
        length("T_max", sched.T_max, "the cosine spans")
    elif sched.type == "OneCycleLR":
        length("total_steps", sched.total_steps, "the cycle spans")
    elif sched.type == "StepLR" and sched.step_size is not None and sched.step_size >= main:
        issue = ConfigIssue(
            f"{path}.solver.lr_scheduler.step_size",
            f"step_size {sched.step_size} >= the stage's {main} optimizer steps after warmup ({how}): the lr never decays",
            f"set step_size below {main}, e.g. {max(1, main // 3)}",
        )
        (errors if sched.step_size > LENGTH_ERROR_FACTOR * main else warnings).append(issue)
    elif sched.type == "MultiStepLR" and sched.milestones:
        late = [m for m in sched.milestones if m >= main]
        if late:
            issue = ConfigIssue(
                f"{path}.solver.lr_scheduler.milestones",
                f"milestones {late} are at or past the stage's {main} optimizer steps after warmup ({how}): they are never reached",
                f"use milestones below {main}",
            )
            (errors if min(sched.milestones) > LENGTH_ERROR_FACTOR * main else warnings).append(issue)
    elif sched.type == "ReduceLROnPlateau" and sched.patience >= stage.train.epochs:
        warnings.append(
            ConfigIssue(
                f"{path}.solver.lr_scheduler.patience",
                f"patience {sched.patience} epochs >= train.epochs {stage.train.epochs}: the lr is never reduced",
                "lower patience or train more epochs",
            )
        )
    stop = stage.train.early_stopping
    if stop is not None and stop.patience >= stage.train.epochs:
        warnings.append(
            ConfigIssue(
                f"{path}.train.early_stopping.patience",
                f"patience {stop.patience} epochs >= train.epochs {stage.train.epochs}: early stopping never triggers",
                "lower patience or train more epochs",
            )
        )
    if accum > micro:
        warnings.append(
            ConfigIssue(
                f"{path}.solver.accumulation_steps",
                f"accumulation_steps {accum} > the {micro} micro-batches per epoch: each epoch is a single, partial window",
                f"set accumulation_steps to at most {micro}",
            )
        )
    if stage.health.interval > total:
        warnings.append(
            ConfigIssue(
                f"{path}.health.interval",
                f"interval {stage.health.interval} > the stage's {total} optimizer steps: gradient norm and update ratio are never measured",
                f"set health.interval below {total}",
            )
        )
    return errors, warnings


def _size_errors(stage: StageConfig, path: str, n_train: int, world: int, total: int, how: str) -> list[ConfigIssue]:
    """Sizes that are certainly mistakes once the training-set size is known."""
    errors = []
    if total > MAX_OPTIMIZER_STEPS:
        errors.append(
            ConfigIssue(
                f"{path}.train.epochs",
                f"the stage would take {total} optimizer steps ({how}), over the bound of {MAX_OPTIMIZER_STEPS}",
                "lower train.epochs, or set train.max_steps",
            )
        )
    if stage.train.batch_size > BATCH_ERROR_FACTOR * n_train:
        errors.append(
            ConfigIssue(
                f"{path}.train.batch_size",
                f"batch_size {stage.train.batch_size} is over {BATCH_ERROR_FACTOR}x the {n_train} training samples",
                f"set batch_size to at most {n_train}",
            )
        )
    return errors


def _size_warnings(stage: StageConfig, path: str, n_train: int, world: int) -> list[ConfigIssue]:
    per_rank = -(-n_train // world)
    if per_rank < stage.train.batch_size <= BATCH_ERROR_FACTOR * n_train:
        return [
            ConfigIssue(
                f"{path}.train.batch_size",
                f"batch_size {stage.train.batch_size} > the {per_rank} training samples per worker: every epoch is one partial batch",
                f"set batch_size to at most {per_rank}",
            )
        ]
    return []
