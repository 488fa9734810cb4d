"""Evaluation metrics per target kind, as sums that add up across DDP ranks.

Every metric is computed from sums (one ``all_sum`` per evaluation), so it is exact under
DDP whatever the shard sizes: class accuracy and top-5 accuracy; multilabel micro-F1 (at
a 0.5 probability threshold) and mAP; regression MAE, RMSE and R² (the mean of the
per-output R², like scikit-learn's ``uniform_average``). mAP is computed from per-class
score histograms with :data:`AP_BINS` equal-width probability bins (the binned average
precision torchmetrics computes with ``thresholds=1024``): exact up to ties within a bin.
Names (without the ``val_`` / ``test_`` prefix) follow :mod:`cascade_ray.config.metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from cascade_ray.config.metrics import TOP5_MIN_CLASSES

AP_BINS = 1024
AllSum = Callable[[list[float]], list[float]]


class EvalMetrics:
    """Accumulates one split's metrics batch by batch; :meth:`compute` sums over ranks once.

    Args:
        kind: ``class``, ``multilabel`` or ``regression``.
        width: output width (classes, or regression values per row).
        loss: the stage's evaluation loss (batch mean), summed here as ``loss * batch``.
    """

    def __init__(self, kind: str, width: int, loss: nn.Module):
        self.kind, self.width, self.loss = kind, width, loss
        self.count = 0
        self._sums: torch.Tensor | None = None  # on the outputs' device: no sync per batch

    def _add(self, parts: list[torch.Tensor]) -> None:
        flat = torch.cat([p.reshape(-1).to(torch.float64) for p in parts])
        self._sums = flat if self._sums is None else self._sums + flat

    @torch.no_grad()
    def update(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """Add one batch: `out` (B, width) raw outputs (logits), `y` the batch's targets."""
        out = out.float()
        b = len(y)
        self.count += b
        loss = self.loss(out, y).detach().reshape(1) * b
        if self.kind == "class":
            correct = (out.argmax(1) == y).sum().reshape(1)
            k = min(5, out.shape[1])
            top5 = (out.topk(k, dim=1).indices == y[:, None]).any(1).sum().reshape(1)
            self._add([loss, correct, top5])
        elif self.kind == "multilabel":
            prob, pos = torch.sigmoid(out), y > 0.5
            pred = prob >= 0.5
            tp, fp, fn = (pred & pos).sum(), (pred & ~pos).sum(), (~pred & pos).sum()
            bins = (prob * AP_BINS).long().clamp_(0, AP_BINS - 1) + torch.arange(
                self.width, device=out.device
            ) * AP_BINS
            size = self.width * AP_BINS
            hist_pos = torch.bincount(bins[pos], minlength=size)
            hist_neg = torch.bincount(bins[~pos], minlength=size)
            self._add([loss, tp.reshape(1), fp.reshape(1), fn.reshape(1), hist_pos, hist_neg])
        else:
            y = y.float().reshape(b, -1)
            err = out - y
            self._add([loss, err.abs().sum(0), err.square().sum(0), y.sum(0), y.square().sum(0)])

    def compute(self, all_sum: AllSum, prefix: str = "") -> dict[str, float]:
        """The metrics over every rank's batches (each rank must call it: it is a collective)."""
        size = {"class": 3, "multilabel": 4 + 2 * self.width * AP_BINS, "regression": 1 + 4 * self.width}[self.kind]
        local = self._sums.tolist() if self._sums is not None else [0.0] * size
        total = all_sum([float(self.count), *local])
        n, sums = total[0], total[1:]
        if not n:
            return {f"{prefix}{name}": math.nan for name in self.names()}
        values = {"loss": sums[0] / n} | _finish(self.kind, self.width, n, sums)
        return {f"{prefix}{name}": values[name] for name in self.names()}

    def names(self) -> list[str]:
        """The metric names this split reports (top-5 only from 10 classes up)."""
        if self.kind == "class":
            return ["loss", "accuracy"] + (["top5_accuracy"] if self.width >= TOP5_MIN_CLASSES else [])
        if self.kind == "multilabel":
            return ["loss", "micro_f1", "map"]
        return ["loss", "mae", "rmse", "r2"]


def _finish(kind: str, width: int, n: float, sums: list[float]) -> dict[str, float]:
    if kind == "class":
        return {"accuracy": sums[1] / n, "top5_accuracy": sums[2] / n}
    if kind == "multilabel":
        tp, fp, fn = sums[1:4]
        f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else math.nan
        hist = torch.tensor(sums[4:], dtype=torch.float64).reshape(2, width, AP_BINS)
        return {"micro_f1": f1, "map": _binned_map(hist[0], hist[1])}
    d = width
    abs_err, sq_err, sum_y, sum_y2 = (
        torch.tensor(sums[1 + i * d : 1 + (i + 1) * d], dtype=torch.float64) for i in range(4)
    )
    total_var = sum_y2 - sum_y.square() / n  # n * variance of each output
    r2 = torch.where(
        total_var > 0, 1.0 - sq_err / total_var.clamp_min(1e-300), torch.tensor(math.nan, dtype=torch.float64)
    )
    return {
        "mae": float(abs_err.sum() / (n * d)),
        "rmse": math.sqrt(float(sq_err.sum() / (n * d))),
        "r2": float(r2.nanmean()) if bool(torch.isfinite(r2).any()) else math.nan,
    }


def _binned_map(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """Mean over classes with a positive of the average precision from (classes, bins) counts."""
    tp = pos.flip(1).cumsum(1)  # from the highest score bin down
    fp = neg.flip(1).cumsum(1)
    precision = tp / (tp + fp).clamp_min(1.0)
    positives = pos.sum(1)
    has = positives > 0
    if not bool(has.any()):
        return math.nan
    ap = (precision * pos.flip(1)).sum(1)[has] / positives[has]
    return float(ap.mean())


def output_predictions(out: torch.Tensor, kind: str) -> torch.Tensor:
    """Predictions from raw outputs: the argmax class, the flags with probability >= 0.5, or the values."""
    if kind == "class":
        return out.argmax(1)
    if kind == "multilabel":
        return (torch.sigmoid(out) >= 0.5).to(torch.float32)
    return out.float()


def output_probabilities(out: torch.Tensor, kind: str) -> torch.Tensor | None:
    """Class probabilities (softmax), per-label probabilities (sigmoid), or None for regression."""
    if kind == "class":
        return torch.softmax(out.float(), dim=1)
    if kind == "multilabel":
        return torch.sigmoid(out.float())
    return None
