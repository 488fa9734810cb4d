"""``cascade-ray report RUN_DIR``: PNGs and a report.md that embeds them with the stage table."""

from __future__ import annotations

from pathlib import Path

from cascade_ray.config.metrics import HEADLINE_METRIC
from cascade_ray.errors import CascadeError
from cascade_ray.pipeline.outputs import read_metrics, read_predictions
from cascade_ray.pipeline.records import RunSummary, read_summary
from cascade_ray.storage import StorageDir, as_storage, staged_dir
from cascade_ray.tools.plots import plot_confusion, plot_regression, plot_stage
from cascade_ray.tracking.pipeline_run import log_report

REPORT_DIR = "report"


def build_report(run: str | StorageDir) -> StorageDir:
    """Write ``RUN_DIR/report/*.png`` and ``RUN_DIR/report/report.md`` (a local folder or a URI:
    on object storage the files are drawn locally, then uploaded); return the .md path."""
    run = as_storage(run, "run_dir")
    if not (run / "summary.json").is_file():
        raise CascadeError(
            f"{run} has no summary.json: pass the folder of a finished run, i.e. {{storage_path}}/{{name}}"
        )
    summary = read_summary(run / "summary.json")
    metrics = read_metrics(run)
    with staged_dir(run / REPORT_DIR) as out:
        _write_report(run, summary, metrics, out)
        tracked = log_report(run, out)  # loggers.mlflow: the PNGs join the run's parent run too
        if tracked is not None:
            print(f"report: added to mlflow run {tracked}", flush=True)
    return run / REPORT_DIR / "report.md"


def _write_report(run: StorageDir, summary: RunSummary, metrics: dict[str, list[dict]], out: Path) -> None:
    name = HEADLINE_METRIC[summary.target_kind]
    test = summary.test_metrics or {"accuracy": summary.test_accuracy, "loss": summary.test_loss}
    shown = ", ".join(f"{k} {v:.4f}" for k, v in test.items() if k != name)
    lines = [
        f"# Run `{summary.name}`",
        "",
        f"Composed model on the test split ({summary.target_kind} targets): {name} **{test[name]:.4f}**, {shown}.",
        "",
    ]
    lines += [
        f"| stage | status | val {name} | val loss | trainable | frozen | workers | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary.stages:
        m = s.metrics
        lines.append(
            f"| {s.name} | {s.status} | {m.get(f'val_{name}', float('nan')):.4f} | {m['val_loss']:.4f} | {s.trainable_params:,} | {s.frozen_params:,} | {s.num_workers} | {s.wall_s:.1f} |"
        )
    lines.append("")
    for s in summary.stages:
        rows = metrics.get(s.name)
        if rows:
            png = plot_stage(rows, s.name, out / f"{s.name}.png")
            lines += [f"## {s.name}", "", f"![{s.name} curves]({png.name})", ""]
    labels, predictions = read_predictions(run)
    title = f"{summary.name}: composed model, test {name} {test[name]:.4f}"
    if summary.target_kind == "class":
        classes = int(max(labels.max(), predictions.max())) + 1
        png = plot_confusion(labels, predictions, classes, out / "confusion.png", title)
        lines += ["## Confusion matrix (test split)", "", f"![confusion matrix]({png.name})", ""]
    elif summary.target_kind == "regression":
        png = plot_regression(labels, predictions, out / "regression.png", title)
        lines += ["## Predicted vs true (test split)", "", f"![predicted vs true]({png.name})", ""]
    (out / "report.md").write_text("\n".join(lines))
