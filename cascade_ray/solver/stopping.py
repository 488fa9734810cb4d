"""Early stopping on an epoch metric (``stages[i].train.early_stopping``)."""

from __future__ import annotations

import math

from cascade_ray.config.metrics import metric_mode
from cascade_ray.config.schema import EarlyStoppingConfig


class EarlyStopping:
    """Counts epochs without improvement of one metric; :meth:`update` says when to stop."""

    def __init__(self, cfg: EarlyStoppingConfig | None):
        self.cfg = cfg
        self.best: float | None = None
        self.bad_epochs = 0
        if cfg is not None:
            self.mode = cfg.mode or metric_mode(cfg.metric)

    def update(self, metrics: dict[str, float]) -> bool:
        """Record one epoch's metrics; True when the stage should stop now."""
        if self.cfg is None:
            return False
        value = metrics[self.cfg.metric]
        if math.isnan(value):
            return False
        gain = (value - self.best if self.mode == "max" else self.best - value) if self.best is not None else math.inf
        if gain > self.cfg.min_delta:
            self.best, self.bad_epochs = value, 0
            return False
        self.bad_epochs += 1
        return self.bad_epochs >= self.cfg.patience

    def reason(self) -> str:
        """Why the stage stopped, for the log."""
        assert self.cfg is not None
        return f"early stopping: {self.cfg.metric} did not improve by more than {self.cfg.min_delta} for {self.bad_epochs} epoch(s) (best {self.best:.4g})"
