"""--log-level (what reaches the driver), --profile (trace + top operators), and their CLI flags; no Ray."""

from __future__ import annotations

import json
import logging

import pytest
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.constants import LOG_LEVEL_ENV
from cascade_ray.errors import ConfigError
from cascade_ray.logs import keep_lines, log_level, set_log_level, train_logging_config
from cascade_ray.stage.profiler import check_profile_stages, request_profile, trace_path_for


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
    monkeypatch.setenv(LOG_LEVEL_ENV, "info")  # set_log_level writes os.environ: restored after the test
    monkeypatch.delenv(LOG_LEVEL_ENV)
    ray_logger = logging.getLogger("ray")
    monkeypatch.setattr(ray_logger, "level", ray_logger.level)  # restored after the test
    assert log_level() == "info" and train_logging_config().log_level == "ERROR"
    set_log_level("debug")
    assert log_level() == "debug" and ray_logger.level == logging.DEBUG and train_logging_config().log_level == "DEBUG"
    set_log_level("warning")
    assert ray_logger.level == logging.ERROR
    with pytest.raises(ConfigError, match="(?s)--log-level.*'verbose'.*debug, info, warning"):
        set_log_level("verbose")
    monkeypatch.setenv(LOG_LEVEL_ENV, "loud")
    with pytest.raises(ConfigError, match=LOG_LEVEL_ENV):
        log_level()


def test_profile_stage_names_are_checked_with_a_suggestion(tmp_path):
    cfg = load_config(CONFIGS / "debug.yaml")
    assert check_profile_stages(cfg, "all") == {"features", "encoder", "classifier"}
    assert check_profile_stages(cfg, "encoder,classifier") == {"encoder", "classifier"}
    with pytest.raises(ConfigError, match="(?s)--profile.*'encodr'.*did you mean 'encoder'"):
        check_profile_stages(cfg, "encodr")
    request_profile({"encoder"})
    try:
        assert trace_path_for("encoder", tmp_path) == str(tmp_path / "profile" / "encoder.trace.json")
        assert trace_path_for("features", tmp_path) == ""
    finally:
        request_profile(None)
    assert trace_path_for("encoder", tmp_path) == ""


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
    import cascade_ray.pipeline.driver as driver
    import cascade_ray.stage.profiler as profiling
    from cascade_ray.cli import main

    seen = {}
    monkeypatch.setattr(
        driver, "run_pipeline", lambda cfg, **kw: seen.update(cfg=cfg, profiled=profiling._requested, level=log_level())
    )
    monkeypatch.setattr(profiling, "_requested", None)
    monkeypatch.setenv(LOG_LEVEL_ENV, "info")  # restored after the test
    monkeypatch.setattr(logging.getLogger("ray"), "level", logging.getLogger("ray").level)
    assert (
        main(["run", str(CONFIGS / "debug.yaml"), "--log-level", "warning", "--profile", f"storage_path={tmp_path}"])
        == 0
    )
    assert seen == {"cfg": seen["cfg"], "profiled": {"features", "encoder", "classifier"}, "level": "warning"}
    assert seen["cfg"].storage_path == str(tmp_path)
    assert main(["run", str(CONFIGS / "debug.yaml"), "--profile", "encodr"]) == 2
