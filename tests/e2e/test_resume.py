"""Mid-stage resume: the driver's whole process group is SIGKILLed in the middle of stage 2, and
``--resume`` continues that stage from its latest checkpoint, ending bit-identical to a run that
was never interrupted (the session's `script_run`, whose stage 1 the killed run starts from:
copied, reused with ``--resume``). Runs ``python pipelines/three_stage.py`` with an embedded Ray,
as users do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import ROOT
from procs import process_tree, signal_all
from runs import DEBUG_OVERRIDES, ENCODER_EPOCHS

pytestmark = pytest.mark.slow

# the session's shared script run is the uninterrupted reference: the same config, so the same digests
OVERRIDES = list(DEBUG_OVERRIDES)
RUN_TIMEOUT_S = 300


def _cmd(storage: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "pipelines/three_stage.py",
        "--config",
        "pipelines/configs/debug.yaml",
        f"storage_path={storage}",
        *OVERRIDES,
        *extra,
    ]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def _latest_epoch(storage: Path) -> int:
    """Epochs of stage 2 (encoder) that Ray Train has registered a checkpoint for."""
    best = 0
    for snap in storage.glob("debug/ray/01-encoder-*/checkpoint_manager_snapshot.json"):
        try:
            latest = json.loads(snap.read_text()).get("latest_checkpoint_result") or {}
        except (OSError, ValueError):  # being rewritten
            continue
        best = max(best, int((latest.get("metrics") or {}).get("epoch", 0)))
    return best


def _snapshots_complete(storage: Path) -> bool:
    """Every snapshot of stage 2's Ray runs parses (none is caught between its truncation and its write)."""
    for snap in storage.glob("debug/ray/01-encoder-*/checkpoint_manager_snapshot.json"):
        try:
            json.loads(snap.read_text())
        except (OSError, ValueError):
            return False
    return True


def _summary(storage: Path) -> dict:
    return json.loads((storage / "debug" / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(script_run):
    """The uninterrupted run of the same config: the session's shared pipeline-script run."""
    return _summary(script_run.run.parent)


def test_a_driver_killed_mid_stage_resumes_that_stage_and_ends_bit_identical(reference, tmp_path):
    storage = tmp_path / "runs"
    # stage 1 is the reference's (copied, reused by --resume): the killed driver trains stage 2 at once
    features = Path(reference["storage"]) / "stages" / "features"
    shutil.copytree(features, storage / "debug" / "stages" / "features")
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(
        _cmd(storage, "--resume"), cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            assert proc.poll() is None, (
                f"the run ended before the kill: {(tmp_path / 'killed.log').read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, "stage 2 did not checkpoint 2 epochs in time"
            if _latest_epoch(storage) >= 2:
                # Ray rewrites its snapshot in place (truncate, then write) after every checkpoint: stop
                # the whole tree first, so the snapshot the kill leaves is the one looked at, complete
                victims = process_tree(proc.pid)
                signal_all(victims, signal.SIGSTOP)
                if _snapshots_complete(storage) and _latest_epoch(storage) >= 2:
                    break
                signal_all(victims, signal.SIGCONT)  # caught mid-write: let it finish, look again
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        signal_all(victims, signal.SIGKILL)  # Ray's own processes, wherever they went
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
    killed_at = _latest_epoch(storage)
    assert 2 <= killed_at < ENCODER_EPOCHS, "killed in the middle of stage 2"
    assert not (storage / "debug" / "stages" / "encoder" / "manifest.json").exists()
    assert (storage / "debug" / "stages" / "features" / "manifest.json").exists()

    resumed = subprocess.run(
        _cmd(storage, "--resume"), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-4000:]
    match = re.search(r"resuming stage encoder at epoch (\d+) of (\d+)", out)
    assert match, out[-3000:]
    assert int(match.group(1)) == killed_at + 1 and int(match.group(2)) == ENCODER_EPOCHS

    summary = _summary(storage)
    features, encoder, classifier = summary["stages"]
    assert features["status"] == "reused" and features.get("resumed_from_epoch") is None
    assert (storage / "debug" / "stages" / "features" / "manifest.json").read_bytes() == (
        Path(reference["storage"]) / "stages" / "features" / "manifest.json"
    ).read_bytes()
    assert encoder["status"] == "trained" and encoder["resumed_from_epoch"] == killed_at
    assert classifier["status"] == "trained" and classifier.get("resumed_from_epoch") is None
    assert len(encoder["history"]) == ENCODER_EPOCHS, "the history before the kill is kept"
    assert [s["digest"] for s in summary["stages"]] == [s["digest"] for s in reference["stages"]]
    assert summary["test_accuracy"] == reference["test_accuracy"]
