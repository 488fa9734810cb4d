"""``report.html``: the run report as one self-contained page that opens offline.

Every figure is embedded as a ``data:image/png;base64`` URI and the styles are inline: no
script, no font, no request to anything. The page holds the run's status (or its test
result), the stage table, health notes, the error of a failed run, each stage's curves
(loss, validation metric, lr, grad norm), each sweep's best trials and the composed model's
confusion matrix or regression scatter. Every text from the run is HTML-escaped.
"""

from __future__ import annotations

import base64
from html import escape
from pathlib import Path

from cascade_ray.tools.report_data import Figures, ReportData, cell, health_notes, stage_rows

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #1a1a1a; overflow-wrap: anywhere; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.6em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f0f0f0; }
.status { padding: 0.5em 0.8em; border-radius: 4px; display: inline-block; }
.finished { background: #e3f5e1; } .failed { background: #fbe3e3; } .running { background: #fdf3d7; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; white-space: pre-wrap; }
img { max-width: 100%; }
"""


def render_html(data: ReportData, figures: Figures) -> str:
    """The page for `data` with `figures` (PNG files) embedded."""
    summary, name = data.summary, data.headline
    test = data.test_metrics()
    parts = [f"<h1>Run <code>{escape(summary.name)}</code></h1>"]
    status = f"status: {summary.describe()}"
    if test is not None:
        shown = ", ".join(f"{escape(k)} {v:.4f}" for k, v in test.items() if k != name)
        status += f"; composed model on the test split: {escape(name)} <b>{test[name]:.4f}</b>, {shown}"
    parts.append(f'<p class="status {escape(summary.status)}">{status if test is not None else escape(status)}</p>')
    parts.append(f"<p>run folder: <code>{escape(summary.storage)}</code></p>")
    parts += ['<h2 id="stages">Stages</h2>', _table(stage_rows(data), "stage-table")]
    notes = health_notes(data)
    parts.append('<h2 id="health">Health</h2>')
    parts.append(
        "<ul>" + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul>" if notes else "<p>no health warnings</p>"
    )
    if summary.error:
        parts += ['<h2 id="error">Error</h2>', f"<pre>{escape(summary.error)}</pre>"]
    for s in summary.stages:
        png = figures.stages.get(s.name)
        parts.append(f'<h2 id="stage-{escape(s.name)}">Stage {escape(s.name)} ({escape(s.status)})</h2>')
        if png is None:
            parts.append("<p>no metrics yet</p>")
        else:
            parts.append(_img(png, f"{s.name}: loss, validation metric, lr and grad norm"))
    for stage, rows in data.sweeps.items():
        parts.append(f"<h2>Sweep of {escape(stage)}</h2>")
        if isinstance(rows, str):
            parts.append(f"<p>{escape(rows)}</p>")
        elif rows:
            keys = list(rows[0])
            parts.append(_table([keys, *[[cell(r.get(k)) for k in keys] for r in rows]], f"sweep-{stage}"))
    if figures.test is not None:
        png, title = figures.test
        parts += [f'<h2 id="test">{escape(title)} (test split)</h2>', _img(png, title)]
    body = "\n".join(parts)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>cascade-ray run {escape(summary.name)}</title><style>{_STYLE}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )


def _table(rows: list[list[str]], ident: str) -> str:
    head = "".join(f"<th>{escape(str(c))}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows[1:])
    return f'<table id="{escape(ident)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _img(png: Path, alt: str) -> str:
    encoded = base64.b64encode(png.read_bytes()).decode("ascii")
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{encoded}">'
