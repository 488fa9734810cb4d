"""PNG figures of a run: per-stage training curves and the composed model's confusion matrix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# (metric, title) per panel; a panel whose metric a stage never reported is left out
_PANELS = (("loss", "loss"), ("val_accuracy", "validation accuracy"), ("lr", "learning rate"), ("grad_norm", "gradient norm"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_stage(rows: list[dict[str, Any]], stage: str, path: Path) -> Path:
    """Loss, validation accuracy, lr and grad norm of one stage per epoch."""
    plt = _pyplot()
    epochs = [r["epoch"] for r in rows]
    panels = [(key, title) for key, title in _PANELS if key == "loss" or any(r.get(key) is not None for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        if key == "loss":
            ax.plot(epochs, [r["train_loss"] for r in rows], marker="o", label="train")
            ax.plot(epochs, [r["val_loss"] for r in rows], marker="o", label="validation")
            for name in sorted(k for k in rows[0] if k.startswith("loss/")):
                ax.plot(epochs, [r[name] for r in rows], linestyle="--", label=name)
            ax.legend(fontsize=8)
        else:
            ax.plot(epochs, [r.get(key) for r in rows], marker="o")
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        ax.set_title(title)
        ax.set_xlabel("epoch")
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
            ax.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=7, color="white" if rates[i, j] > 0.5 else "black")
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
