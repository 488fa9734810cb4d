"""Finished debug runs the tests share: one uninterrupted run of the pipeline script (the e2e
script and resume tests' reference, and the `trained_run` of the tools that use one: predict,
serve, export, load_cascade), and further runs by the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from paths import CONFIGS, ROOT

SCRIPT = ROOT / "pipelines" / "three_stage.py"
# The shared debug run's stage lengths: 1 epoch for features and classifier (the tools need a
# finished run, not a good one), 6 for the encoder (the mid-stage kill of tests/e2e/test_resume.py
# needs epochs 2..5 to land in). Every run compared with it by digest uses the same overrides.
ENCODER_EPOCHS = 6
DEBUG_OVERRIDES = (
    "stages[0].train.epochs=1",
    f"stages[1].train.epochs={ENCODER_EPOCHS}",
    "stages[2].train.epochs=1",
)


def run_python(args, cwd: Path, timeout: float = 300, home: Path | None = None):
    """``python *args`` as a user runs it, in `cwd`, with an embedded Ray in a private session
    folder (RAY_TMPDIR: "did Ray start?" is a directory listing; short, under /tmp: Ray's socket
    paths must stay under 108 bytes); (the finished process, that folder)."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="cr-", dir="/tmp"))
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
    if home is not None:  # where Ray writes its token (~/.ray): not the developer's real one
        env["HOME"] = str(home)
        for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            env.pop(key, None)  # Ray's default: token auth on, token file under HOME
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd
    )
    return proc, ray_tmp


@dataclass
class ScriptRun:
    """The debug cascade run once by ``pipelines/three_stage.py`` (`DEBUG_OVERRIDES`)."""

    proc: subprocess.CompletedProcess
    ray_tmp: Path  # the embedded Ray's RAY_TMPDIR
    storage: Path  # storage_path; the run folder is storage / "debug"
    home: Path  # the process's HOME (Ray's token file)

    @property
    def run(self) -> Path:
        assert self.proc.returncode == 0, self.proc.stdout[-3000:] + self.proc.stderr[-3000:]
        assert (self.storage / "debug" / "summary.json").is_file()
        return self.storage / "debug"


def run_debug_script(tmp: Path) -> ScriptRun:
    """The debug cascade, uninterrupted, through the pipeline script with its own embedded Ray
    (which exits before the test modules' own Ray sessions start) and a fresh HOME."""
    storage, home = tmp / "runs", tmp / "home"
    home.mkdir()
    args = [SCRIPT, "--config", CONFIGS / "debug.yaml", f"storage_path={storage}", *DEBUG_OVERRIDES]
    proc, ray_tmp = run_python(args, tmp, home=home)
    return ScriptRun(proc, ray_tmp, storage, home)


def train_debug_run(storage: Path, *overrides: str) -> Path:
    """The debug pipeline (`DEBUG_OVERRIDES`) trained by the real CLI in a subprocess with its own
    embedded Ray; its run folder."""
    proc = subprocess.run(
        [sys.executable, "-m", "cascade_ray.cli", "run", str(CONFIGS / "debug.yaml")]
        + [f"storage_path={storage}", *DEBUG_OVERRIDES, *overrides, "--log-level", "warning"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = storage / "debug"
    assert (run / "summary.json").is_file()
    return run
