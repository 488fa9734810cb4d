"""The pipeline's own tracking run, on the driver: opened after validation, before the first stage.

MLflow: the parent run (experiment ``loggers.mlflow.experiment``, name ``run_name`` or the
pipeline's name), params ``name``, ``seed``, ``data.*``, tags ``cascade.storage`` and the stage
names; when the run ends, the run's records as artifacts (``summary.json``, ``config.yaml``,
``stages/<stage>/manifest.json``, ``metrics/<stage>.parquet``, ``report/*.png`` when present)
and the status FINISHED or FAILED; ``{run}/tracking.json`` names the parent run, so ``cascade-ray
report`` adds its PNGs to it later (:func:`log_report`). W&B: the group every stage run joins, and a ``pipeline`` run
in it at the end holding the same files and the summary's test metrics.

Errors here are reported once, as on the workers; the pipeline trains on without that tracker.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.storage import StorageDir, full_uri, redact
from cascade_ray.tracking import TrackingContext, describe, flatten

ARTIFACTS = ("summary.json", "config.yaml")
TRACKING_FILE = "tracking.json"  # the MLflow parent run of the run folder: `cascade-ray report` adds its PNGs


def log_report(run: StorageDir, folder: Path, log: Callable[[str], None] = print) -> str | None:
    """Add the report files in `folder` to the run's MLflow parent run (``report/``), when the run
    was tracked; return the run id. A tracking server that fails is one warning line, not an error."""
    record = run / TRACKING_FILE
    if not record.is_file():
        return None
    try:
        raw = json.loads(record.read_text())
        mlflow_run = raw.get("mlflow") or {} if isinstance(raw, dict) else {}
        if not isinstance(mlflow_run, dict) or not all(
            isinstance(mlflow_run.get(k), str) and mlflow_run[k] for k in ("run_id", "tracking_uri")
        ):
            raise ValueError("no mlflow run_id / tracking_uri strings")
    except (OSError, ValueError) as exc:  # a damaged record: the report is written, only its MLflow copy is skipped
        log(f"WARNING tracking: {record} is unreadable ({describe(exc)}); the report was not added to MLflow")
        return None
    try:
        from cascade_ray.tracking.mlflow_runs import client

        client(mlflow_run["tracking_uri"]).log_artifacts(mlflow_run["run_id"], str(folder), "report")
    except Exception as exc:  # noqa: BLE001 - the report is written; only its copy in MLflow is missing
        log(f"WARNING tracking: the report was not added to mlflow run {mlflow_run['run_id']} ({describe(exc)})")
        return None
    return mlflow_run["run_id"]


class PipelineTracking:
    """The driver side of one run's tracking; use as a context manager around the stages."""

    def __init__(self, cfg: PipelineConfig, out: StorageDir, log: Callable[[str], None] = print):
        self.cfg, self.out, self.log = cfg, out, log
        self.mlflow: Any = None
        self.parent: str | None = None
        self.experiment: str | None = None
        self.group: str | None = None
        settings = cfg.loggers.mlflow
        if settings is not None:
            try:
                from cascade_ray.tracking.mlflow_runs import client, experiment_id, log_params

                self.mlflow = client(settings.tracking_uri)
                self.experiment = experiment_id(self.mlflow, settings.experiment, settings.tracking_uri)
                run = self.mlflow.create_run(
                    self.experiment,
                    run_name=settings.run_name or cfg.name,
                    tags={
                        "cascade.pipeline": cfg.name,
                        "cascade.storage": redact(str(out)),
                        "cascade.stages": ",".join(s.name for s in cfg.stages),
                    },
                )
                self.parent = run.info.run_id
                log_params(self.mlflow, self.parent, self._pipeline_params())
                out.mkdir(parents=True, exist_ok=True)
                (out / TRACKING_FILE).write_text(
                    json.dumps(
                        {"mlflow": {"tracking_uri": redact(settings.tracking_uri), "run_id": self.parent}}, indent=2
                    )
                )
                log(
                    f"tracking: mlflow run {self.parent} in experiment {settings.experiment!r} at {redact(settings.tracking_uri)}"
                )
            except Exception as exc:  # noqa: BLE001 - reported once; the run trains without MLflow
                self._warn("mlflow", "could not open the pipeline run", exc)
                self.mlflow = self.parent = None
        if cfg.loggers.wandb is not None:
            self.group = f"{cfg.name}-{uuid.uuid4().hex[:8]}"
            log(
                f"tracking: wandb group {self.group!r} in project {cfg.loggers.wandb.project!r} ({cfg.loggers.wandb.mode})"
            )

    def context(self) -> TrackingContext:
        return TrackingContext(
            run_dir=full_uri(self.out),
            mlflow_parent=self.parent,
            mlflow_experiment=self.experiment,
            wandb_group=self.group,
        )

    def __enter__(self) -> PipelineTracking:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(failed=kind is not None)

    def close(self, failed: bool) -> None:
        """Upload the run's records and end the tracking runs (FINISHED, or FAILED when `failed`)."""
        if self.parent is None and self.group is None:
            return
        with tempfile.TemporaryDirectory(prefix="cascade-tracking-") as tmp:
            files = self._gather(Path(tmp))
            if self.parent is not None:
                try:
                    for path in files:
                        folder = path.parent.relative_to(tmp).as_posix()
                        self.mlflow.log_artifact(self.parent, str(path), None if folder == "." else folder)
                    self._end_orphans()
                    self.mlflow.set_tag(self.parent, "cascade.status", "failed" if failed else "finished")
                    self.mlflow.set_terminated(self.parent, "FAILED" if failed else "FINISHED")
                except Exception as exc:  # noqa: BLE001 - the run itself is done; say what was not logged
                    self._warn("mlflow", "could not finish the pipeline run", exc)
            if self.group is not None:
                try:
                    self._wandb_pipeline_run(Path(tmp), files, failed)
                except Exception as exc:  # noqa: BLE001 - as above
                    self._warn("wandb", "could not write the pipeline run", exc)

    def _end_orphans(self) -> None:
        """End KILLED the nested runs still RUNNING: their rank 0 died without closing them (a
        worker killed outright; Ray Train restarted the group, whose new rank 0 opened a new run)."""
        query = f"tags.`mlflow.parentRunId` = '{self.parent}'"
        for run in self.mlflow.search_runs([self.experiment], query, max_results=1000):
            if run.info.status == "RUNNING":
                self.mlflow.set_tag(run.info.run_id, "cascade.status", "killed")
                self.mlflow.set_terminated(run.info.run_id, "KILLED")

    def _pipeline_params(self) -> dict[str, Any]:
        raw = self.cfg.model_dump(mode="json")
        raw["storage_path"] = redact(raw["storage_path"])
        return flatten({k: v for k, v in raw.items() if k not in ("stages", "loggers")})

    def _gather(self, tmp: Path) -> list[Path]:
        """The run's record files that exist, copied to `tmp` (the run folder may be a URI)."""
        names = [*ARTIFACTS]
        for stage in self.cfg.stages:
            names += [f"stages/{stage.name}/manifest.json", f"metrics/{stage.name}.parquet", f"report/{stage.name}.png"]
        names += ["report/confusion.png", "report/regression.png", "report/report.md"]
        copied = []
        for name in names:
            source = self.out / name
            try:
                if not source.is_file():
                    continue
                target = tmp / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(source.read_bytes())
                copied.append(target)
            except OSError:
                continue  # a file that went away or cannot be read is left out, not fatal
        return copied

    def _wandb_pipeline_run(self, tmp: Path, files: list[Path], failed: bool) -> None:
        from cascade_ray.tracking.wandb_runs import start

        settings = self.cfg.loggers.wandb
        assert settings is not None and self.group is not None
        run = start(
            settings,
            full_uri(self.out),
            name=self.cfg.name,
            group=self.group,
            job_type="pipeline",
            config=self._pipeline_params(),
        )
        summary = tmp / "summary.json"
        if summary.is_file():
            data = json.loads(summary.read_text())
            for key, value in (data.get("test_metrics") or {}).items():
                run.summary[f"test/{key}"] = value
        for path in files:
            dest = Path(run.dir) / path.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
            run.save(str(dest), base_path=run.dir, policy="now")
        run.summary["cascade.status"] = "failed" if failed else "finished"
        run.finish(exit_code=1 if failed else 0)

    def _warn(self, name: str, what: str, exc: BaseException) -> None:
        self.log(f"WARNING tracking: the {name} logger {what} ({describe(exc)}); the run goes on without it")
