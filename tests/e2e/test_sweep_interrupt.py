"""Ctrl-C during `cascade-ray tune` or `cascade-ray run`: the sweep or stage fails as interrupted (nothing
adopted, exit 130, the fix named) and `--resume` finishes it; run as a user does, in its own process group,
stopped by its own PID."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from procs import process_tree, signal_all

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "cascade_ray.cli"]
SPACE = """
stage: classifier
metric: val_accuracy
mode: max
num_samples: 4
evaluate_current: false
scheduler: {type: fifo}
space:
  solver.lr: {loguniform: [3.0e-4, 3.0e-3]}
"""
STARTED = "RUNNING    | epoch 1/"  # a trial's first epoch is in: the sweep is under way
RUN_TIMEOUT_S = 300


def _interrupt(command: list[str], cwd: Path, env: dict[str, str], started: str, log_path: Path) -> int:
    """Run `command` in its own process group until `started` is in its output, then send the group
    SIGINT (what Ctrl-C in a terminal sends); its exit code. Whatever of its Ray is left is killed by PID."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    tree: set[int] = set()
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while started not in log_path.read_text():
            assert proc.poll() is None, f"it ended first: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{started!r} not printed in time: {log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        tree = process_tree(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=180)
    finally:
        tree |= process_tree(proc.pid) if proc.poll() is None else set()
        signal_all({proc.pid}, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while (left := (tree & process_tree(proc.pid)) - {proc.pid}) and time.monotonic() < deadline:
            time.sleep(0.5)
        signal_all(left, signal.SIGKILL)
    return proc.returncode


def _env() -> tuple[dict[str, str], Path]:
    ray_tmp = Path(tempfile.mkdtemp(prefix="cr-", dir="/tmp"))  # Ray's sockets: short paths
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "PYTHONUNBUFFERED": "1"}  # lines as a terminal shows them
    env.pop("RAY_ADDRESS", None)
    return env, ray_tmp


def test_ctrl_c_during_a_stage_fit_ends_the_run_as_interrupted_and_resume_continues_it(tmp_path):
    env, ray_tmp = _env()
    command = [*CLI, "run", "debug", f"storage_path={tmp_path / 'runs'}", "stages.encoder.train.epochs=10"]
    log_path = tmp_path / "run.log"
    code = _interrupt(command, tmp_path, env, "encoder: precision", log_path)  # its workers are up
    out = log_path.read_text()
    assert code == 130, out[-3000:]
    assert "stage 'encoder': interrupted (Ctrl-C) while it trained" in out and "--resume" in out, out[-3000:]
    summary = json.loads((tmp_path / "runs" / "debug" / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    resumed = subprocess.run(
        [*command, "--resume"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "debug" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["stages"][0]["status"] == "reused", summary["stages"][0]


def test_ctrl_c_during_a_sweep_adopts_nothing_and_resume_finishes_it(tmp_path):
    (tmp_path / "space.yaml").write_text(SPACE)
    env, ray_tmp = _env()
    command = [
        *CLI,
        "tune",
        "debug",
        "--space",
        "space.yaml",
        f"storage_path={tmp_path / 'runs'}",
        "stages.classifier.train.epochs=3",
    ]
    log_path = tmp_path / "tune.log"
    returncode = _interrupt(command, tmp_path, env, STARTED, log_path)
    out = log_path.read_text()
    sweep = tmp_path / "runs" / "debug" / "tune" / "classifier"
    assert returncode == 130, out[-3000:]
    assert "the sweep was interrupted (Ctrl-C or SIGUSR1)" in out and "--resume" in out, out[-3000:]
    assert "classifier tuned" not in out and not (sweep / "best.yaml").exists()  # nothing adopted

    resumed = subprocess.run(
        [*command, "--resume"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    table = pq.read_table(sweep / "results.parquet").to_pylist()
    assert len(table) == 4 and all(row["error"] is None for row in table), table
    assert (sweep / "best.yaml").exists()
