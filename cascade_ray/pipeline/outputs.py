"""What a finished run leaves for reports and export, written with pyarrow.

``{run}/config.yaml`` (the resolved config, swept values included),
``{run}/metrics/<stage>.parquet`` (``kind`` "step": every ``train.log_interval`` optimizer
steps, the training loss averaged since the previous row, lr, grad norm and update ratio when
the health monitor measured that step, samples/s; ``kind`` "epoch": one row per epoch with
the validation metrics), ``{run}/test_predictions.parquet`` (label and prediction per test
sample: class indices, or lists of multilabel flags / regression values) and, when the ``tensorboard`` package is installed, ``{run}/tensorboard/<stage>/``
event files with the same scalars. :func:`next_steps` is what the driver prints last: the
commands to run on the finished run.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.storage import StorageDir, read_table, redact

CONFIG_FILE = "config.yaml"
METRICS_DIR = "metrics"
PREDICTIONS_FILE = "test_predictions.parquet"


def write_run_outputs(
    out: Path,
    cfg: PipelineConfig,
    records: list[dict[str, Any]],
    labels: np.ndarray,
    predictions: np.ndarray,
    log: Callable[[str], None] = print,
) -> Path | None:
    """Write the resolved config, per-stage metrics tables, the test predictions and TensorBoard events.

    Returns:
        ``{out}/tensorboard`` when event files were written there, else None (no tensorboard
        package, or no metric rows).
    """
    from cascade_ray.pipeline.tensorboard import write_tensorboard

    out.mkdir(parents=True, exist_ok=True)
    resolved = cfg.model_dump(mode="json")
    resolved["storage_path"] = redact(resolved["storage_path"])  # credentials in a URI stay out of files
    (out / CONFIG_FILE).write_text(yaml.safe_dump(resolved, sort_keys=False))
    (out / METRICS_DIR).mkdir(exist_ok=True)
    tables = {}
    for record in records:
        rows = metric_rows(record["name"], record["history"])
        if rows:
            pq.write_table(_table(rows), out / METRICS_DIR / f"{record['name']}.parquet")
            tables[record["name"]] = rows
    pq.write_table(pa.table({"label": _column(labels), "prediction": _column(predictions)}), out / PREDICTIONS_FILE)
    # loggers.tensorboard: rank 0 wrote the events of each stage trained in this run live (a swept
    # stage's under trial-<id>/); the reused and swept stages' are written here
    live = {r["name"] for r in records if r["status"] == "trained"} if cfg.loggers.tensorboard else set()
    events = write_tensorboard(out, tables, log, written_live=live)
    return events if events is not None and events.is_dir() else None


def next_steps(run: str, *, tensorboard: str | None = None) -> list[str]:
    """The commands a user runs next on a finished run: report, predict, serve, export and,
    when event files were written, TensorBoard.

    Args:
        run: the run folder as shown to users (``str()`` of a ``UriPath``: no credentials).
        tensorboard: ``{run}/tensorboard`` as shown to users (``str(run_dir / "tensorboard")``, so a
            URI's query options stay at the end), or None when no event files were written.
    """
    quoted = shlex.quote(run)
    steps = [
        f"cascade-ray report {quoted}",
        f"cascade-ray predict {quoted} --data FILE --out FILE",
        f"cascade-ray serve {quoted}",
        f"cascade-ray export {quoted}",
    ]
    if tensorboard is not None:
        steps.append(f"tensorboard --logdir {shlex.quote(tensorboard)}")
    return steps


def _column(values: np.ndarray) -> pa.Array:
    """Class indices as int64; multilabel flags and regression values (N, K) as fixed-size float lists."""
    if values.ndim == 1:
        return pa.array(values.astype(np.int64))
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat), values.shape[1])


def metric_rows(stage: str, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stage's history (epoch metrics, each carrying its epoch's per-step rows under ``steps``)
    as flat rows in training order: each epoch's step rows, then the epoch row."""
    rows = []
    for entry in history:
        rows += [{"stage": stage, **row, "kind": "step"} for row in entry.get("steps", [])]
        rows.append({"stage": stage, **{k: v for k, v in entry.items() if k != "steps"}, "kind": "epoch"})
    return rows


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows with different keys (step rows have no validation metrics) as one table; missing values are null."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return pa.table({c: [row.get(c) for row in rows] for c in columns})


def read_metrics(run: StorageDir) -> dict[str, list[dict[str, Any]]]:
    """Stage name -> its metric rows (step and epoch rows, see ``kind``), in training order of the files present."""
    files = sorted((run / METRICS_DIR).glob("*.parquet"), key=lambda p: p.name)
    return {p.name.removesuffix(".parquet"): read_table(p).to_pylist() for p in files}


def read_predictions(run: StorageDir) -> tuple[np.ndarray, np.ndarray]:
    """(labels, predictions) of the composed model on the test split: (N,) class indices, or (N, K)
    multilabel flags / regression values."""
    table = read_table(run / PREDICTIONS_FILE)
    return _array(table["label"]), _array(table["prediction"])


def _array(column: pa.ChunkedArray) -> np.ndarray:
    col = column.combine_chunks()
    if pa.types.is_fixed_size_list(col.type):
        return col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
    return col.to_numpy(zero_copy_only=False)
