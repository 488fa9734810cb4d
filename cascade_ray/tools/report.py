"""``cascade-ray report RUN_DIR``: PNGs and a report.md that embeds them with the stage table."""

from __future__ import annotations

from pathlib import Path

from cascade_ray.errors import CascadeError
from cascade_ray.pipeline.outputs import read_metrics, read_predictions
from cascade_ray.pipeline.records import read_summary
from cascade_ray.tools.plots import plot_confusion, plot_stage

REPORT_DIR = "report"


def build_report(run: str | Path) -> Path:
    """Write ``RUN_DIR/report/*.png`` and ``RUN_DIR/report/report.md``; return the .md path."""
    run = Path(run).expanduser()
    if not (run / "summary.json").is_file():
        raise CascadeError(
            f"{run} has no summary.json: pass the folder of a finished run, i.e. {{storage_path}}/{{name}}"
        )
    summary = read_summary(run / "summary.json")
    metrics = read_metrics(run)
    out = run / REPORT_DIR
    out.mkdir(exist_ok=True)
    lines = [
        f"# Run `{summary.name}`",
        "",
        f"Composed model on the test split: accuracy **{summary.test_accuracy:.4f}**, loss {summary.test_loss:.4f}.",
        "",
    ]
    lines += [
        "| stage | status | val accuracy | val loss | trainable | frozen | workers | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary.stages:
        m = s.metrics
        lines.append(
            f"| {s.name} | {s.status} | {m['val_accuracy']:.4f} | {m['val_loss']:.4f} | {s.trainable_params:,} | {s.frozen_params:,} | {s.num_workers} | {s.wall_s:.1f} |"
        )
    lines.append("")
    for s in summary.stages:
        rows = metrics.get(s.name)
        if rows:
            png = plot_stage(rows, s.name, out / f"{s.name}.png")
            lines += [f"## {s.name}", "", f"![{s.name} curves]({png.name})", ""]
    labels, predictions = read_predictions(run)
    classes = int(max(labels.max(), predictions.max())) + 1
    png = plot_confusion(
        labels,
        predictions,
        classes,
        out / "confusion.png",
        f"{summary.name}: composed model, test accuracy {summary.test_accuracy:.4f}",
    )
    lines += ["## Confusion matrix (test split)", "", f"![confusion matrix]({png.name})", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report
