"""MLflow runs: the pipeline's parent run (driver) and a nested run per stage fit (rank 0).

The :class:`~mlflow.tracking.MlflowClient` API throughout, never the fluent ``mlflow.start_run``
(its active-run stack is process state; a Tune trial actor runs one trial after another). A
nested run is an ordinary run tagged ``mlflow.parentRunId``, which is how the MLflow UI nests
runs. Metrics are named ``step/<metric>`` and ``epoch/<metric>`` (as in TensorBoard), against
the optimizer step; params are the stage's resolved config, flattened (``solver.lr``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cascade_ray.constants import MLFLOW_HTTP_ENV_DEFAULTS
from cascade_ray.tracking import param_text, scalars

MAX_PARAMS_PER_BATCH = 100  # MLflow's log_batch limit
MAX_PARAM_CHARS = 6000


def client(tracking_uri: str) -> Any:
    """An MlflowClient with short HTTP retries (:data:`~cascade_ray.constants.MLFLOW_HTTP_ENV_DEFAULTS`)."""
    for key, value in MLFLOW_HTTP_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def experiment_id(mlflow: Any, name: str, tracking_uri: str) -> str:
    """The id of experiment `name`, created when missing; with a local database
    (``sqlite:////abs/mlflow.db``) its artifacts go next to it (``mlartifacts/``), not to
    MLflow's default ``./mlruns`` of whatever folder the driver runs in."""
    found = mlflow.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None
    if tracking_uri.startswith("sqlite:///"):
        location = (Path(tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
    return mlflow.create_experiment(name, artifact_location=location)


def log_params(mlflow: Any, run_id: str, params: Mapping[str, Any]) -> None:
    """Every param as text, in batches MLflow accepts (long values cut at MLflow's limit)."""
    from mlflow.entities import Param

    items = [Param(k, param_text(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]
    for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
        mlflow.log_batch(run_id, params=items[start : start + MAX_PARAMS_PER_BATCH])


class MlflowStageLogger:
    """A stage fit's nested run, opened on rank 0 under the pipeline's parent run."""

    name = "mlflow"

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        parent: str,
        run_name: str,
        params: Mapping[str, Any],
        tags: Mapping[str, str],
    ):
        self.mlflow = client(tracking_uri)
        run = self.mlflow.create_run(experiment, run_name=run_name, tags={"mlflow.parentRunId": parent, **tags})
        self.run_id = run.info.run_id
        log_params(self.mlflow, self.run_id, params)

    def log(self, group: str, row: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(row["step"])
        metrics = [Metric(f"{group}/{k}", v, now, step) for k, v in scalars(row).items()]
        if metrics:
            self.mlflow.log_batch(self.run_id, metrics=metrics)

    def close(self, failed: bool) -> None:
        self.mlflow.set_tag(self.run_id, "cascade.status", "failed" if failed else "trained")
        self.mlflow.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
