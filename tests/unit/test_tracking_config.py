"""The loggers: section: schema, the probes validate runs before Ray, the one-warning guard,
and that nothing imports mlflow or wandb unless a config asks for them. No server, no Ray."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from cascade_ray.checks import validate_config
from cascade_ray.checks.reach import reach_issues
from cascade_ray.errors import ConfigError
from cascade_ray.tracking import Loggers, flatten, param_text, scalars


def dead_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_loggers(raw, tmp_path, **loggers):
    raw["storage_path"] = str(tmp_path)
    raw["loggers"] = loggers
    return validate_config(raw)


def test_unknown_logger_keys_and_modes_name_the_key(debug_raw, tmp_path):
    with pytest.raises(ConfigError) as info:
        with_loggers(
            debug_raw,
            tmp_path,
            mlflow={"tracking_uri": "http://x", "experimnt": "a"},
            wandb={"project": "p", "mode": "offlin"},
        )
    text = str(info.value)
    assert "loggers.mlflow.experimnt" in text and "experiment" in text
    assert "loggers.wandb.mode" in text and "offline" in text


def test_an_mlflow_server_that_does_not_answer_fails_validation_naming_the_uri_key(debug_raw, tmp_path):
    cfg = with_loggers(debug_raw, tmp_path, mlflow={"tracking_uri": f"http://127.0.0.1:{dead_port()}"})
    issues = [i for i in reach_issues(cfg) if i.path.startswith("loggers")]
    assert [i.path for i in issues] == ["loggers.mlflow.tracking_uri"]
    assert "cannot be reached" in issues[0].message and "mlflow server" in issues[0].fix


def test_a_local_mlflow_database_needs_no_server_and_a_refused_folder_store_is_an_error(debug_raw, tmp_path):
    local = with_loggers(debug_raw, tmp_path, mlflow={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    assert [i for i in reach_issues(local) if i.path.startswith("loggers")] == []
    relative = with_loggers(debug_raw, tmp_path, mlflow={"tracking_uri": "sqlite:///mlflow.db"})
    assert [i.path for i in reach_issues(relative)] == ["loggers.mlflow.tracking_uri"]
    # mlflow 3.x refuses folder stores (./mlruns) unless MLFLOW_ALLOW_FILE_STORE is set
    folder = with_loggers(debug_raw, tmp_path, mlflow={"tracking_uri": f"file://{tmp_path / 'mlruns'}"})
    issues = [i for i in reach_issues(folder) if i.path.startswith("loggers")]
    assert [i.path for i in issues] == ["loggers.mlflow.tracking_uri"] and "sqlite:///" in issues[0].fix


def test_wandb_online_without_its_server_suggests_offline(debug_raw, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{dead_port()}")
    cfg = with_loggers(debug_raw, tmp_path, wandb={"project": "p"})
    issues = [i for i in reach_issues(cfg) if i.path.startswith("loggers")]
    assert [i.path for i in issues] == ["loggers.wandb.mode"] and "offline" in issues[0].fix
    offline = with_loggers(debug_raw, tmp_path, wandb={"project": "p", "mode": "offline"})
    assert [i for i in reach_issues(offline) if i.path.startswith("loggers")] == []


class Flaky:
    name = "flaky"

    def __init__(self):
        self.rows = []

    def log(self, group, row):
        if len(self.rows) == 1:
            raise ConnectionError("server went away")
        self.rows.append((group, row["step"]))

    def close(self, failed):
        raise AssertionError("a disabled logger is not closed")


class Keeper:
    name = "keeper"

    def __init__(self):
        self.rows, self.closed = [], None

    def log(self, group, row):
        self.rows.append((group, row["step"]))

    def close(self, failed):
        self.closed = failed


def test_a_failing_logger_warns_once_and_the_others_go_on():
    flaky, keeper, lines = Flaky(), Keeper(), []
    loggers = Loggers([flaky, keeper], "[features] tracking", warn=lines.append)
    for step in (10, 20, 30):
        loggers.log("step", {"step": step, "train_loss": 1.0})
    loggers.close(failed=False)
    assert flaky.rows == [("step", 10)] and keeper.rows == [("step", 10), ("step", 20), ("step", 30)]
    assert keeper.closed is False
    assert len(lines) == 1 and "the flaky logger failed at step 20" in lines[0] and "server went away" in lines[0]


def test_rows_and_params_are_flattened_for_the_trackers():
    flat = flatten({"solver": {"lr": 0.01, "betas": [0.9, 0.99]}, "model": None})
    assert flat == {"solver.lr": 0.01, "solver.betas": [0.9, 0.99], "model": None}
    assert [param_text(v) for v in flat.values()] == ["0.01", "[0.9, 0.99]", "null"]
    assert scalars({"kind": "step", "epoch": 1, "step": 10, "train_loss": 0.5, "nan": float("nan"), "ok": True}) == {
        "train_loss": 0.5
    }


def test_validate_imports_no_tracker_package(tmp_path):
    """validate (schema, semantic checks, reach) of a config without loggers imports neither
    mlflow nor wandb; the tracking modules import them only when a logger opens."""
    code = (
        "import sys;"
        "from cascade_ray.checks import load_config;"
        "from cascade_ray.checks.reach import reach_issues;"
        "import cascade_ray.tracking.stage_runs, cascade_ray.tracking.pipeline_run, cascade_ray.stage.observe;"
        f"cfg = load_config('pipelines/configs/debug.yaml', ['storage_path={tmp_path}']);"
        "reach_issues(cfg);"
        "print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_a_run_with_an_unreachable_tracking_server_fails_before_ray_starts(debug_raw, tmp_path):
    import ray

    from cascade_ray.api import run_pipeline

    cfg = with_loggers(debug_raw, tmp_path, mlflow={"tracking_uri": f"http://127.0.0.1:{dead_port()}"})
    with pytest.raises(ConfigError, match=r"loggers\.mlflow\.tracking_uri"):
        run_pipeline(cfg, log=lambda _: None)
    assert not ray.is_initialized() and not (tmp_path / cfg.name / "ray").exists()


def test_a_failed_run_ends_its_parent_run_failed_in_a_local_mlflow_store(debug_raw, tmp_path, digits):
    """The driver's pipeline run and rank 0's stage run against MLflow's local file store (no
    server): the stage run holds the step rows as they were logged; an error ends both FAILED."""
    import torch
    from fakes import ListReporter
    from mlflow.tracking import MlflowClient

    from cascade_ray.stage.loop import run_stage
    from cascade_ray.stage.observe import observer_hooks
    from cascade_ray.tracking.pipeline_run import PipelineTracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    debug_raw["stages"][0]["train"]["epochs"] = 1
    cfg = with_loggers(debug_raw, tmp_path, mlflow={"tracking_uri": uri, "experiment": "local"})
    with (
        pytest.raises(RuntimeError, match="a stage broke"),
        PipelineTracking(cfg, tmp_path / cfg.name, log=print) as run,
    ):
        hooks, finish = observer_hooks({"tracking": run.context().to_dict()}, cfg, 0, 0, 1, torch.device("cpu"))
        reporter = ListReporter()
        run_stage(cfg, 0, digits, None, reporter, torch.device("cpu"), hooks=hooks)
        finish(True)
        raise RuntimeError("a stage broke")
    client = MlflowClient(uri)
    parent = client.get_run(run.parent)
    assert parent.info.status == "FAILED" and parent.data.params["seed"] == "0"
    (child,) = client.search_runs([run.experiment], f"tags.`mlflow.parentRunId` = '{run.parent}'")
    assert child.info.status == "FAILED" and child.data.params["solver.type"] == "AdamW"
    steps = [m.step for m in client.get_metric_history(child.info.run_id, "step/train_loss")]
    assert steps == [r["step"] for r in reporter.trainers[-1]["history"][0]["steps"]] and steps


def test_a_stage_run_whose_worker_died_is_ended_killed_with_the_pipeline_run(debug_raw, tmp_path):
    """A rank 0 killed outright never closes its run; the driver's pipeline run ends it KILLED
    (and leaves the runs that did close as they ended)."""
    from mlflow.tracking import MlflowClient

    from cascade_ray.tracking.mlflow_runs import MlflowStageLogger
    from cascade_ray.tracking.pipeline_run import PipelineTracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = with_loggers(debug_raw, tmp_path, mlflow={"tracking_uri": uri, "experiment": "orphans"})
    with PipelineTracking(cfg, tmp_path / cfg.name, log=print) as run:
        died = MlflowStageLogger(uri, run.experiment, run.parent, "features", {}, {})
        died.log("step", {"step": 1, "train_loss": 2.0})  # then the worker is gone: no close()
        closed = MlflowStageLogger(uri, run.experiment, run.parent, "features", {}, {})
        closed.close(failed=False)
    client = MlflowClient(uri)
    assert client.get_run(died.run_id).info.status == "KILLED"
    assert client.get_run(died.run_id).data.tags["cascade.status"] == "killed"
    assert client.get_run(closed.run_id).info.status == "FINISHED"
    assert client.get_run(run.parent).info.status == "FINISHED"


@pytest.mark.parametrize("body", ["{half", "[1, 2]", '{"mlflow": {"run_id": 7}}'])
def test_a_damaged_tracking_record_is_a_warning_not_a_traceback(tmp_path, body):
    from cascade_ray.tracking.pipeline_run import TRACKING_FILE, log_report

    (tmp_path / TRACKING_FILE).write_text(body)
    lines: list[str] = []
    assert log_report(tmp_path, tmp_path, log=lines.append) is None
    assert len(lines) == 1 and "is unreadable" in lines[0] and "not added to MLflow" in lines[0]
