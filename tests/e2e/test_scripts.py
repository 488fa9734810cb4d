"""Entry points as a user runs them: the pipeline script and the CLI, as subprocesses."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from paths import CONFIGS
from runs import DEBUG_OVERRIDES, SCRIPT, run_python


def _run(args, tmp_path, timeout=300, home=None):
    return run_python(args, tmp_path, timeout, home)


@pytest.fixture(scope="module")
def debug_run(script_run):
    """The debug cascade, uninterrupted, through the pipeline script: the session's shared run."""
    return script_run.proc, script_run.ray_tmp, script_run.storage, script_run.home


def test_pipeline_script_runs_the_debug_cascade_with_an_embedded_ray(debug_run):
    proc, ray_tmp, storage, _ = debug_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((storage / "debug" / "summary.json").read_text())
    assert f"test_accuracy={summary['test_accuracy']:.4f}" in proc.stdout
    assert "composed model test_accuracy" in proc.stdout
    for stage in ("features", "encoder", "classifier"):
        assert (storage / "debug" / "stages" / stage / "weights.safetensors").is_file()
    assert any(ray_tmp.iterdir()), "the embedded Ray used RAY_TMPDIR"


def test_the_embedded_rays_token_file_is_readable_by_this_user_only(debug_run):
    proc, ray_tmp, _, home = debug_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    token = home / ".ray" / "auth_token"
    assert token.is_file(), "token auth was on: the run's token is in HOME/.ray"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    # no other copy anywhere Ray wrote: HOME and the session folder
    readable = [
        p
        for root in (home, ray_tmp)
        for p in root.rglob("*token*")
        if p.is_file() and stat.S_IMODE(p.stat().st_mode) & 0o077
    ]
    assert not readable, readable


def test_invalid_config_exits_2_listing_every_key_problem_and_starts_no_ray(tmp_path):
    bad = tmp_path / "bad.yaml"
    text = (CONFIGS / "debug.yaml").read_text()
    text = text.replace("type: AdamW, lr: 1e-2, weight_decay: 1e-4", "type: Adamw, lr: 1e-2, betas: '0.9, 0.999'", 1)
    text = text.replace("in_channels: 16, d_model", "in_channels: 32, d_model").replace(
        "log_interval: 10}", "log_interval: 10, epoch: 1}", 1
    )
    assert text.count("Adamw") == 1 and text.count("epoch: 1") == 1, "the mutations must apply"
    bad.write_text(text)
    storage = tmp_path / "runs"
    for args in ([SCRIPT, "--config", bad, f"storage_path={storage}"], ["-m", "cascade_ray.cli", "validate", bad]):
        proc, ray_tmp = _run(args, tmp_path)
        assert proc.returncode == 2, proc.stderr
        for path in ("stages[0].solver.type", "stages[0].solver.betas", "stages[0].train.epoch"):
            assert path in proc.stderr
        # the shape mismatch waits for the key mistakes (the preflight runs on a clean file), and
        # the error says so
        assert "3 problem(s)" in proc.stderr and "stages[1].model.in_channels" not in proc.stderr
        assert "shapes of the chain are checked once the problems above are fixed" in proc.stderr
        assert not any(ray_tmp.iterdir()), "no Ray session may start for an invalid config"
        assert not storage.exists(), "nothing may be written for an invalid config"


def test_missing_fashion_mnist_says_how_to_install_it(tmp_path):
    proc, ray_tmp = _run([SCRIPT, f"data.root={tmp_path / 'nowhere'}", f"storage_path={tmp_path / 'runs'}"], tmp_path)
    assert proc.returncode == 2
    assert "apt-get install dataset-fashion-mnist" in proc.stderr and "data.root" in proc.stderr
    assert not any(ray_tmp.iterdir())


def test_driver_killed_after_stage_one_resumes_to_the_same_result(debug_run, tmp_path):
    _, _, reference, _ = debug_run
    storage = tmp_path / "runs"
    ray_tmp = Path(tempfile.mkdtemp(prefix="cr-", dir="/tmp"))
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
    env.pop("RAY_ADDRESS", None)
    # the shared run's config (DEBUG_OVERRIDES): the resumed run must end with its digests
    args = [sys.executable, str(SCRIPT), "--config", str(CONFIGS / "debug.yaml"), f"storage_path={storage}"]
    args += DEBUG_OVERRIDES
    # own process group: the kill takes the embedded Ray down with the driver, like a lost node
    proc = subprocess.Popen(
        args, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    manifest = storage / "debug" / "stages" / "features" / "manifest.json"
    deadline = time.monotonic() + 240
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert manifest.exists(), "stage 1 never finished"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (storage / "debug" / "stages" / "classifier").exists(), "killed too late to test anything"

    resumed = subprocess.run([*args, "--resume"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # the killed driver left its run lock behind: a dead pid on this host, taken over with a log line
    assert f"run lock: taking over {storage / 'debug' / '.lock'}" in resumed.stdout, resumed.stdout[-3000:]
    summary = json.loads((storage / "debug" / "summary.json").read_text())
    assert [s["status"] for s in summary["stages"]] == ["reused", "trained", "trained"]
    expected = json.loads((reference / "debug" / "summary.json").read_text())
    # same config, seed and data on CPU: the resumed run reproduces the uninterrupted one
    assert summary["test_accuracy"] == expected["test_accuracy"]
    assert [s["digest"] for s in summary["stages"]] == [s["digest"] for s in expected["stages"]]
