"""Finished runs for the tests of the tools that use one (predict, serve, export, load_cascade)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from paths import CONFIGS


def train_debug_run(storage: Path, *overrides: str) -> Path:
    """The debug pipeline, 1 epoch per stage, trained by the real CLI in a subprocess with its own
    embedded Ray (which exits before the test modules' own Ray sessions start); its run folder."""
    epochs = [f"stages[{i}].train.epochs=1" for i in range(3)]
    proc = subprocess.run(
        [sys.executable, "-m", "cascade_ray.cli", "run", str(CONFIGS / "debug.yaml")]
        + [f"storage_path={storage}", *epochs, *overrides, "--log-level", "warning"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = storage / "debug"
    assert (run / "summary.json").is_file()
    return run
