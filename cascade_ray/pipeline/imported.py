"""Import-only stages (``train.epochs: 0``): pretrained weights become a stage artifact on the driver.

No Ray Train job runs. The driver builds the composed model up to the stage, loads the
upstream hand-off and the stage's mapped ``pretrained`` weights (checked: keys, shapes,
dtypes, NaN/Inf), freezes everything and evaluates the stage's own head on the validation
split, so the manifest's metrics are measured like a trained stage's. The stage's head (and
adapter) are not in the file: they keep their seeded fresh initialization, which the log
says; the next stage trains its own head on the imported module's outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.data import DataSplits
from cascade_ray.data.batches import ArraySource
from cascade_ray.data.splits import DataInfo
from cascade_ray.models.losses import build_loss
from cascade_ray.models.metrics import EvalMetrics
from cascade_ray.models.weights import NumpyState, to_numpy_state
from cascade_ray.stage.setup import build_stage_model


@dataclass(frozen=True)
class ImportedStage:
    """What importing a stage produced: the composed state and the measured validation metrics."""

    state: NumpyState
    metrics: dict[str, Any]
    frozen_params: int


def import_stage(
    cfg: PipelineConfig,
    index: int,
    data: DataSplits | DataInfo,
    upstream: NumpyState | None,
    *,
    log: Callable[[str], None] = print,
) -> ImportedStage:
    """Build, load and freeze stage `index` on the driver (CPU), and evaluate it on the val split.

    Args:
        cfg: the validated config; ``cfg.stages[index]`` has ``train.epochs: 0`` and ``pretrained``.
        data: the in-memory splits; streamed data (a :class:`DataInfo`) is not read, and the
            metrics are NaN (the log says so).
        upstream: the composed state of the stages before, or None for the first stage.
        log: where the notes go (dtype casts, keys left out by ``strict: false``, the fresh head).

    Raises:
        ConfigError: the pretrained file does not fit the module or holds NaN/Inf.
    """
    stage = cfg.stages[index]
    model, _ = build_stage_model(cfg, index, data, upstream, log=log)
    model.requires_grad_(False)
    model.eval()
    fresh = [f"heads.{stage.name}"] + ([f"adapters.{stage.name}"] if stage.name in model.adapters else [])
    log(
        f"  {stage.name}: imported {stage.pretrained.path if stage.pretrained else ''} into its module; "
        f"{' and '.join(fresh)} keep their fresh initialization (train.epochs: 0 trains nothing)"
    )
    if isinstance(data, DataSplits):
        metrics = _val_metrics(cfg, index, model, data)
    else:
        log(f"  {stage.name}: streamed data is not read on the driver; the imported stage's val metrics are NaN")
        metrics = {"val_loss": math.nan}
    return ImportedStage(
        state=to_numpy_state(model.state_dict()),
        metrics={**metrics, "epoch": 0},
        frozen_params=sum(p.numel() for p in model.parameters()),
    )


@torch.no_grad()
def _val_metrics(cfg: PipelineConfig, index: int, model: torch.nn.Module, data: DataSplits) -> dict[str, float]:
    """The stage's own head on the validation split: the ``val_`` metrics of the target kind."""
    stage = cfg.stages[index]
    source = ArraySource(data.x_val, data.y_val, data.mean, data.std, torch.device("cpu"))
    metrics = EvalMetrics(
        data.target_kind,
        data.out_width,
        build_loss(stage.loss, data.target_kind, training=False, trusted=cfg.trusted_modules),
    )
    for x, y in source.eval_epoch(stage.train.eval_batch_size, rank=0, world=1):
        metrics.update(model(x, heads=[stage.name])[stage.name], y)
    return metrics.compute(lambda v: v, prefix="val_")
