"""The Python API: run options become stage runners before any Ray resource starts."""

from __future__ import annotations

import pytest
from paths import CONFIGS, ROOT

from cascade_ray.api import RunOptions, load_config, stage_runners
from cascade_ray.errors import ConfigError
from cascade_ray.pipeline import driver
from cascade_ray.tune.run import SweepRunner


def test_spaces_become_sweep_runners_checked_against_the_config():
    cfg = load_config(CONFIGS / "debug.yaml")
    space = ROOT / "tune_spaces" / "encoder.yaml"
    runners = stage_runners(cfg, RunOptions(spaces=(("encoder", str(space)),), resume=True))
    assert set(runners) == {"encoder"}
    runner = runners["encoder"]
    assert isinstance(runner, SweepRunner) and runner.space.stage == "encoder" and runner.resume
    with pytest.raises(ConfigError, match="sweeps stage 'encoder', asked for stage 'classifier'"):
        stage_runners(cfg, RunOptions(spaces=(("classifier", str(space)),)))


def test_the_driver_refuses_a_runner_for_a_stage_it_does_not_have(monkeypatch):
    cfg = load_config(CONFIGS / "debug.yaml")
    monkeypatch.setattr(driver, "load_data", lambda *a: pytest.fail("data loaded before the runners were checked"))
    with pytest.raises(ConfigError, match="no stage 'encodr'"):
        driver.run_pipeline(cfg, RunOptions(), runners={"encodr": lambda *a: None}, log=lambda _: None)


def test_keyword_overrides_use_double_underscores_and_reach_the_schema():
    from cascade_ray.api import as_config

    cfg = as_config(CONFIGS / "debug.yaml", seed=7, stages__encoder__solver__lr=3e-4, stages__0__train__epochs=1)
    assert cfg.seed == 7 and cfg.stages[1].solver.lr == 3e-4 and cfg.stages[0].train.epochs == 1
    again = as_config(cfg, storage_path="/tmp/elsewhere")  # a validated config takes overrides too
    assert again.storage_path == "/tmp/elsewhere" and again.seed == 7
    assert as_config(cfg) is cfg
    with pytest.raises(ConfigError, match=r"stages\[1\]\.solver\.lr"):
        as_config(CONFIGS / "debug.yaml", stages__encoder__solver__lr="fast")
    with pytest.raises(ConfigError, match="sede"):
        as_config(cfg.model_dump(mode="json"), sede=1)


def test_a_run_is_its_summary_dict_plus_the_model():
    import json

    from cascade_ray.api import Run

    cfg = load_config(CONFIGS / "debug.yaml")
    run = Run({"name": "debug", "stages": [{"name": "features", "status": "trained"}], "storage": "/runs/debug"}, cfg)
    run["elapsed_s"] = 1.5  # callers annotate and dump it like the dict it always was
    assert json.loads(json.dumps(run))["elapsed_s"] == 1.5 and isinstance(run, dict)
    assert run.run_dir == "/runs/debug" and run.stages[0]["status"] == "trained" and run.cfg is cfg
    assert repr(run) == "Run(/runs/debug: features trained)"
