"""``tune --batched`` end to end: the debug cascade's classifier swept as 4 replicas in one
2-worker (DDP) TorchTrainer job, on the cached features of the upstream the run trains first."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray
from fakes import wrong_handoff_digest
from paths import CONFIGS

from cascade_ray.api import RunOptions, run_pipeline
from cascade_ray.checks import load_config
from cascade_ray.config.yaml_io import read_yaml
from cascade_ray.data.source import load_data
from cascade_ray.pipeline.artifacts import read_artifact
from cascade_ray.pipeline.features import upstream_outputs
from cascade_ray.pipeline.fit import fit_stage
from cascade_ray.stage.startup import PHASES
from cascade_ray.stage.worker import read_checkpoint
from cascade_ray.storage import as_storage
from cascade_ray.tune.sweep import STARTUP_FILE, trial_config

SPACE = """
stage: classifier
metric: val_accuracy
mode: max
num_samples: 4
scheduler: {type: fifo}
space:
  solver.lr: {loguniform: [1.0e-3, 3.0e-2]}
  loss.scale: {choice: [0.5, 1.0]}
"""
QUICK = [
    "stages.features.train.epochs=1",
    "stages.encoder.train.epochs=1",
    "stages.encoder.scaling.num_workers=1",
    "stages.classifier.scaling.num_workers=2",  # the batched job runs DDP, as a normal 2-worker stage
]


@pytest.fixture(scope="module")
def sweep(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batched")
    space = tmp / "classifier.yaml"
    space.write_text(SPACE)
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={tmp}", *QUICK])
    started = time.perf_counter()
    summary = run_pipeline(
        cfg, RunOptions(spaces=(("classifier", str(space)),), stop_after="classifier", batched=True), log=lambda _: None
    )
    return cfg, summary, time.perf_counter() - started, tmp


def test_a_batched_sweep_writes_the_plain_sweeps_outputs_and_adopts_the_best_replica(sweep):
    cfg, summary, elapsed, tmp = sweep
    record = summary["stages"][2]
    assert record["status"] == "tuned" and record["sweep"]["trials"] == 4
    exp = Path(summary["storage"]) / "tune" / "classifier"
    assert [p.name for p in (exp / "trials").iterdir()] == ["batched-a1"]  # one TorchTrainer job for 4 configs
    # the one fit's start-up phases, recorded where a Tune trial records its own
    startup = json.loads((exp / "trials" / "batched-a1" / STARTUP_FILE).read_text())
    assert set(startup) == {*PHASES, "to_first_step_s"}, startup
    assert startup["to_first_step_s"] == pytest.approx(sum(startup[p] for p in PHASES), abs=0.01)
    assert startup["ray_train_s"] > 0 and startup["setup_s"] > 0, startup

    table = pq.read_table(record["sweep"]["results"]).to_pylist()
    scores = [row["val_accuracy"] for row in table]
    assert len(table) == 4 and scores == sorted(scores, reverse=True)
    assert {"trial_id", "epoch", "config/solver.lr", "config/loss.scale"} <= set(table[0])
    # evaluate_current: one replica ran the stage's own values
    assert any(r["config/solver.lr"] == pytest.approx(1e-2) and r["config/loss.scale"] == 1.0 for r in table)
    best = read_yaml(record["sweep"]["best"])
    assert best == {
        "stages.classifier.solver.lr": table[0]["config/solver.lr"],
        "stages.classifier.loss.scale": table[0]["config/loss.scale"],
    }

    replicas = json.loads((exp / "replicas.json").read_text())
    assert len(replicas) == 4 and all(len(r["history"]) == cfg.stages[2].train.epochs for r in replicas)
    winner = next(r for r in replicas if r["trial_id"] == table[0]["trial_id"])
    assert max(h["val_accuracy"] for h in winner["history"]) == pytest.approx(scores[0])

    # the adopted weights are the best config trained alone, as a normal 2-worker stage fit on the
    # same upstream and features, at its best epoch by val_loss (the checkpoint the fit keeps)
    _, upstream = read_artifact(summary["stages"][1]["artifact"])
    _, adopted = read_artifact(record["artifact"])
    best_cfg = trial_config(cfg, "classifier", winner["values"])
    assert best_cfg.stages[2].scaling.num_workers == 2
    data = load_data(best_cfg.data, best_cfg.seed)
    out = upstream_outputs(best_cfg, 2, data, upstream)
    lone_started = time.perf_counter()
    result = fit_stage(
        best_cfg,
        2,
        data_ref=ray.put(data.to_arrays()),
        upstream_ref=ray.put(upstream),
        ray_dir=as_storage(str(tmp / "lone")),
        run_name="lone-classifier",
        features_ref=ray.put({"x_train": out["train"], "x_val": out["val"]}),
    )
    lone_s = time.perf_counter() - lone_started
    lone = result.return_value
    assert lone["world_size"] == 2
    for mine, theirs in zip(winner["history"], lone["history"], strict=True):  # rank 0's metrics, every epoch
        for name in ("train_loss", "val_loss", "val_accuracy", "lr", "step"):
            assert mine[name] == pytest.approx(theirs[name], rel=1e-5), name
    assert record["metrics"]["val_loss"] == pytest.approx(min(h["val_loss"] for h in lone["history"]), rel=1e-5)
    with result.checkpoint.as_directory() as folder:
        kept = read_checkpoint(folder, upstream).state  # its frozen entries named by digest: taken from the upstream
    worst = 0.0
    for key, value in kept.items():
        np.testing.assert_allclose(adopted[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
        worst = max(worst, float(np.max(np.abs(adopted[key] - value), initial=0.0)))
    print(
        f"batched sweep pipeline (features + encoder + 4-replica 2-worker classifier): {elapsed:.1f} s; "
        f"lone 2-worker classifier fit: {lone_s:.1f} s; max |adopted - lone| {worst:.2e}"
    )


def test_a_killed_batched_job_continues_after_its_last_epoch_and_resume_reuses_its_state(sweep, tmp_path, monkeypatch):
    """On the module run's upstream (copied, reused by --resume): rank 0 is killed in the second
    epoch and the restarted worker group (max_failures: 1) continues every replica after the
    first, from the job's own resume state, ending with the module's uninterrupted sweep's epochs;
    a later ``tune --resume`` verifies that finished state and uses it with the job's own
    checkpoint, starting no job."""
    import shutil

    from cascade_ray.constants import FAULT_ONCE_ENV

    cfg, summary, _, tmp = sweep
    for stage in ("features", "encoder"):
        shutil.copytree(Path(summary["storage"]) / "stages" / stage, tmp_path / cfg.name / "stages" / stage)
    exp = Path(summary["storage"]) / "tune" / "classifier"
    reference = json.loads((exp / "replicas.json").read_text())
    kill_at = reference[0]["history"][0]["step"] + 1  # the first optimizer step of the second epoch
    marker = tmp_path / "killed.txt"
    monkeypatch.setenv(FAULT_ONCE_ENV, f"classifier:{kill_at}:{marker}")
    space = tmp / "classifier.yaml"
    again = load_config(
        CONFIGS / "debug.yaml", [f"storage_path={tmp_path}", *QUICK, "stages.classifier.max_failures=1"]
    )
    options = RunOptions(spaces=(("classifier", str(space)),), stop_after="classifier", batched=True, resume=True)

    def sweep_again():
        logs = []
        record = run_pipeline(again, options, log=logs.append)["stages"][2]
        mine = json.loads((tmp_path / cfg.name / "tune" / "classifier" / "replicas.json").read_text())
        assert [r["values"] for r in mine] == [r["values"] for r in reference]
        for ours, theirs in zip(mine, reference):
            assert len(ours["history"]) == len(theirs["history"]) == cfg.stages[2].train.epochs
            for row, ref in zip(ours["history"], theirs["history"]):
                for name in ("train_loss", "val_loss", "val_accuracy", "lr", "step"):
                    assert row[name] == pytest.approx(ref[name], rel=1e-5), name
        assert record["sweep"]["trials"] == 4
        return "\n".join(logs), record

    log, record = sweep_again()
    assert marker.exists(), "the fault was never injected"
    assert "no earlier attempt of these 4 configs kept a resume state" in log
    assert "its 4 replicas continued after epoch 1" in log  # the restarted group, from this job's own state
    assert record["metrics"]["val_loss"] == pytest.approx(summary["stages"][2]["metrics"]["val_loss"], rel=1e-5)

    log, again = sweep_again()  # a finished attempt: its results and checkpoint are used, no job starts
    assert "batched-a1 already trained all 4 configs to their end" in log and "no job is started" in log
    assert "continued after epoch" not in log
    trials = tmp_path / cfg.name / "tune" / "classifier" / "trials"
    assert sorted(p.name for p in trials.iterdir()) == ["batched-a1"]
    assert again["metrics"]["val_loss"] == pytest.approx(record["metrics"]["val_loss"], rel=1e-5)


def test_the_hand_offs_digests_reach_the_batched_workers(sweep, tmp_path, monkeypatch):
    """The batched job's replicas check their frozen upstream against the digests the driver's hand-off
    carries: one made wrong on the driver fails every replica at its first epoch's end, naming the key."""
    import shutil

    from cascade_ray.errors import CascadeError

    cfg, summary, _, tmp = sweep
    for stage in ("features", "encoder"):  # the module run's upstream, reused by --resume
        shutil.copytree(Path(summary["storage"]) / "stages" / stage, tmp_path / cfg.name / "stages" / stage)
    drift = wrong_handoff_digest(monkeypatch, "blocks.features.stem.0.weight")
    again = load_config(CONFIGS / "debug.yaml", [f"storage_path={tmp_path}", *QUICK])
    options = RunOptions(
        spaces=(("classifier", str(tmp / "classifier.yaml")),), stop_after="classifier", batched=True, resume=True
    )
    with pytest.raises(CascadeError, match="every trial failed") as failed:
        run_pipeline(again, options, log=lambda _: None)
    assert drift in str(failed.value)


ALL_DIVERGE = """
stage: classifier
metric: val_accuracy
mode: max
num_samples: 1
search: grid
scheduler: {type: fifo}
evaluate_current: false
space:
  solver.lr: {grid: [1.0e+29, 1.0e+30]}  # SGD: the loss is NaN within the first steps, for both
"""


def test_a_batched_sweep_whose_replicas_all_fail_writes_its_table_and_resume_starts_no_job(sweep, tmp_path):
    """As a plain sweep of failed trials only: the table and replicas.json name each replica's failure, no
    best.yaml, an error naming the table; ``--resume`` reads the finished attempt's state and starts no job."""
    import shutil

    from cascade_ray.errors import CascadeError

    cfg, summary, _, tmp = sweep
    for stage in ("features", "encoder"):  # the module run's upstream, reused by --resume
        shutil.copytree(Path(summary["storage"]) / "stages" / stage, tmp_path / cfg.name / "stages" / stage)
    space = tmp_path / "diverge.yaml"
    space.write_text(ALL_DIVERGE)
    again = load_config(
        CONFIGS / "debug.yaml", [f"storage_path={tmp_path}", *QUICK, "stages.classifier.solver.type=SGD"]
    )
    exp = tmp_path / cfg.name / "tune" / "classifier"
    for attempt in ("first", "resumed"):
        options = RunOptions(spaces=(("classifier", str(space)),), stop_after="classifier", batched=True, resume=True)
        logs: list[str] = []
        with pytest.raises(CascadeError, match=r"every trial failed or reported no finite 'val_accuracy'") as failed:
            run_pipeline(again, options, log=logs.append)
        assert str(exp / "results.parquet") in str(failed.value) and "nonfinite" in str(failed.value)
        table = pq.read_table(exp / "results.parquet").to_pylist()
        assert [r["config/solver.lr"] for r in table] == [1e29, 1e30], attempt
        assert all("nonfinite" in r["error"] and r["epoch"] == 0 for r in table), table
        assert all(r["error"] for r in json.loads((exp / "replicas.json").read_text()))
        assert not (exp / "best.yaml").exists()
        warned = [line.split()[:3] for line in logs if "failed and is not a candidate for best" in line]
        assert sorted(warned) == sorted(["WARNING", "trial", r["trial_id"]] for r in table), logs  # the table's ids
        started = [line for line in logs if "no job is started" in line]
        assert (started == []) if attempt == "first" else (len(started) == 1), logs
    assert [p.name for p in (exp / "trials").iterdir()] == ["batched-a1"]  # the resume ran no second attempt
