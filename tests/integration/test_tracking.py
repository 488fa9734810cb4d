"""Live tracking against real servers: the debug pipeline logged to a local ``mlflow server``
(checked through MLflow's REST API), W&B in offline mode (the files it writes), TensorBoard
events read while the first stage still trains; and an MLflow server stopped mid-stage."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from fakes import ListReporter
from mlflow_server import start_mlflow
from paths import CONFIGS
from wandb_records import offline_run

from cascade_ray.api import RunOptions, run_pipeline
from cascade_ray.checks import validate_config
from cascade_ray.config.yaml_io import read_yaml
from cascade_ray.stage.hooks import LoopHooks, chain_hooks
from cascade_ray.stage.loop import run_stage
from cascade_ray.stage.observe import observer_hooks
from cascade_ray.tracking.pipeline_run import PipelineTracking

EXPERIMENT = "debug-tracking"
LIVE_POLL_TIMEOUT_S = 600.0


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory):
    server = start_mlflow(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


def tracked_config(storage: Path, uri: str, experiment: str = EXPERIMENT, **stage_epochs: int):
    raw = read_yaml(CONFIGS / "debug.yaml")
    raw["storage_path"] = str(storage)
    for stage in raw["stages"]:
        stage["train"]["epochs"] = stage_epochs.get(stage["name"], 1)
    raw["loggers"] = {
        "tensorboard": True,
        "mlflow": {"tracking_uri": uri, "experiment": experiment},
        "wandb": {"project": "cascade-test", "mode": "offline"},
    }
    return validate_config(raw)


def first_live_events(folder: Path, manifest: Path, stop: threading.Event, seen: dict) -> None:
    """Poll `folder` until its events hold a step scalar; record whether the stage's artifact
    (written by the driver once the fit is over) existed yet."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    deadline = time.monotonic() + LIVE_POLL_TIMEOUT_S
    while not stop.is_set() and time.monotonic() < deadline:
        if any(folder.glob("events.out.tfevents*")):
            events = EventAccumulator(str(folder))
            events.Reload()
            if "step/train_loss" in events.Tags()["scalars"]:
                seen["steps"] = [e.step for e in events.Scalars("step/train_loss")]
                seen["stage_done"] = manifest.exists()
                return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def tracked_run(ray_session, mlflow, tmp_path_factory):
    storage = tmp_path_factory.mktemp("runs")
    cfg = tracked_config(storage, mlflow.uri, features=3)
    run = storage / cfg.name
    seen: dict = {}
    stop = threading.Event()
    poller = threading.Thread(
        target=first_live_events,
        args=(run / "tensorboard" / "features", run / "stages" / "features" / "manifest.json", stop, seen),
        daemon=True,
    )
    poller.start()
    try:
        summary = run_pipeline(cfg, RunOptions(log_level="warning"), log=lambda _: None)
    finally:
        stop.set()
        poller.join(timeout=30)
    return cfg, summary, run, seen


def test_mlflow_holds_the_parent_run_and_one_nested_run_per_stage(tracked_run, mlflow):
    cfg, summary, run, _ = tracked_run
    runs = mlflow.runs(EXPERIMENT)
    parents = [r for r in runs if "mlflow.parentRunId" not in {t["key"] for t in r["data"].get("tags", [])}]
    assert len(parents) == 1
    parent = parents[0]
    assert parent["info"]["status"] == "FINISHED" and parent["info"]["run_name"] == cfg.name
    parent_id = parent["info"]["run_id"]
    children = {}
    for r in runs:
        tags = {t["key"]: t["value"] for t in r["data"].get("tags", [])}
        if tags.get("mlflow.parentRunId") == parent_id:
            children[tags["cascade.stage"]] = (r, tags)
    assert sorted(children) == sorted(s.name for s in cfg.stages)
    records = {s["name"]: s for s in summary["stages"]}
    for stage in cfg.stages:
        child, tags = children[stage.name]
        assert child["info"]["status"] == "FINISHED"
        assert tags["cascade.fingerprint"] == records[stage.name]["fingerprint"]
        assert tags["cascade.nodes"].split(",") == records[stage.name]["nodes"]
        params = {p["key"]: p["value"] for p in child["data"]["params"]}
        assert float(params["solver.lr"]) == stage.solver.lr and params["solver.type"] == stage.solver.type
        # per-step metrics: the same steps and values as the stage's metrics/<stage>.parquet step rows
        rows = pq.read_table(run / "metrics" / f"{stage.name}.parquet").to_pylist()
        step_rows = [r for r in rows if r["kind"] == "step"]
        history = mlflow.get("metrics/get-history", run_id=child["info"]["run_id"], metric_key="step/train_loss")
        logged = sorted((m["step"], m["value"]) for m in history["metrics"])
        assert [s for s, _ in logged] == [r["step"] for r in step_rows] and step_rows
        assert [v for _, v in logged] == pytest.approx([r["train_loss"] for r in step_rows])
        epochs = mlflow.get("metrics/get-history", run_id=child["info"]["run_id"], metric_key="epoch/val_loss")
        assert len(epochs["metrics"]) == stage.train.epochs


def test_the_parent_run_holds_the_run_records_as_artifacts(tracked_run, mlflow):
    _, _, run, _ = tracked_run
    parent = next(
        r for r in mlflow.runs(EXPERIMENT) if "mlflow.parentRunId" not in {t["key"] for t in r["data"]["tags"]}
    )
    run_id = parent["info"]["run_id"]
    top = {f["path"] for f in mlflow.get("artifacts/list", run_id=run_id).get("files", [])}
    assert {"summary.json", "config.yaml", "stages", "metrics"} <= top
    manifests = {f["path"] for f in mlflow.get("artifacts/list", run_id=run_id, path="stages/features")["files"]}
    assert manifests == {"stages/features/manifest.json"}


def test_the_report_pngs_join_the_parent_run(tracked_run, mlflow):
    from cascade_ray.tools.report import build_report

    cfg, _, run, _ = tracked_run
    run_id = json.loads((run / "tracking.json").read_text())["mlflow"]["run_id"]
    build_report(run)
    files = {f["path"] for f in mlflow.get("artifacts/list", run_id=run_id, path="report")["files"]}
    assert {f"report/{s.name}.png" for s in cfg.stages} | {"report/confusion.png", "report/report.md"} <= files


def test_tensorboard_events_are_readable_while_the_stage_still_trains(tracked_run):
    cfg, _, run, seen = tracked_run
    assert seen, "no step events appeared under tensorboard/features while the run went on"
    assert seen["stage_done"] is False  # read before the driver wrote the stage's artifact
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard" / "features"))
    events.Reload()
    rows = pq.read_table(run / "metrics" / "features.parquet").to_pylist()
    assert [e.step for e in events.Scalars("step/train_loss")] == [r["step"] for r in rows if r["kind"] == "step"]
    assert len(events.Scalars("epoch/val_loss")) == cfg.stages[0].train.epochs


def test_wandb_offline_runs_are_written_under_the_run_folder(tracked_run):
    cfg, summary, run, _ = tracked_run
    runs = [offline_run(f) for f in sorted((run / "wandb").glob("offline-run-*"))]
    assert len(runs) == len(cfg.stages) + 1  # a run per stage, and the pipeline's own
    (group,) = {r["group"] for r in runs}
    assert group.startswith(f"{cfg.name}-")
    by_name = {r["name"]: r for r in runs if r["job_type"] == "stage"}
    assert sorted(by_name) == sorted(s.name for s in cfg.stages)
    for stage, record in zip(cfg.stages, summary["stages"]):
        logged = by_name[stage.name]
        assert logged["config"]["cascade.fingerprint"] == record["fingerprint"]
        assert logged["config"]["solver.lr"] == stage.solver.lr
        assert logged["summary"]["cascade.status"] == "trained"
        rows = pq.read_table(run / "metrics" / f"{stage.name}.parquet").to_pylist()
        steps = [h["train_step"] for h in logged["history"] if "step/train_loss" in h]
        assert steps == [r["step"] for r in rows if r["kind"] == "step"]
        assert sum("epoch/val_loss" in h for h in logged["history"]) == stage.train.epochs
    (pipeline,) = [r for r in runs if r["job_type"] == "pipeline"]
    assert pipeline["summary"]["test/loss"] == pytest.approx(summary["test_loss"])
    saved = {
        p.relative_to(f).as_posix() for f in (run / "wandb").glob("offline-run-*") for p in f.rglob("files/*.json")
    }
    assert {"files/summary.json"} <= saved


def test_a_tracking_server_stopped_mid_stage_is_reported_once_and_training_goes_on(digits, tmp_path, capsys):
    server = start_mlflow(tmp_path)
    try:
        cfg = tracked_config(tmp_path / "runs", server.uri, experiment="stopped")
        cfg = validate_config(cfg.model_dump(mode="json") | {"loggers": {"mlflow": {"tracking_uri": server.uri}}})
        tracking = PipelineTracking(cfg, tmp_path / "runs" / cfg.name, log=print)
        assert tracking.parent is not None
        hooks, finish = observer_hooks(
            {"tracking": tracking.context().to_dict()}, cfg, 0, 0, 1, torch.device("cpu"), nodes=["n"]
        )
        stopped = LoopHooks(on_row=lambda s: server.stop())  # after the first row was logged
        reporter = ListReporter()
        outcome = run_stage(cfg, 0, digits, None, reporter, torch.device("cpu"), hooks=chain_hooks(hooks, stopped))
        finish(False)
    finally:
        server.stop()
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if "the mlflow logger failed" in line]
    assert len(failed) == 1 and "[features] tracking" in failed[0] and "training goes on" in failed[0], out
    assert len(reporter.reports) == cfg.stages[0].train.epochs and outcome.steps > 0


CLASSIFIER_SPACE = """
stage: classifier
metric: val_accuracy
mode: max
num_samples: 2
scheduler: {type: fifo}
space:
  solver.lr: {loguniform: [1.0e-3, 3.0e-2]}
"""


def test_tune_trials_get_a_nested_run_each(tracked_run, mlflow, tmp_path):
    """Last in the module: it adds runs to the same run folder (reused upstream, a swept classifier)."""
    _, _, run, _ = tracked_run
    space = tmp_path / "classifier.yaml"
    space.write_text(CLASSIFIER_SPACE)
    cfg = tracked_config(run.parent, mlflow.uri, experiment="debug-sweep", features=3)
    options = RunOptions(
        log_level="warning", resume=True, spaces=(("classifier", str(space)),), stop_after="classifier"
    )
    summary = run_pipeline(cfg, options, log=lambda _: None)
    assert [s["status"] for s in summary["stages"]] == ["reused", "reused", "tuned"]
    runs = mlflow.runs("debug-sweep")
    tags = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs]
    (parent,) = [r["info"]["run_id"] for r, t in zip(runs, tags) if "mlflow.parentRunId" not in t]
    trials = [(r, t) for r, t in zip(runs, tags) if t.get("mlflow.parentRunId") == parent]
    assert len(trials) == 2 and all(t["cascade.stage"] == "classifier" and t["cascade.trial_id"] for _, t in trials)
    for r, t in trials:
        assert r["info"]["run_name"] == f"classifier trial {t['cascade.trial_id']}"
        history = mlflow.get("metrics/get-history", run_id=r["info"]["run_id"], metric_key="epoch/val_accuracy")
        assert len(history["metrics"]) == 1
