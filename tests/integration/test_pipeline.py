"""The debug cascade end to end on a real (local) Ray: stage jobs, hand-off, artifacts, summary."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from paths import CONFIGS

from cascade_ray.api import RunOptions, run_pipeline
from cascade_ray.checks import load_config
from cascade_ray.errors import CascadeError, FrozenDriftError, ResourceError
from cascade_ray.pipeline.artifacts import MANIFEST, read_artifact
from cascade_ray.pipeline.records import read_manifest, read_summary
from cascade_ray.stage.startup import PHASES


@pytest.fixture(scope="module")
def debug_run(ray_session, tmp_path_factory):
    """The debug pipeline, with `--profile encoder`; the driver's stdout (the progress display,
    no TTY) is kept in {storage}/driver_stdout.txt."""
    storage = tmp_path_factory.mktemp("runs")
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={storage}"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = run_pipeline(cfg, RunOptions(profile={"encoder"}), log=lambda _: None)
    (storage / "driver_stdout.txt").write_text(out.getvalue())
    return cfg, summary


def test_summary_lists_every_stage(debug_run, ray_session):
    cfg, summary = debug_run
    on_disk = json.loads((Path(summary["storage"]) / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    typed = read_summary(Path(summary["storage"]) / "summary.json")  # every stage record validates
    for record in typed.stages:
        manifest = read_manifest(Path(record.artifact) / MANIFEST)
        assert (manifest.stage, manifest.fingerprint, manifest.weights_sha256) == (
            record.name,
            record.fingerprint,
            record.digest,
        )
    assert [s["name"] for s in summary["stages"]] == ["features", "encoder", "classifier"]
    for stage, stage_cfg in zip(summary["stages"], cfg.stages):
        assert stage["num_workers"] == stage_cfg.scaling.num_workers
        assert len(stage["history"]) == stage_cfg.train.epochs
        assert {"name", "metrics", "wall_s", "trainable_params", "frozen_params", "artifact", "digest"} <= set(stage)
    for stage in summary["stages"]:  # where each fit's seconds went before its first step
        startup = stage["startup"]
        assert set(startup) == {*PHASES, "to_first_step_s"}, startup
        assert all(v >= 0 for v in startup.values()) and 0 < startup["to_first_step_s"] < stage["wall_s"]
        assert sum(startup[p] for p in PHASES) == pytest.approx(startup["to_first_step_s"], abs=0.01)
    assert summary["stages"][1]["num_workers"] == 2  # DDP over gloo
    node = ray_session.get_runtime_context().get_node_id()
    assert [s["nodes"] for s in summary["stages"]] == [[node], [node, node], [node]]  # one per rank, one node here
    assert summary["stages"][0]["frozen_params"] == 0
    assert (
        summary["stages"][2]["frozen_params"]
        == summary["stages"][1]["frozen_params"] + summary["stages"][1]["trainable_params"]
    )
    # digits, 2 short epochs per stage: measured 0.95 in-process (chance is 0.1)
    assert summary["test_accuracy"] > 0.8


def test_frozen_stages_are_bit_identical_in_every_later_artifact(debug_run):
    _, summary = debug_run
    states = [read_artifact(s["artifact"])[1] for s in summary["stages"]]
    for i, earlier in enumerate(states):
        for later in states[i + 1 :]:
            for key, value in earlier.items():
                assert value.dtype == later[key].dtype and np.array_equal(value, later[key]), key
    assert any("running_mean" in k for k in states[0]), "BatchNorm buffers are part of the check"


def test_a_rerun_never_resumes_an_old_ray_run(debug_run):
    _, summary = debug_run
    names = sorted(p.name for p in (Path(summary["storage"]) / "ray").iterdir())
    assert len(names) == 3 and all(n.endswith("-a1") for n in names)
    from cascade_ray.pipeline.fit import unique_run_name

    cfg, _ = debug_run
    assert unique_run_name(Path(summary["storage"]) / "ray", cfg.stages[0], 0, names[0].split("-")[2]).endswith("-a2")


def test_more_workers_than_cpus_fails_before_training(ray_session, tmp_path):
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={tmp_path}", "stages[1].scaling.num_workers=3"])
    with pytest.raises(ResourceError, match=r"stages\[1\].scaling.*3 worker"):
        run_pipeline(cfg, log=lambda _: None)
    assert not (tmp_path / "debug" / "stages").exists()


# a first stage whose module drifts whenever it runs (frozen, it must not), then a one-epoch encoder
DRIFTING_UPSTREAM = [
    "trusted_modules=[user_models]",
    "stages[0].model={type: 'user_models:drifting', in_features: 64, width: 64}",
    "stages[0].train.epochs=1",
    "stages[1].model={type: mlp, in_features: 64, hidden: [16]}",
    "stages[1].scaling.num_workers=1",
    "stages[1].train.epochs=1",
]


def test_frozen_drift_in_a_worker_is_an_error_in_the_driver(ray_session, tmp_path):
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [
            f"storage_path={tmp_path}",
            *DRIFTING_UPSTREAM,
            # the module drifts when it runs; on cached features the worker never runs it
            "stages[1].freeze.cache_features=off",
        ],
    )
    with pytest.raises(FrozenDriftError, match="calls"):
        run_pipeline(cfg, log=lambda _: None)
    # the first stage's artifact survives the failure of the second
    assert read_artifact(tmp_path / "debug" / "stages" / "features")[1]


def test_frozen_drift_while_the_feature_cache_is_computed_is_an_error_too(ray_session, tmp_path):
    """On cached features the worker never runs the upstream, so its drift check saw nothing: a module that
    updates its state in forward trained on features from states other than its artifact's, silently."""
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={tmp_path}", *DRIFTING_UPSTREAM])
    assert cfg.stages[1].freeze.cache_features != "off"
    with pytest.raises(FrozenDriftError, match=r"stage 'encoder': 1 frozen tensor\(s\) changed.*calls"):
        run_pipeline(cfg, log=lambda _: None)
    assert read_artifact(tmp_path / "debug" / "stages" / "features")[1]


def test_an_error_a_restart_would_repeat_ends_the_stage_without_using_its_restarts(ray_session, tmp_path):
    """A health error (SGD at lr 1e30: the loss is NaN within the first steps) under max_failures: 2. Ray
    Train would restart the worker group twice, from scratch, and fail the same way each time; cascade-ray's
    NoRetry callback ends the fit at the first failure: the stage module is built by one worker, not three."""
    from cascade_ray.errors import HealthError

    built = tmp_path / "built.txt"  # one line per process that built the encoder's module
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [
            f"storage_path={tmp_path}",
            "trusted_modules=[user_models]",
            f"stages[1].model={{type: 'user_models:counted', in_channels: 16, width: 16, log: '{built}'}}",
            "stages[1].scaling.num_workers=1",
            "stages[1].solver.type=SGD",
            "stages[1].solver.lr=1e30",
            "stages[1].max_failures=2",
            "stages[0].train.epochs=1",
        ],
    )
    with pytest.raises(HealthError, match=r"stages\[1\]\.health\.nonfinite") as failed:
        run_pipeline(cfg, RunOptions(stop_after="encoder"), log=lambda _: None)
    assert "Traceback" not in str(failed.value)  # the worker's error itself, not Ray's wrapper of it
    workers = set(built.read_text().split()) - {str(os.getpid())}  # the driver built it to validate
    assert len(workers) == 1, workers


def test_an_exception_in_a_users_module_ends_as_a_stage_error_naming_its_line(ray_session, tmp_path):
    """A plain exception raised by the training code (here a user module's forward) ended the run with Ray's
    WorkerGroupError: a truncated traceback, no stage, and the same in summary.json. It is now a
    StageFailedError: the stage, the exception's last line and the user's frame."""
    from cascade_ray.errors import StageFailedError

    cfg = load_config(
        CONFIGS / "debug.yaml",
        [
            f"storage_path={tmp_path}",
            "trusted_modules=[user_models]",
            "stages[1].model={type: 'user_models:raises_in_training', in_channels: 16, width: 16}",
            "stages[1].scaling.num_workers=1",
            "stages[0].train.epochs=1",
        ],
    )
    with pytest.raises(StageFailedError) as failed:
        run_pipeline(cfg, log=lambda _: None)
    said = str(failed.value)
    assert said.startswith("stage 'encoder': the training raised ValueError: user module bug: cannot take a batch")
    assert "user_models.py:" in said and "in forward)" in said and "Traceback" not in said, said
    assert "rerun with --resume" in failed.value.fix
    summary = read_summary(tmp_path / "debug" / "summary.json")
    assert summary.stages[1].status == "failed" and "user module bug" in summary.stages[1].error
    assert read_artifact(tmp_path / "debug" / "stages" / "features")[1]  # the finished stage stays


def test_a_crash_in_stage_3_leaves_the_done_stages_outputs_and_resume_finishes_it(ray_session, tmp_path, capsys):
    """Stage 3 fails in its worker (its module raises once it trains): stages 1-2's metrics and a failed
    summary stay; report (and --html) work on it; --resume with the module fixed finishes it. (It was an
    upstream that drifts, on un-cached inputs, until the cache's own drift check failed stage 2 first.)"""
    from cascade_ray.cli import main as cli_main
    from cascade_ray.errors import RunFinishedError, StageFailedError
    from cascade_ray.pipeline.outputs import read_metrics
    from cascade_ray.tools.inference import load_cascade, run_summary

    base = [f"storage_path={tmp_path}", "stages[0].train.epochs=1", "stages[2].train.epochs=1"]
    bug = "stages[2].model={type: 'user_models:raises_in_training', in_channels: 16, width: 16, layer: linear}"
    crash = load_config(CONFIGS / "debug.yaml", [*base, "trusted_modules=[user_models]", bug])
    with pytest.raises(StageFailedError, match="user module bug"):
        run_pipeline(crash, log=lambda _: None)
    run = tmp_path / "debug"
    summary = read_summary(run / "summary.json")
    assert summary.status == "failed" and summary.test_loss is None
    assert [s.status for s in summary.stages] == ["trained", "trained", "failed"]
    assert summary.stages[2].error.startswith("StageFailedError") and "user module bug" in summary.stages[2].error
    metrics = read_metrics(run)
    assert set(metrics) == {"features", "encoder"} and all(metrics.values())
    assert (run / "tensorboard" / "encoder").is_dir()
    with pytest.raises(CascadeError, match="not a finished run"):
        run_summary(run)
    encoder = load_cascade(run / "stages" / "encoder")  # a done stage loads from the partial run
    assert encoder.stage == "encoder"
    # ... and exports, as run_summary's error says (export asked for the summary and refused)
    from cascade_ray.tools.export import export_run

    exported = export_run(run / "stages" / "encoder")
    assert exported["stage"] == "encoder" and (run / "export" / "encoder" / "pt2.json").is_file()
    capsys.readouterr()  # the run's own progress lines
    assert cli_main(["report", str(run), "--html"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(run / "report" / "report.html")
    html = (run / "report" / "report.html").read_text()
    assert "StageFailedError" in html and "Stage classifier (failed)" in html and "Stage encoder (trained)" in html
    assert "| classifier | failed |" in (run / "report" / "report.md").read_text()
    # a failed run is not finished: --resume reuses the done stages and finishes it
    fixed = load_config(CONFIGS / "debug.yaml", base)
    done = run_pipeline(fixed, RunOptions(resume=True), log=lambda _: None)
    assert [s["status"] for s in done["stages"]] == ["reused", "reused", "trained"]
    assert read_summary(run / "summary.json").status == "finished"
    with pytest.raises(RunFinishedError):  # now it is finished
        run_pipeline(fixed, log=lambda _: None)


def test_resume_reuses_matching_stages_and_retrains_what_changed(debug_run):
    cfg, first = debug_run
    again = run_pipeline(cfg, RunOptions(resume=True), log=lambda _: None)
    assert [s["status"] for s in again["stages"]] == ["reused"] * 3
    assert again["test_accuracy"] == first["test_accuracy"]

    def step_rows(summary):  # (step, train loss) of every per-step row: carried by the artifact manifest
        return [[(r["step"], r["train_loss"]) for h in s["history"] for r in h["steps"]] for s in summary["stages"]]

    assert step_rows(again) == step_rows(first) and all(step_rows(first))
    storage = Path(first["storage"]).parent
    changed = load_config(
        CONFIGS / "debug.yaml", [f"storage_path={storage}", "stages[2].solver.lr=5e-3"]
    )  # downstream only
    rerun = run_pipeline(changed, RunOptions(resume=True), log=lambda _: None)
    assert [s["status"] for s in rerun["stages"]] == ["reused", "reused", "trained"]
    assert rerun["stages"][2]["fingerprint"] != first["stages"][2]["fingerprint"]


def test_run_outputs_metrics_predictions_and_report_pngs(debug_run):
    from cascade_ray.cli import main as cli_main
    from cascade_ray.pipeline.outputs import read_metrics, read_predictions

    run = Path(debug_run[1]["storage"])
    summary = json.loads((run / "summary.json").read_text())  # the latest run in this folder (resume test reruns)
    metrics = read_metrics(run)
    assert set(metrics) == {"features", "encoder", "classifier"}
    assert [r["epoch"] for r in metrics["features"] if r["kind"] == "epoch"] == [1, 2]
    labels, predictions = read_predictions(run)
    assert (labels == predictions).mean() == pytest.approx(summary["test_accuracy"])
    assert cli_main(["report", str(run)]) == 0
    report = (run / "report" / "report.md").read_text()
    for png in ("features.png", "encoder.png", "classifier.png", "confusion.png"):
        assert f"]({png})" in report
        assert (run / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_matches_the_eager_model(debug_run):
    """The default export (pt2) of the pipeline's own run; the other formats: tests/integration/test_export.py."""
    from cascade_ray.tools.export import export_run

    run = Path(debug_run[1]["storage"])
    summary = json.loads((run / "summary.json").read_text())  # the latest run in this folder
    report = export_run(run, quantize="int8")
    assert Path(report["path"]).is_file() and report["path"].endswith("model.pt2")
    assert report["parity"] == "ok" and report["max_abs_diff"] < 1e-4, report
    # the exported model is the composed model: same accuracy as the pipeline measured
    assert report["eager_test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert abs(report["int8_accuracy_change"]) < 0.1


def test_a_crashed_worker_resumes_from_its_checkpoint_bit_identically(debug_run, tmp_path, monkeypatch):
    from cascade_ray.constants import FAULT_ONCE_ENV

    _, reference = debug_run
    marker = tmp_path / "fault.marker"
    # step 40 is in epoch 2 of features (36 steps per epoch): the restart redoes epoch 2
    monkeypatch.setenv(FAULT_ONCE_ENV, f"features:40:{marker}")
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={tmp_path}", "stages.features.max_failures=1"])
    summary = run_pipeline(cfg, RunOptions(stop_after="features"), log=lambda _: None)
    assert marker.read_text().startswith("killed at step 40"), "the fault was injected"
    record = summary["stages"][0]
    assert record["metrics"]["step"] == 72 and [m["epoch"] for m in record["history"]] == [1, 2]
    _, resumed = read_artifact(record["artifact"])
    _, straight = read_artifact(reference["stages"][0]["artifact"])
    assert resumed.keys() == straight.keys()
    for key, value in straight.items():
        assert np.array_equal(value, resumed[key]), key


def test_progress_step_rows_tensorboard_and_profile(debug_run):
    """Issue 8: the driver's progress lines, per-step metric rows, TensorBoard events, --profile."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cascade_ray.pipeline.outputs import read_metrics

    run = Path(debug_run[1]["storage"])
    shown = (run.parent / "driver_stdout.txt").read_text().splitlines()
    # plain lines (no TTY), ending each stage with its last step (2 epochs x 36 steps; 18 on 2 workers)
    progress = [line for line in shown if line.startswith("stage ")]
    for done in (
        "stage 1/3 features | epoch 2/2 | step 72/72 | loss ",
        "stage 2/3 encoder | epoch 2/2 | step 36/36 | loss ",
        "stage 3/3 classifier | epoch 2/2 | step 72/72 | loss ",
    ):
        assert any(line.startswith(done) for line in progress), progress
    assert [line.split(" ")[1] for line in progress] == sorted(
        line.split(" ")[1] for line in progress
    )  # stage by stage
    assert not any("\r" in line for line in shown)
    # the profile: a Chrome trace in the run folder and its top operators, shown by the driver
    assert any(line.startswith("profile of stage 'encoder': 5 optimizer step(s) recorded") for line in shown), shown
    assert "aten::" in "\n".join(shown)
    assert json.loads((run / "profile" / "encoder.trace.json").read_text())["traceEvents"]
    assert not (run / "profile" / "features.trace.json").exists()
    # step rows every log_interval (10) steps, measured grad norm (health.interval 10), then the epoch row
    rows = read_metrics(run)["features"]
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(10, 72, 10))
    assert all(
        np.isfinite(r["train_loss"]) and r["grad_norm"] > 0 and r["lr"] == 0.01 and r["samples_per_s"] > 0
        for r in steps
    )
    assert [r["kind"] for r in rows[:4]] == ["step", "step", "step", "epoch"] and rows[3]["val_accuracy"] is not None
    assert steps[0]["val_accuracy"] is None
    # TensorBoard: the same scalars against the optimizer step
    events = EventAccumulator(str(run / "tensorboard" / "features"))
    events.Reload()
    assert [e.step for e in events.Scalars("step/train_loss")] == list(range(10, 72, 10))
    assert [e.step for e in events.Scalars("epoch/val_accuracy")] == [36, 72]
