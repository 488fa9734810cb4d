"""--log-level (what reaches the driver), --profile (trace + top operators), and their CLI flags; no Ray."""

from __future__ import annotations

import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.errors import ConfigError
from cascade_ray.logs import apply_log_level, keep_lines, train_logging_config
from cascade_ray.options import RunOptions
from cascade_ray.stage.observe import observer_config
from cascade_ray.stage.profiler import check_profile_stages, trace_path_for


def _batch(lines, actor="RayTrainWorker", is_err=False):
    return {"lines": lines, "actor_name": actor, "task_name": "", "is_err": is_err, "pid": 123}


RAY_INFO = "2026-11-30 10:36:52,291\tINFO worker.py:2029 -- Started a local Ray instance."
RAY_ERROR = "2026-11-30 10:36:52,291\tERROR worker.py:99 -- Worker crashed."
TRACEBACK = ["Traceback (most recent call last):", '  File "model.py", line 3, in forward', "RuntimeError: boom"]


def test_info_hides_ray_chatter_and_keeps_errors_and_our_lines():
    assert keep_lines(_batch(["Requesting resources: {'CPU': 1} * 1"], actor="TrainController"), "info") == []
    assert (
        keep_lines(
            _batch(["Exception in thread PlacementGroupCleanerMonitor:", *TRACEBACK], actor="PlacementGroupCleaner"),
            "info",
        )
        == []
    )
    worker = [
        RAY_INFO,
        "Reporting training result 1: TrainingReport(checkpoint=None)",
        RAY_ERROR,
        *TRACEBACK,
        "WARNING health: stage 'encoder' ...",
        "[encoder] val_loss plateaued: lr now 0.001",
        "a user model's print",
    ]
    assert keep_lines(_batch(worker, is_err=True), "info") == [
        RAY_ERROR,
        *TRACEBACK,
        "WARNING health: stage 'encoder' ...",
        "[encoder] val_loss plateaued: lr now 0.001",
        "a user model's print",
    ]
    # warning: rank 0's informational lines go too, warnings and errors stay
    assert keep_lines(_batch(worker), "warning") == [
        RAY_ERROR,
        *TRACEBACK,
        "WARNING health: stage 'encoder' ...",
        "a user model's print",
    ]
    # debug: everything, Ray's own actors included
    assert keep_lines(_batch(worker), "debug") == worker
    assert keep_lines(_batch(["Requesting resources"], actor="TrainController"), "debug") == ["Requesting resources"]


def test_log_level_reaches_ray_loggers_and_rejects_unknown_levels(monkeypatch):
    ray_logger = logging.getLogger("ray")
    monkeypatch.setattr(ray_logger, "level", ray_logger.level)  # restored after the test
    assert train_logging_config("info").log_level == "ERROR"
    apply_log_level("debug")
    assert ray_logger.level == logging.DEBUG and train_logging_config("debug").log_level == "DEBUG"
    apply_log_level("warning")
    assert ray_logger.level == logging.ERROR
    with pytest.raises(ConfigError, match="(?s)--log-level.*'verbose'.*debug, info, warning"):
        RunOptions(log_level="verbose")


def test_run_options_are_frozen_and_reach_the_workers_loop_config(tmp_path):
    """The observing keys of a worker's loop config come from the options passed in, nothing else."""
    cfg = load_config(CONFIGS / "debug.yaml")
    options = RunOptions(log_level="warning", profile={"encoder"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.log_level = "debug"  # type: ignore[misc]
    keys = observer_config(cfg, 1, tmp_path, options, board=None)
    assert keys == {
        "progress": [],
        "log_level": "warning",
        "profile": str(tmp_path / "profile" / "encoder.trace.json"),
        "tracking": None,  # no loggers: configured
    }
    assert observer_config(cfg, 0, tmp_path, options, board="handle")["profile"] == ""
    assert observer_config(cfg, 0, tmp_path, RunOptions(), board="handle")["progress"] == ["handle"]
    assert not RunOptions(log_level="warning").show_progress and RunOptions().show_progress


def test_profile_stage_names_are_checked_with_a_suggestion(tmp_path):
    cfg = load_config(CONFIGS / "debug.yaml")
    assert check_profile_stages(cfg, "all") == {"features", "encoder", "classifier"}
    assert check_profile_stages(cfg, "encoder,classifier") == {"encoder", "classifier"}
    with pytest.raises(ConfigError, match="(?s)--profile.*'encodr'.*did you mean 'encoder'"):
        check_profile_stages(cfg, "encodr")
    assert trace_path_for("encoder", tmp_path, frozenset({"encoder"})) == str(
        tmp_path / "profile" / "encoder.trace.json"
    )
    assert trace_path_for("features", tmp_path, frozenset({"encoder"})) == ""
    assert trace_path_for("encoder", tmp_path, frozenset()) == ""


def test_diagnose_profile_writes_a_chrome_trace_and_top_operators(digits, tmp_path):
    from cascade_ray.tools.diagnose import diagnose, format_report

    cfg = load_config(CONFIGS / "debug.yaml")
    trace = tmp_path / "encoder.trace.json"
    report = diagnose(cfg, 1, digits, steps=12, profile=trace)
    assert report["profile"]["trace"] == str(trace)
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    summary = report["profile"]["summary"]
    assert summary.startswith("profile of stage 'encoder': 5 optimizer step(s) recorded after 2 skipped and 2 warm-up")
    table = summary.split("top 10 operators by self CPU time:\n", 1)[1]
    assert "aten::" in table and "ProfilerStep" not in table
    assert summary in format_report(report) and report["verdict"]["ok"]


def test_diagnose_profile_of_a_run_too_short_to_record_says_so(digits, tmp_path):
    from cascade_ray.tools.diagnose import diagnose

    report = diagnose(load_config(CONFIGS / "debug.yaml"), 0, digits, steps=3, profile=tmp_path / "t.json")
    assert report["profile"]["trace"] is None and "records steps 5..9" in report["profile"]["summary"]


def test_cli_run_flags_reach_the_driver(monkeypatch, tmp_path):
    """`run CONFIG --profile key=value`: the override stays an override, every stage is profiled."""
    import cascade_ray.api as api
    from cascade_ray.cli import main

    seen = {}

    def fake_driver(cfg, options, **kw):  # records what reached it; returns a summary, as the driver does
        seen.update(cfg=cfg, options=options)
        return {"name": cfg.name, "stages": [], "storage": str(tmp_path)}

    monkeypatch.setattr(api.driver, "run_pipeline", fake_driver)
    monkeypatch.setattr(logging.getLogger("ray"), "level", logging.getLogger("ray").level)
    assert (
        main(["run", str(CONFIGS / "debug.yaml"), "--log-level", "warning", "--profile", f"storage_path={tmp_path}"])
        == 0
    )
    assert seen["options"] == RunOptions(
        log_level="warning",
        profile={"features", "encoder", "classifier"},
        config_arg=f"{CONFIGS / 'debug.yaml'} storage_path={tmp_path}",  # as typed: best.yaml's header names it
    )
    assert seen["cfg"].storage_path == str(tmp_path)
    assert main(["run", str(CONFIGS / "debug.yaml"), "--profile", "encodr"]) == 2


def test_the_pipeline_script_and_the_cli_share_their_run_flags():
    """One definition of the run flags: the script's parser has every flag of `cascade-ray run`, plus --config."""
    import runpy

    from cascade_ray.cli import build_parser

    script = runpy.run_path(str(CONFIGS.parent / "three_stage.py"), run_name="not_main")
    run = build_parser()._subparsers._group_actions[0].choices["run"]

    def flags(parser):
        return {opt for action in parser._actions for opt in action.option_strings}

    assert flags(script["build_parser"]()) == flags(run) | {"--config"}


@pytest.mark.parametrize(
    ("extra", "level", "printed"),
    [({}, "info", True), ({"trial": True}, "info", False), ({"trial": True}, "debug", True), ({}, "warning", False)],
)
def test_a_tune_trials_rank_0_prints_step_lines_only_at_debug(tmp_path, capsys, extra, level, printed):
    """A plain stage without a board prints its step lines (info); a sweep's trials would interleave them in
    the driver's log, so a trial's only at --log-level debug (the sweep's board shows its epochs)."""
    import torch

    from cascade_ray.stage.loop import _log_step
    from cascade_ray.stage.observe import observer_hooks

    cfg = load_config(CONFIGS / "debug.yaml")
    loop_config = {**observer_config(cfg, 2, tmp_path, RunOptions(log_level=level), board=None), **extra}
    hooks, finish = observer_hooks(loop_config, cfg, 2, 0, 1, torch.device("cpu"))
    row = {"epoch": 1, "step": 10, "train_loss": 0.5, "lr": 0.01, "samples_per_s": 100.0}
    _log_step(SimpleNamespace(row=row, stage=cfg.stages[2], total_steps=20), hooks, eta=1.0)
    finish()
    assert ("[classifier] epoch 1/" in capsys.readouterr().out) is printed
