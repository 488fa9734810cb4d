"""What a finished run leaves for reports and export, written with pyarrow.

``{run}/config.yaml`` (the resolved config, swept values included),
``{run}/metrics/<stage>.parquet`` (one row per epoch) and
``{run}/test_predictions.parquet`` (label and prediction per test sample).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from cascade_ray.config.schema import PipelineConfig

CONFIG_FILE = "config.yaml"
METRICS_DIR = "metrics"
PREDICTIONS_FILE = "test_predictions.parquet"


def write_run_outputs(out: Path, cfg: PipelineConfig, records: list[dict[str, Any]], labels: np.ndarray, predictions: np.ndarray) -> None:
    """Write the resolved config, per-stage metrics tables and the test predictions."""
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    (out / METRICS_DIR).mkdir(exist_ok=True)
    for record in records:
        rows = [{"stage": record["name"], **row} for row in record["history"]]
        if rows:
            pq.write_table(pa.Table.from_pylist(rows), out / METRICS_DIR / f"{record['name']}.parquet")
    pq.write_table(pa.table({"label": labels.astype(np.int64), "prediction": predictions.astype(np.int64)}), out / PREDICTIONS_FILE)


def read_metrics(run: Path) -> dict[str, list[dict[str, Any]]]:
    """Stage name -> its metric rows, in training order of the files present."""
    return {p.stem: pq.read_table(p).to_pylist() for p in sorted((run / METRICS_DIR).glob("*.parquet"))}


def read_predictions(run: Path) -> tuple[np.ndarray, np.ndarray]:
    """(labels, predictions) of the composed model on the test split."""
    table = pq.read_table(run / PREDICTIONS_FILE)
    return table["label"].to_numpy(), table["prediction"].to_numpy()
