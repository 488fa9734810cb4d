"""What a finished run leaves for reports and export, written with pyarrow.

``{run}/config.yaml`` (the resolved config, swept values included),
``{run}/metrics/<stage>.parquet`` (``kind`` "step": every ``train.log_interval`` optimizer
steps, the training loss averaged since the previous row, lr, grad norm and update ratio when
the health monitor measured that step, samples/s; ``kind`` "epoch": one row per epoch with
the validation metrics), ``{run}/test_predictions.parquet`` (label and prediction per test
sample: class indices, or lists of multilabel flags / regression values) and, when the ``tensorboard`` package is installed, ``{run}/tensorboard/<stage>/``
event files with the same scalars. :func:`next_steps` is what the driver prints last: the
commands to run on the finished run.

:class:`RunOutputs` writes them as the run goes: each stage's metrics (and TensorBoard
events) and ``summary.json`` (``status`` running, with each stage done / running / pending)
when a stage starts and ends, a failed summary when the run stops on an error, and the
test predictions and the finished summary last; a run that crashes in stage 3 keeps stages
1-2's metrics, and ``cascade-ray report`` works on it.
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
from cascade_ray.errors import CascadeError
from cascade_ray.pipeline.records import RunSummary, StageState, error_text, summary_text
from cascade_ray.storage import StorageDir, read_table, redact, staged_dir

CONFIG_FILE = "config.yaml"
METRICS_DIR = "metrics"
PREDICTIONS_FILE = "test_predictions.parquet"
SUMMARY_FILE = "summary.json"


class RunOutputs:
    """A run's outputs kept current while it goes (see the module docstring), local or on object storage.

    A write in the middle of the run that fails (storage down) is a warning: the run goes on
    and the next write tries again; the final writes of :meth:`finish` raise.
    """

    def __init__(self, out: StorageDir, cfg: PipelineConfig, target_kind: str, log: Callable[[str], None] = print):
        self.out, self.cfg, self.target_kind, self.log = out, cfg, target_kind, log
        self.records: list[dict[str, Any]] = []
        self.running: int | None = None  # index of the stage under way
        self.started = False  # no summary is written for a run that failed before its first stage

    def stage_started(self, index: int) -> None:
        """Stage `index` starts: the summary says so."""
        self.started, self.running = True, index
        self._try(lambda: self._write_summary(self._summary("running")))

    def stage_done(self, record: dict[str, Any], cfg: PipelineConfig) -> None:
        """A stage is done: its metrics table and events, the config so far (swept values) and the summary."""
        self.records.append(record)
        self.running = None

        def write() -> None:
            with staged_dir(self.out) as local:
                write_config(local, cfg)
                tables = write_metrics(local, [record])
                # "no tensorboard" is said once, by finish
                _write_events(local, tables, lambda _: None, _live_events(cfg, [record]))
            self._write_summary(self._summary("running"))

        self._try(write)

    def failed(self, exc: BaseException) -> None:
        """The run stopped on `exc`: a failed summary (the stage under way marked failed). Never raises:
        a write that fails is a warning, and the caller re-raises `exc`."""
        if not self.started:
            return
        self._try(lambda: self._write_summary(self._summary("failed", error_text(exc))))

    def finish(self, cfg: PipelineConfig, test: dict[str, Any]) -> tuple[RunSummary, Path | None]:
        """Every output of the finished run, the finished summary last: (summary, the TensorBoard folder or None)."""
        metrics = test["metrics"]
        summary = RunSummary(
            name=self.cfg.name,
            test_accuracy=metrics.get("accuracy"),
            test_loss=metrics["loss"],
            test_metrics=metrics,
            target_kind=self.target_kind,
            stages=self.records,
            storage=str(self.out),
        )
        with staged_dir(self.out) as local:  # the writers use local paths; staged to s3:// / gs:// here
            events = write_run_outputs(local, cfg, self.records, test["labels"], test["predictions"], log=self.log)
        self._write_summary(summary)
        return summary, events

    def _summary(self, status: str, error: str | None = None) -> RunSummary:
        states = [
            StageState(
                name=stage.name,
                type=stage.type,
                status=(status if status == "failed" else "running") if index == self.running else "pending",
                error=error if index == self.running else None,
            )
            for index, stage in enumerate(self.cfg.stages)
            if index >= len(self.records)
        ]
        return RunSummary(
            name=self.cfg.name,
            status=status,
            error=error,
            target_kind=self.target_kind,
            stages=[*self.records, *states],
            storage=str(self.out),
        )

    def _write_summary(self, summary: RunSummary) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / SUMMARY_FILE).write_text(summary_text(summary))

    def _try(self, write: Callable[[], None]) -> None:
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - the run (or its original error) matters more than this file
            self.log(f"warning: could not update the run's outputs in {self.out} ({error_text(exc)[:300]}); continuing")


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
    write_config(out, cfg)
    tables = write_metrics(out, records)
    pq.write_table(pa.table({"label": _column(labels), "prediction": _column(predictions)}), out / PREDICTIONS_FILE)
    return _write_events(out, tables, log, _live_events(cfg, records))


def require_run_folder(run: StorageDir) -> None:
    """A :class:`~cascade_ray.errors.CascadeError` when `run` does not exist, naming the run folders
    beside it that come closest (a typo in ``{storage_path}/{name}``), before any reader says what
    the folder lacks."""
    if run.exists():
        return
    from cascade_ray.text import did_you_mean

    try:
        runs = [p.name for p in run.parent.iterdir() if (p / CONFIG_FILE).is_file() or (p / SUMMARY_FILE).is_file()]
    except OSError:  # no parent either, or not listable: nothing to suggest
        runs = []
    raise CascadeError(
        f"{run}: no such run folder{did_you_mean(run.name, runs)}: pass {{storage_path}}/{{name}} of a run "
        "(cascade-ray run prints its folder when it ends)"
    )


def write_config(out: Path, cfg: PipelineConfig) -> None:
    """``{out}/config.yaml``: the resolved config, credentials in every URI redacted (``storage_path``,
    ``data.path``, an MLflow ``tracking_uri``, ...: a run folder is read by whoever may read the run)."""
    out.mkdir(parents=True, exist_ok=True)
    resolved = without_credentials(cfg.model_dump(mode="json"))
    (out / CONFIG_FILE).write_text(yaml.safe_dump(resolved, sort_keys=False))


def without_credentials(value: Any) -> Any:
    """`value` (a JSON-like config dump) with :func:`~cascade_ray.storage.redact` applied to every string
    that holds a URI."""
    if isinstance(value, dict):
        return {k: without_credentials(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_credentials(v) for v in value]
    return redact(value) if isinstance(value, str) and "://" in value else value


def write_metrics(out: Path, records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``{out}/metrics/<stage>.parquet`` of each record that has metric rows; stage -> its rows."""
    (out / METRICS_DIR).mkdir(parents=True, exist_ok=True)
    tables = {}
    for record in records:
        rows = metric_rows(record["name"], record["history"])
        if rows:
            pq.write_table(_table(rows), out / METRICS_DIR / f"{record['name']}.parquet")
            tables[record["name"]] = rows
    return tables


def _live_events(cfg: PipelineConfig, records: list[dict[str, Any]]) -> set[str]:
    """``loggers.tensorboard``: the stages trained in this run, whose rank 0 wrote their events live
    (a swept stage's under ``trial-<id>/``); the reused and swept stages' are written from the history."""
    return {r["name"] for r in records if r["status"] == "trained"} if cfg.loggers.tensorboard else set()


def _write_events(
    out: Path, tables: dict[str, list[dict[str, Any]]], log: Callable[[str], None], written_live: set[str]
) -> Path | None:
    from cascade_ray.pipeline.tensorboard import write_tensorboard

    events = write_tensorboard(out, tables, log, written_live=written_live)
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
        f"cascade-ray predict {quoted} --data FILE --out DIR",
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
