"""What a run report shows, read from the run folder and drawn once: :class:`ReportData` (summary,
metric rows, test predictions, sweep tables), :class:`Figures` (the PNGs), the stage table and
the health notes; :mod:`cascade_ray.tools.report` writes them as report.md and
:mod:`cascade_ray.tools.report_html` as report.html.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cascade_ray.config.metrics import HEADLINE_METRIC
from cascade_ray.errors import CascadeError
from cascade_ray.pipeline.outputs import (
    PREDICTIONS_FILE,
    SUMMARY_FILE,
    read_metrics,
    read_predictions,
    require_run_folder,
)
from cascade_ray.pipeline.records import RunSummary, StageRecord, read_summary
from cascade_ray.storage import StorageDir, as_storage, read_table
from cascade_ray.tools.plots import plot_confusion, plot_regression, plot_stage

SWEEP_ROWS = 10  # best trials shown per swept stage


@dataclass
class ReportData:
    """What a report shows, read from the run folder: the summary, metric rows, test predictions
    (None before the run finished) and each swept stage's trial table (best first)."""

    run: StorageDir
    summary: RunSummary
    metrics: dict[str, list[dict[str, Any]]]
    predictions: tuple[np.ndarray, np.ndarray] | None
    sweeps: dict[str, list[dict[str, Any]] | str] = field(default_factory=dict)  # str: why it is unreadable

    @property
    def headline(self) -> str:
        return HEADLINE_METRIC[self.summary.target_kind]

    def test_metrics(self) -> dict[str, float] | None:
        s = self.summary
        if s.test_loss is None:
            return None
        return s.test_metrics or {"accuracy": s.test_accuracy, "loss": s.test_loss}


@dataclass
class Figures:
    """PNG files drawn for a report: per stage, and the composed model's test figure (with its title)."""

    stages: dict[str, Path] = field(default_factory=dict)
    test: tuple[Path, str] | None = None


def read_report_data(run: str | StorageDir) -> ReportData:
    """The run's summary (finished or not), metric tables, predictions when finished, and sweep tables."""
    run = as_storage(run, "run_dir")
    require_run_folder(run)
    if not (run / SUMMARY_FILE).is_file() and (run / "tune").is_dir():
        swept = sorted(p.name for p in (run / "tune").iterdir() if (p / "results.parquet").is_file())
        if swept:
            raise CascadeError(
                f"{run} holds only sweeps ({', '.join(swept)}: cascade-ray tune writes no summary.json); their "
                f"tables are {run}/tune/<stage>/results.parquet, best first\n"
                "    fix: train the pipeline on a best.yaml as its header says (cascade-ray run CONFIG .../best.yaml), "
                "then report that run; or sweep inside a run (cascade-ray run CONFIG --tune DIR, DIR holding <stage>.yaml "
                "spaces), whose report "
                "shows the sweep's table"
            )
    if not (run / SUMMARY_FILE).is_file():
        raise CascadeError(
            f"{run} has no {SUMMARY_FILE}: pass the folder of a run, i.e. {{storage_path}}/{{name}} (the summary is "
            "written when its first stage starts)"
        )
    summary = read_summary(run / SUMMARY_FILE)
    finished = summary.status == "finished" and (run / PREDICTIONS_FILE).is_file()
    data = ReportData(run, summary, read_metrics(run), read_predictions(run) if finished else None)
    for s in summary.done:
        if s.sweep is not None:
            try:
                rows = read_table(as_storage(s.sweep.results, "sweep.results")).to_pylist()
                data.sweeps[s.name] = rows[:SWEEP_ROWS]
            except (OSError, ValueError) as exc:  # a moved or pruned sweep folder: say so, report the rest
                data.sweeps[s.name] = f"unreadable: {exc}"
    return data


def draw_figures(data: ReportData, out: Path) -> Figures:
    """Per-stage curves (loss, validation metric, lr, grad norm) and, for a finished run, the
    confusion matrix (class targets) or predicted-vs-true scatter (regression)."""
    figures = Figures()
    for s in data.summary.stages:
        rows = data.metrics.get(s.name)
        if rows:
            figures.stages[s.name] = plot_stage(rows, s.name, out / f"{s.name}.png")
    test = data.test_metrics()
    if data.predictions is None or test is None:
        return figures
    labels, predictions = data.predictions
    title = f"{data.summary.name}: composed model, test {data.headline} {test[data.headline]:.4f}"
    if data.summary.target_kind == "class":
        classes = int(max(labels.max(), predictions.max())) + 1
        figures.test = (plot_confusion(labels, predictions, classes, out / "confusion.png", title), "Confusion matrix")
    elif data.summary.target_kind == "regression":
        figures.test = (plot_regression(labels, predictions, out / "regression.png", title), "Predicted vs true")
    return figures


def stage_rows(data: ReportData) -> list[list[str]]:
    """The stage table (header first): one row per stage, done or not."""
    name = data.headline
    rows = [["stage", "status", f"val {name}", "val loss", "trainable", "frozen", "workers", "wall s"]]
    for s in data.summary.stages:
        if isinstance(s, StageRecord):
            m = s.metrics
            rows.append(
                [
                    s.name,
                    s.status,
                    _num(m.get(f"val_{name}")),
                    _num(m["val_loss"]),
                    f"{s.trainable_params:,}",
                    f"{s.frozen_params:,}",
                    str(s.num_workers),
                    f"{s.wall_s:.1f}",
                ]
            )
        else:
            rows.append([s.name, s.status, *["-"] * 6])
    return rows


def health_notes(data: ReportData) -> list[str]:
    """What a reader should look at: health-rule warnings per epoch, non-finite losses, the run's error."""
    notes = []
    if data.summary.status != "finished":
        notes.append(f"the run is not finished: {data.summary.describe()}")
    for stage in [s.name for s in data.summary.stages if s.name in data.metrics]:  # pipeline order
        for r in data.metrics[stage]:
            if r.get("kind", "epoch") != "epoch":
                continue
            warned = r.get("health_warnings")
            if isinstance(warned, (int, float)) and warned > 0:
                notes.append(f"stage {stage}, epoch {r.get('epoch')}: {int(warned)} health warning(s) (see the log)")
            for key in ("train_loss", "val_loss"):
                value = r.get(key)
                if isinstance(value, float) and not math.isfinite(value):
                    notes.append(f"stage {stage}, epoch {r.get('epoch')}: {key} is {value}")
    return notes


def _num(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def cell(value: Any) -> str:
    """A table cell: floats to 4 significant digits, None as '-'."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)
