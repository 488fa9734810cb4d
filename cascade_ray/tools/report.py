"""``cascade-ray report RUN_DIR [--html]``: PNGs and a report.md that embeds them with the stage table
(``--html``: also one self-contained report.html, see :mod:`cascade_ray.tools.report_html`).

Works on a partial run too (one that is still running, or crashed in a later stage): its
``summary.json`` says which stages are done, and the report shows those stages' curves and
the run's status; the composed model's confusion matrix or scatter needs a finished run.
"""

from __future__ import annotations

from cascade_ray.storage import StorageDir, staged_dir
from cascade_ray.tools.report_data import (
    Figures,
    ReportData,
    cell,
    draw_figures,
    health_notes,
    read_report_data,
    stage_rows,
)
from cascade_ray.tracking.pipeline_run import log_report

REPORT_DIR = "report"


def build_report(run: str | StorageDir, html: bool = False) -> StorageDir:
    """Write ``RUN_DIR/report/*.png`` and ``RUN_DIR/report/report.md`` (and ``report.html`` with
    `html`) (a local folder or a URI: on object storage the files are drawn locally, then
    uploaded); return the .md path, or the .html path with `html`. A run logged to MLflow
    (``loggers.mlflow``) gets the report's files in its parent run too."""
    data = read_report_data(run)
    with staged_dir(data.run / REPORT_DIR) as out:
        figures = draw_figures(data, out)
        (out / "report.md").write_text(markdown(data, figures))
        if html:
            from cascade_ray.tools.report_html import render_html

            (out / "report.html").write_text(render_html(data, figures), encoding="utf-8")
        tracked = log_report(data.run, out)  # loggers.mlflow: the PNGs join the run's parent run too
        if tracked is not None:
            print(f"report: added to mlflow run {tracked}", flush=True)
    return data.run / REPORT_DIR / ("report.html" if html else "report.md")


def markdown(data: ReportData, figures: Figures) -> str:
    """report.md: the test result (or the run's status), the stage table, notes, curves, the test figure."""
    summary, name = data.summary, data.headline
    test = data.test_metrics()
    lines = [f"# Run `{summary.name}`", ""]
    if test is not None:
        shown = ", ".join(f"{k} {v:.4f}" for k, v in test.items() if k != name)
        lines += [
            f"Composed model on the test split ({summary.target_kind} targets): {name} **{test[name]:.4f}**, {shown}.",
            "",
        ]
    else:
        lines += [f"Status: **{summary.describe()}**; no composed-model test results yet.", ""]
    table = stage_rows(data)
    lines += ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    lines += ["| " + " | ".join(row) + " |" for row in table[1:]]
    lines.append("")
    notes = health_notes(data)
    if notes:
        lines += ["## Health", "", *(f"- {n}" for n in notes), ""]
    if summary.error:
        lines += ["## Error", "", "```", summary.error, "```", ""]
    for stage, png in figures.stages.items():
        lines += [f"## {stage}", "", f"![{stage} curves]({png.name})", ""]
    for stage, rows in data.sweeps.items():
        lines += [f"## Sweep of {stage}", ""]
        if isinstance(rows, str):
            lines += [rows, ""]
        elif rows:
            keys = list(rows[0])
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
            lines.append("")
    if figures.test is not None:
        png, title = figures.test
        lines += [f"## {title} (test split)", "", f"![{title.lower()}]({png.name})", ""]
    return "\n".join(lines)
