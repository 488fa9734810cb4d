"""The run lock and the finished-run rule at the driver: a second `run_pipeline` on a locked run
folder, or over a finished run without --resume/--overwrite, fails before Ray starts."""

from __future__ import annotations

import json
import os

import pytest
import ray
from paths import CONFIGS

from cascade_ray.api import RunOptions, run_pipeline
from cascade_ray.checks import load_config
from cascade_ray.cli import build_parser, parse_args, run_options
from cascade_ray.cli import main as cli_main
from cascade_ray.errors import ResourceError, RunFinishedError, RunLockedError
from cascade_ray.pipeline.driver import run_dir
from cascade_ray.storage_lock import LOCK_NAME, acquire_run_lock

# more workers than any machine has: the embedded resource check fails right after the lock and
# the finished-run rule, still before Ray starts
TOO_BIG = "stages[1].scaling.num_workers=4096"


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    return load_config(CONFIGS / "debug.yaml", [f"storage_path={tmp_path}"])


def test_a_second_driver_on_a_locked_run_fails_naming_the_holder_and_keeps_its_lock(cfg):
    held = acquire_run_lock(run_dir(cfg), log=lambda _: None)  # the "first driver": this process
    try:
        with pytest.raises(RunLockedError) as info:
            run_pipeline(cfg, log=lambda _: None)
        text = str(info.value)
        assert f"{run_dir(cfg)} is locked" in text and f"pid {os.getpid()}" in text and "--break-lock" in text
        assert not ray.is_initialized()
        lock = json.loads((run_dir(cfg) / LOCK_NAME).read_text())
        assert lock["token"] == held.record["token"], "the refused driver must leave the holder's lock alone"
    finally:
        assert held.release()


def test_a_finished_run_needs_resume_or_overwrite(cfg):
    out = run_dir(cfg)
    out.mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    with pytest.raises(RunFinishedError, match=r"(?s)holds a finished run.*--resume.*--overwrite"):
        run_pipeline(cfg, log=lambda _: None)
    assert not ray.is_initialized() and not (out / LOCK_NAME).exists()
    big = load_config(CONFIGS / "debug.yaml", [f"storage_path={cfg.storage_path}", TOO_BIG])
    for options in (RunOptions(overwrite=True), RunOptions(resume=True)):  # past the rule: the next check fails
        with pytest.raises(ResourceError, match="4096"):
            run_pipeline(big, options, log=lambda _: None)
        assert not ray.is_initialized() and not (out / LOCK_NAME).exists(), "released after a failure"


def test_the_cli_exits_2_with_the_fix_and_takes_the_flags(cfg, capsys):
    config = str(CONFIGS / "debug.yaml")
    out = run_dir(cfg)
    out.mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    assert cli_main(["run", config, f"storage_path={cfg.storage_path}"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    held = acquire_run_lock(out, log=lambda _: None)
    try:
        assert cli_main(["run", config, f"storage_path={cfg.storage_path}", "--overwrite"]) == 2
        assert f"pid {os.getpid()}" in capsys.readouterr().err
    finally:
        held.release()
    args = parse_args(build_parser(), ["run", config, "--overwrite", "--break-lock"])
    assert (run_options(args, cfg).overwrite, run_options(args, cfg).break_lock) == (True, True)
    tune = parse_args(build_parser(), ["tune", config, "--space", "s.yaml", "--break-lock"])
    assert tune.break_lock and not hasattr(tune, "overwrite")


def test_submit_passes_the_lock_flags_to_the_job(monkeypatch):
    from paths import ROOT

    from cascade_ray.tools.jobs import job_entrypoint

    monkeypatch.chdir(ROOT)
    argv = ["submit", str(CONFIGS / "debug.yaml"), "--address", "http://127.0.0.1:8265", "--overwrite", "--break-lock"]
    entrypoint, _, _ = job_entrypoint(parse_args(build_parser(), argv), "/shared/runs")
    assert entrypoint.endswith("--overwrite --break-lock"), entrypoint


def test_resume_says_when_there_is_nothing_to_resume(cfg):
    """--resume where no stage, attempt or sweep is (a storage_path or name typo) trains every stage:
    the driver says so before anything starts, and not when there is something to resume."""
    big = load_config(CONFIGS / "debug.yaml", [f"storage_path={cfg.storage_path}", TOO_BIG])  # stops before Ray
    for present in (None, "stages", "ray", "tune"):
        if present is not None:
            (run_dir(cfg) / present).mkdir(parents=True, exist_ok=True)
        lines: list[str] = []
        with pytest.raises(ResourceError):
            run_pipeline(big, RunOptions(resume=True), log=lines.append)
        said = [line for line in lines if line.startswith("resume: nothing to resume")]
        assert len(said) == (1 if present is None else 0), (present, lines)
        assert present is not None or f"in {run_dir(cfg)} " in said[0]
    lines = []
    with pytest.raises(ResourceError):
        run_pipeline(big, RunOptions(), log=lines.append)  # no --resume: nothing to say
    assert not [line for line in lines if "nothing to resume" in line]
