"""PNG figures of a run: per-stage training curves, and the composed model's confusion matrix
(class targets) or predicted-vs-true scatter (regression)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

# (metric, title) per panel; a panel whose metric a stage never reported is left out
_PANELS = (
    ("loss", "loss"),
    ("val_accuracy", "validation accuracy"),
    ("val_map", "validation mAP"),
    ("val_r2", "validation R²"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm"),
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def _points(rows: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    """(xs, ys) of the rows where `y` is a finite number."""
    pairs = [(r[x], r[y]) for r in rows if isinstance(r.get(y), (int, float)) and math.isfinite(r[y])]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_stage(rows: list[dict[str, Any]], stage: str, path: Path) -> Path:
    """Loss, the validation metric of the target kind (accuracy, mAP or R²), lr and grad norm of one stage.

    With per-step rows (``kind`` "step") the x axis is the optimizer step: the training loss
    and lr / grad norm come from the step rows, epoch means and validation metrics are
    markers at each epoch's last step. Runs without step rows are drawn per epoch.
    """
    plt = _pyplot()
    epoch_rows = [r for r in rows if r.get("kind", "epoch") == "epoch"]
    step_rows = [r for r in rows if r.get("kind") == "step"]
    x = "step" if step_rows else "epoch"
    panels = [
        (key, title)
        for key, title in _PANELS
        if key == "loss" or any(_points(part, x, key)[0] for part in (epoch_rows, step_rows))
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        if key == "loss":
            if step_rows:
                ax.plot(*_points(step_rows, x, "train_loss"), linewidth=1, alpha=0.8, label="train")
                ax.plot(*_points(epoch_rows, x, "train_loss"), marker="o", linestyle="none", label="train (epoch mean)")
            else:
                ax.plot(*_points(epoch_rows, x, "train_loss"), marker="o", label="train")
            ax.plot(*_points(epoch_rows, x, "val_loss"), marker="o", label="validation")
            for name in sorted({k for r in epoch_rows for k in r if k.startswith("loss/")}):
                ax.plot(*_points(epoch_rows, x, name), linestyle="--", label=name)
            ax.legend(fontsize=8)
        else:
            source = step_rows if _points(step_rows, x, key)[0] else epoch_rows
            ax.plot(
                *_points(source, x, key),
                marker="o" if source is epoch_rows else None,
                markersize=3 if source is step_rows else 6,
            )
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        ax.set_title(title)
        ax.set_xlabel("optimizer step" if x == "step" else "epoch")
        ax.grid(alpha=0.3)
    fig.suptitle(f"stage {stage}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_confusion(labels: np.ndarray, predictions: np.ndarray, num_classes: int, path: Path, title: str) -> Path:
    """Row-normalized confusion matrix with counts."""
    plt = _pyplot()
    counts = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(counts, (labels, predictions), 1)
    rates = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    image = ax.imshow(rates, cmap="Blues", vmin=0, vmax=1)
    for i in range(num_classes):
        for j in range(num_classes):
            ax.text(
                j,
                i,
                str(counts[i, j]),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if rates[i, j] > 0.5 else "black",
            )
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_xticks(range(num_classes))
    ax.set_yticks(range(num_classes))
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_regression(labels: np.ndarray, predictions: np.ndarray, path: Path, title: str) -> Path:
    """Predicted against true values of every regression output, with the identity line."""
    plt = _pyplot()
    y, p = labels.reshape(len(labels), -1), predictions.reshape(len(predictions), -1)
    fig, ax = plt.subplots(figsize=(5.2, 5.0))
    for k in range(y.shape[1]):
        ax.scatter(y[:, k], p[:, k], s=8, alpha=0.6, label=f"output {k}" if y.shape[1] > 1 else None)
    lo, hi = float(min(y.min(), p.min())), float(max(y.max(), p.max()))
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, linestyle="--")
    ax.set_xlabel("true")
    ax.set_ylabel("predicted")
    ax.set_title(title)
    if y.shape[1] > 1:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
