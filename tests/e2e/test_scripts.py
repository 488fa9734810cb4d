"""Entry points as a user runs them: the pipeline script and the CLI, as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from paths import CONFIGS, ROOT

SCRIPT = ROOT / "pipelines" / "three_stage.py"


def _run(args, tmp_path, timeout=300):
    # RAY_TMPDIR: a private session folder, so "did Ray start?" is a directory listing
    # (short, under /tmp: Ray's socket paths must stay under 108 bytes)
    ray_tmp = Path(tempfile.mkdtemp(prefix="cr-", dir="/tmp"))
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout, cwd=tmp_path)
    return proc, ray_tmp


def test_pipeline_script_runs_the_debug_cascade_with_an_embedded_ray(tmp_path):
    storage = tmp_path / "runs"
    proc, ray_tmp = _run([SCRIPT, "--config", CONFIGS / "debug.yaml", f"storage_path={storage}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((storage / "debug" / "summary.json").read_text())
    assert f"test_accuracy={summary['test_accuracy']:.4f}" in proc.stdout
    assert "composed model test_accuracy" in proc.stdout
    for stage in ("features", "encoder", "classifier"):
        assert (storage / "debug" / "stages" / stage / "weights.safetensors").is_file()
    assert any(ray_tmp.iterdir()), "the embedded Ray used RAY_TMPDIR"


def test_invalid_config_exits_2_listing_every_problem_and_starts_no_ray(tmp_path):
    bad = tmp_path / "bad.yaml"
    text = (CONFIGS / "debug.yaml").read_text()
    text = text.replace("type: AdamW, lr: 1e-2, weight_decay: 1e-4", "type: Adamw, lr: 1e-2, betas: '0.9, 0.999'", 1)
    text = text.replace("in_channels: 16, d_model", "in_channels: 32, d_model").replace("log_interval: 10}", "log_interval: 10, epoch: 1}", 1)
    assert text.count("Adamw") == 1 and text.count("epoch: 1") == 1, "the mutations must apply"
    bad.write_text(text)
    storage = tmp_path / "runs"
    for args in ([SCRIPT, "--config", bad, f"storage_path={storage}"], ["-m", "cascade_ray.cli", "validate", bad]):
        proc, ray_tmp = _run(args, tmp_path)
        assert proc.returncode == 2, proc.stderr
        for path in ("stages[0].solver.type", "stages[0].solver.betas", "stages[0].train.epoch", "stages[1].model.in_channels"):
            assert path in proc.stderr
        assert "4 problem(s)" in proc.stderr
        assert not any(ray_tmp.iterdir()), "no Ray session may start for an invalid config"
        assert not storage.exists(), "nothing may be written for an invalid config"


def test_missing_fashion_mnist_says_how_to_install_it(tmp_path):
    proc, ray_tmp = _run([SCRIPT, f"data.root={tmp_path / 'nowhere'}", f"storage_path={tmp_path / 'runs'}"], tmp_path)
    assert proc.returncode == 2
    assert "apt-get install dataset-fashion-mnist" in proc.stderr and "data.root" in proc.stderr
    assert not any(ray_tmp.iterdir())
