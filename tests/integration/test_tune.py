"""Ray Tune sweeps of one stage on the debug cascade, the upstream shared by every trial."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import pickle
import re
import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fakes import records_of, shim_logger, wrong_handoff_digest
from paths import CONFIGS, ROOT

from cascade_ray.api import RunOptions, run_pipeline
from cascade_ray.checks import load_config
from cascade_ray.config.yaml_io import read_yaml
from cascade_ray.errors import ArtifactError, ConfigError
from cascade_ray.storage import as_storage
from cascade_ray.tune.space import load_space
from cascade_ray.tune.state import STATE_SIDECAR, verify_state
from cascade_ray.tune.sweep import INPUTS_FILE, STARTUP_FILE

SPACE = """
stage: encoder
metric: val_accuracy
mode: max
num_samples: 4
scheduler: {type: fifo}
space:
  solver.lr: {loguniform: [1.0e-3, 3.0e-2]}
  loss.scale: {choice: [0.5, 1.0]}
  solver.weight_decay: {loguniform: [1.0e-5, 1.0e-3]}  # the stage's own 0.0 lies outside: the first trial runs it
"""


@pytest.fixture(scope="module")
def sweep(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    space = tmp / "encoder.yaml"
    space.write_text(SPACE)
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={tmp}", "stages.encoder.scaling.num_workers=1"])
    started = time.perf_counter()
    out = io.StringIO()  # the driver's stdout (no TTY): the sweep's progress lines
    lines: list[str] = []
    # Tune's variant generator, which warns about pre-set values
    with (
        records_of(shim_logger("quiet_preset_warnings"), logging.WARNING) as tune_records,
        contextlib.redirect_stdout(out),
    ):
        summary = run_pipeline(
            cfg, RunOptions(spaces=(("encoder", str(space)),), stop_after="encoder"), log=lines.append
        )
    summary["test_elapsed_s"] = time.perf_counter() - started
    (tmp / "driver_stdout.txt").write_text(out.getvalue())
    (tmp / "driver_log.json").write_text(json.dumps({"log": lines, "tune": tune_records.messages}))
    return cfg, summary, tmp


def test_a_configured_value_outside_the_space_is_explained_once_instead_of_tunes_warning(sweep):
    """weight_decay 0.0 (the debug encoder's) is outside the space's log-uniform range: the first trial
    runs it as the baseline, cascade-ray says so once naming the key to turn it off, and Tune's own
    "Pre-set value ... not within valid values" warning is not printed."""
    _, summary, tmp = sweep
    logged = json.loads((tmp / "driver_log.json").read_text())
    notes = [line for line in logged["log"] if "outside the space" in line]
    assert len(notes) == 1, logged["log"]
    assert "solver.weight_decay=0.0 (space: loguniform [1e-05, 0.001])" in notes[0]
    assert "set evaluate_current: false in" in notes[0] and "encoder.yaml" in notes[0]
    assert not [m for m in logged["tune"] if m.startswith("Pre-set value")], logged["tune"]
    table = pq.read_table(summary["stages"][1]["sweep"]["results"]).to_pylist()
    assert any(row["config/solver.weight_decay"] == 0.0 for row in table)  # the baseline trial ran


def test_a_tuned_stage_records_the_wall_time_of_its_sweep(sweep):
    """The record's wall_s is the whole sweep (4 trials, each a Train job), not the adoption afterwards."""
    _, summary, _ = sweep
    features, encoder = summary["stages"]
    assert encoder["status"] == "tuned"
    # 4 trials of seconds each; the adoption alone (read the best checkpoint, write the artifact) is well under 1 s
    assert encoder["wall_s"] > 4.0
    assert features["wall_s"] + encoder["wall_s"] <= summary["test_elapsed_s"]


def test_sweep_table_is_sorted_and_complete(sweep):
    _, summary, _ = sweep
    record = summary["stages"][1]
    assert record["status"] == "tuned" and record["sweep"]["trials"] == 4
    table = pq.read_table(record["sweep"]["results"]).to_pylist()
    assert len(table) == 4
    scores = [row["val_accuracy"] for row in table]
    assert scores == sorted(scores, reverse=True)
    assert {"config/solver.lr", "config/loss.scale"} <= set(table[0])
    assert record["metrics"]["val_accuracy"] == pytest.approx(scores[0])
    # evaluate_current: one trial ran the stage's own values, so the sweep cannot do worse
    assert any(row["config/solver.lr"] == pytest.approx(1e-2) and row["config/loss.scale"] == 1.0 for row in table)


def test_the_driver_shows_each_trials_progress_in_plain_lines(sweep):
    """Job logs (no TTY): a line per trial at each state or epoch change, its last one TERMINATED
    with the trial's best val_accuracy, as the results table has it."""
    cfg, summary, tmp = sweep
    epochs = cfg.stages[1].train.epochs
    lines = (tmp / "driver_stdout.txt").read_text().splitlines()
    table = pq.read_table(summary["stages"][1]["sweep"]["results"]).to_pylist()
    for row in table:
        mine = [line for line in lines if line.startswith(f"trial {row['trial_id']} ")]
        assert 2 <= len(mine) <= len(("PENDING", "RUNNING", "TERMINATED")) + epochs, mine  # never one per step
        assert mine[-1].startswith(f"trial {row['trial_id']} TERMINATED | epoch {epochs}/{epochs} | val_accuracy ")
        assert f"| best {row['val_accuracy']:.4f}" in mine[-1], (mine[-1], row)
        assert any(f"RUNNING    | epoch {e}/{epochs} |" in line for line in mine for e in range(1, epochs + 1))
    assert sum(line.endswith(" *") for line in lines if " TERMINATED " in line) >= 1  # the sweep's leader


def test_reading_the_best_trial_back_prints_no_resume_advice(sweep):
    """Ray's checkpoint manager tells whoever reads a run folder to delete it if they meant a new
    job; the sweep only reads its best trial back, so cascade-ray's read drops that notice."""

    import ray
    from fakes import checkpoint_manager_logger

    from cascade_ray.ray_compat import RESUME_NOTICE, read_run_result

    _, _, tmp = sweep
    runs = sorted(p.parent for p in tmp.rglob("checkpoint_manager_snapshot.json") if "/trials/" in str(p))
    assert runs, "the sweep's trials left Ray run folders"
    with records_of(checkpoint_manager_logger()) as records:
        seen = records.messages
        assert read_run_result(str(runs[0])).checkpoint is not None
        assert not [m for m in seen if m.startswith(RESUME_NOTICE)], seen
        ray.train.Result.from_path(str(runs[0]))  # Ray's plain read says it: what the test guards against
        assert [m for m in seen if m.startswith(RESUME_NOTICE)], "Ray no longer logs its notice here"


def test_every_trial_read_the_same_upstream_object(sweep):
    _, summary, tmp = sweep
    inputs = [
        json.loads(p.read_text())
        for p in (Path(summary["storage"]) / "tune" / "encoder" / "trials").glob(f"*/{INPUTS_FILE}")
    ]
    assert len(inputs) == 4
    assert len({i["upstream"] for i in inputs}) == 1 and inputs[0]["upstream"]
    assert len({i["data"] for i in inputs}) == 1
    # the encoder trains on cached upstream features: computed once, one object for every trial
    assert len({i["features"] for i in inputs}) == 1 and inputs[0]["features"]
    assert summary["stages"][1]["feature_cache"]["status"] in ("computed", "read")
    startups = [
        json.loads(p.read_text())
        for p in (Path(summary["storage"]) / "tune" / "encoder" / "trials").glob(f"*/{STARTUP_FILE}")
    ]
    assert len(startups) == 4 and all(s["to_first_step_s"] > 0 for s in startups), startups


def test_best_override_reproduces_the_best_trial(sweep):
    cfg, summary, tmp = sweep
    best = read_yaml(summary["stages"][1]["sweep"]["best"])
    overrides = [f"{k}={v}" for k, v in best.items()]
    again = load_config(
        CONFIGS / "debug.yaml", [f"storage_path={tmp}", "stages.encoder.scaling.num_workers=1", *overrides]
    )
    rerun = run_pipeline(again, RunOptions(resume=True, stop_after="encoder"), log=lambda _: None)
    assert rerun["stages"][0]["status"] == "reused"
    # same upstream, config and seed on CPU: measured identical; allow 2 validation samples of noise
    assert rerun["stages"][1]["metrics"]["val_accuracy"] == pytest.approx(
        summary["stages"][1]["metrics"]["val_accuracy"], abs=2 / 288
    )


DIVERGING = """
stage: encoder
metric: val_accuracy
mode: max
num_samples: 1
search: grid
scheduler: {type: fifo}
evaluate_current: false
space:
  solver.lr: {grid: [1.0e-2, 1.0e+30]}  # SGD at 1e30: the loss is NaN within the first steps
"""


def test_a_trial_that_fails_is_in_the_table_with_its_error_and_never_adopted(ray_session, tmp_path):
    """Tune keeps a failed trial (status ERROR) and would pick it as best by its epochs before the failure;
    cascade-ray lists it last with the health error that stopped it and adopts the best trial that trained."""
    space = tmp_path / "diverging.yaml"
    space.write_text(DIVERGING)
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [f"storage_path={tmp_path}", "stages.encoder.scaling.num_workers=1", "stages.encoder.solver.type=SGD"],
    )
    lines: list[str] = []
    with contextlib.redirect_stdout(io.StringIO()):
        summary = run_pipeline(
            cfg, RunOptions(spaces=(("encoder", str(space)),), stop_after="encoder"), log=lines.append
        )
    record = summary["stages"][1]
    assert record["status"] == "tuned" and record["sweep"]["trials"] == 2
    good, bad = pq.read_table(record["sweep"]["results"]).to_pylist()
    assert good["config/solver.lr"] == pytest.approx(1e-2) and good["error"] is None
    assert bad["config/solver.lr"] == pytest.approx(1e30)
    assert "nonfinite" in bad["error"] and "stages[1].health.nonfinite" in bad["error"], bad["error"]
    assert record["metrics"]["val_accuracy"] == pytest.approx(good["val_accuracy"])
    assert "solver.lr: 0.01" in Path(record["sweep"]["best"]).read_text()
    warned = [line for line in lines if line.startswith(f"WARNING trial {bad['trial_id']} failed")]
    assert len(warned) == 1 and "not a candidate for best" in warned[0], lines
    printed = [row for line in lines for row in line.splitlines()]  # the table is logged as one block
    shown = next(row for row in printed if row.startswith(str(bad["trial_id"])))
    assert shown.endswith("FAILED (not a candidate)")
    # the swept values only (solver.type=SGD came from an override): the header says so
    assert "# the swept values only; the sweep ran on: CONFIG\n" in Path(record["sweep"]["best"]).read_text()

    # --resume: the trial that finished is shown with the epochs it reported, not "epoch 0/2"
    # (the failed one is restored to train again: Tuner.restore(resume_errored=True))
    out = io.StringIO()
    options = RunOptions(spaces=(("encoder", str(space)),), stop_after="encoder", resume=True)
    with contextlib.redirect_stdout(out):
        run_pipeline(cfg, options, log=lambda _: None)
    epochs = cfg.stages[1].train.epochs
    first = next(line for line in out.getvalue().splitlines() if line.startswith(f"trial {good['trial_id']} "))
    assert first.startswith(f"trial {good['trial_id']} TERMINATED | epoch {epochs}/{epochs} | val_accuracy 0."), first
    assert f"| best {good['val_accuracy']:.4f}" in first, (first, good)


ASHA = """
stage: encoder
metric: val_accuracy
mode: max
num_samples: 6
evaluate_current: false
scheduler: {type: asha, grace_period: 1, reduction_factor: 2}
space:
  solver.lr: {loguniform: [1.0e-4, 3.0e-2]}
"""


@pytest.mark.slow
def test_an_asha_sweep_that_stops_trials_early_runs_every_trial_to_the_end(ray_session, tmp_path):
    """ASHA stops trials while others wait: each waiting trial still trains (Ray 2.60 handed a stopped
    trial's actor, still inside its fit, to the next trial when actors were reused: that trial ended
    ERROR after a failed reset and the sweep could hang). Bounded: the process dumps its stacks and
    exits after 10 minutes."""
    import faulthandler

    space = tmp_path / "asha.yaml"
    space.write_text(ASHA)
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [f"storage_path={tmp_path}", "stages.encoder.scaling.num_workers=1", "stages.encoder.train.epochs=3"],
    )
    lines: list[str] = []
    faulthandler.dump_traceback_later(600, exit=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            summary = run_pipeline(
                cfg, RunOptions(spaces=(("encoder", str(space)),), stop_after="encoder"), log=lines.append
            )
    finally:
        faulthandler.cancel_dump_traceback_later()
    table = pq.read_table(summary["stages"][1]["sweep"]["results"]).to_pylist()
    assert len(table) == 6 and [r["error"] for r in table] == [None] * 6, table
    assert min(r["epoch"] for r in table) < 3, table  # ASHA stopped some trial early
    assert not [line for line in lines if line.startswith("WARNING trial")], lines


def test_the_hand_offs_digests_reach_a_stages_workers_and_every_trials(ray_session, tmp_path, monkeypatch):
    """Workers check the frozen upstream against the digests the driver's hand-off carries (not a hash
    of what they received): one made wrong on the driver fails the encoder's fit, and every trial of a
    sweep of it, at the first epoch's end, naming the key; the sweep's table is written first."""
    from cascade_ray.errors import CascadeError, FrozenDriftError

    drift = wrong_handoff_digest(monkeypatch, "blocks.features.stem.0.weight")
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [f"storage_path={tmp_path}", "stages.encoder.scaling.num_workers=1", "stages.encoder.train.epochs=1"],
    )
    with pytest.raises(FrozenDriftError, match=re.escape(drift)):
        run_pipeline(cfg, RunOptions(stop_after="encoder"), log=lambda _: None)
    space = tmp_path / "encoder.yaml"
    space.write_text(SPACE.replace("num_samples: 4", "num_samples: 2"))
    options = RunOptions(spaces=(("encoder", str(space)),), stop_after="encoder", resume=True)  # features reused
    with pytest.raises(CascadeError, match="every trial failed") as failed:
        run_pipeline(cfg, options, log=lambda _: None)
    assert drift in str(failed.value)
    table = pq.read_table(Path(cfg.storage_path) / cfg.name / "tune" / "encoder" / "results.parquet").to_pylist()
    assert len(table) == 2 and all(drift in row["error"] for row in table)


def test_a_space_with_bad_keys_fails_before_any_trial(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(SPACE.replace("solver.lr:", "solver.lrr:").replace("[0.5, 1.0]", "[0.5, -1.0]"))
    with pytest.raises(ConfigError) as info:
        load_space(bad, load_config(CONFIGS / "debug.yaml"))
    paths = {i.path for i in info.value.issues}
    assert paths == {"space.solver.lrr", "space.loss.scale"}


@pytest.mark.parametrize("space_file", sorted((ROOT / "tune_spaces").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_space_validates_against_its_config(space_file):
    stage = read_yaml(space_file)["stage"]
    config = CONFIGS / ("debug_joint.yaml" if stage == "joint" else "three_stage.yaml")
    assert load_space(space_file, load_config(config)).stage == stage


def test_the_sweep_leaves_a_sha256_sidecar_of_its_tune_state(sweep):
    _, summary, _ = sweep
    exp_dir = as_storage(summary["storage"]) / "tune" / "encoder"
    listed = (exp_dir / STATE_SIDECAR).read_text()
    assert "  tuner.pkl\n" in listed and "experiment_state-" in listed
    verify_state(exp_dir)  # what --resume checks before Ray unpickles anything


def test_resume_refuses_a_tuner_pkl_it_did_not_write(sweep, tmp_path):
    """A planted tuner.pkl whose unpickling would create a file: refused, the file never appears."""
    _, summary, tmp = sweep
    copy = tmp_path / "copy"
    shutil.copytree(tmp, copy, ignore=shutil.ignore_patterns(".lock"))
    marker = tmp_path / "unpickled"
    exp = copy / Path(summary["storage"]).name / "tune" / "encoder" / "tune"
    (exp / "tuner.pkl").write_bytes(pickle.dumps(_OpensOnLoad(str(marker))))
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={copy}", "stages.encoder.scaling.num_workers=1"])
    space = copy / "encoder.yaml"
    options = RunOptions(spaces=(("encoder", str(space)),), stop_after="encoder", resume=True)
    with pytest.raises(ArtifactError, match=r"tuner\.pkl does not match its sha256.*--trust-tune-state"):
        run_pipeline(cfg, options, log=lambda _: None)
    assert not marker.exists()


class _OpensOnLoad:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
