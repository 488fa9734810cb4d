"""Which epoch metrics a target kind reports, which way each improves, and the default one.

One table, read by the config checks (a `train.metric` the kind does not report is an
error naming the valid ones), early stopping, the lr plateau rule, checkpoint scoring and
Tune; the numbers themselves are computed by :mod:`cascade_ray.models.metrics`.
"""

from __future__ import annotations

import math

from cascade_ray.config.schema import PipelineConfig, StageConfig

# Validation metrics per target kind, without the `val_` prefix; `loss` is the stage's loss.
_KIND_METRICS = {
    "class": ("loss", "accuracy", "top5_accuracy"),
    "multilabel": ("loss", "micro_f1", "map"),
    "regression": ("loss", "mae", "rmse", "r2"),
}
_DEFAULT = {"class": "val_accuracy", "multilabel": "val_map", "regression": "val_loss"}
# the test metric a run is summed up by (the pipeline's last line, reports, export)
HEADLINE_METRIC = {"class": "accuracy", "multilabel": "map", "regression": "r2"}
_LOWER_IS_BETTER = ("loss", "mae", "rmse")
TOP5_MIN_CLASSES = 10  # top-5 accuracy is reported from this many classes up


def eval_metric_names(kind: str, num_classes: int | None = None) -> list[str]:
    """The evaluation metrics of `kind` (no prefix); top-5 only with >= 10 classes (None: unknown, listed)."""
    names = list(_KIND_METRICS[kind])
    if kind == "class" and num_classes is not None and num_classes < TOP5_MIN_CLASSES:
        names.remove("top5_accuracy")
    return names


def epoch_metric_names(kind: str, num_classes: int | None = None) -> list[str]:
    """What an epoch reports that a rule may watch: ``train_loss`` and the ``val_`` metrics."""
    return ["train_loss", *(f"val_{n}" for n in eval_metric_names(kind, num_classes))]


def metric_mode(name: str) -> str:
    """``min`` for losses and errors (``val_loss``, ``val_mae``, ``val_rmse``), ``max`` otherwise."""
    return "min" if name.rsplit("_", 1)[-1] in _LOWER_IS_BETTER or name.endswith("loss") else "max"


def rank(value: float | None, mode: str) -> tuple[bool, float]:
    """A sort key that puts the better of two values of a `mode` (max/min) metric first: finite
    values best first, then NaN, inf and missing ones (never better than a finite value). What a
    sweep's results table, its best trial and a batched sweep's best replica are ranked by."""
    if value is None or not math.isfinite(value):
        return True, 0.0
    return False, -value if mode == "max" else value


def checkpoint_metric(cfg: PipelineConfig, stage: StageConfig) -> str:
    """`stage.train.metric`, with ``auto`` resolved for the data's target kind."""
    metric = stage.train.metric
    return _DEFAULT[cfg.data.target.kind] if metric == "auto" else metric


def retention_metric(cfg: PipelineConfig, stage: StageConfig) -> tuple[str, str]:
    """(metric, mode) that rank a stage's checkpoints and pick its artifact: `stage.train.checkpoint`
    with its ``auto`` values resolved (the metric: :func:`checkpoint_metric`; the mode: the metric's direction)."""
    retention = stage.train.checkpoint
    metric = checkpoint_metric(cfg, stage) if retention.metric == "auto" else retention.metric
    return metric, metric_mode(metric) if retention.mode == "auto" else retention.mode
