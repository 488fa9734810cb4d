"""A Ray head from ``cluster/local_head.sh`` on loopback with token auth, and the debug pipeline
submitted to it as a job: by the ``ray job submit --working-dir .`` CLI, then by ``cascade-ray
submit`` (the Python ``JobSubmissionClient``). About 2 minutes on 2 cores; runs in CI.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from paths import ROOT

HEAD_SCRIPT = ROOT / "cluster" / "local_head.sh"
BIN = Path(sys.executable).parent
MAX_UPLOAD_BYTES = 2 << 20  # the repo without .venv, runs/, caches is ~0.3 MiB


@dataclass
class Head:
    exports: dict[str, str]  # what `start` printed
    state: dict[str, str]  # head.env: ports, session, Ray temp dir
    env: dict[str, str]  # a client's environment with the exports applied


def _base_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")
    }
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # this venv's `ray` and python
    return env


def _run(args, env, timeout, cwd=ROOT):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("head-state")
    env = _base_env()
    started = _run(["bash", HEAD_SCRIPT, "start", "--num-cpus", "2", "--state-dir", state_dir], env, timeout=180)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        exports = dict(re.findall(r"^export (\w+)=(\S+)$", started.stdout, re.M))
        state = dict(line.split("=", 1) for line in (state_dir / "head.env").read_text().splitlines())
        yield Head(exports, state, env | exports)
    finally:
        stopped = _run(["bash", HEAD_SCRIPT, "stop", "--state-dir", state_dir], env, timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        status = _run(["bash", HEAD_SCRIPT, "status", "--state-dir", state_dir], env, timeout=60)
        assert status.returncode == 3, f"the head is still up after stop: {status.stdout}"
        assert not any(state_dir.glob("auth_token")), "stop removes the head's own token"


def _get(url: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


def _routable_ip() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # UDP connect sends nothing; it picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_head_prints_exports_listens_on_loopback_and_requires_the_token(head):
    address = head.exports["RAY_ADDRESS"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", address)
    assert head.exports["RAY_AUTH_MODE"] == "token"
    token_path = Path(head.exports["RAY_AUTH_TOKEN_PATH"])
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    token = token_path.read_text().strip()
    assert len(token) == 64

    assert _get(f"{address}/api/jobs/", None) == 401, "the job API must refuse a request without the token"
    assert _get(f"{address}/api/jobs/", "not-the-token") == 403
    assert _get(f"{address}/api/jobs/", token) == 200

    ip = _routable_ip()
    if ip is not None:  # the dashboard honours 127.0.0.1: not reachable on the machine's address
        with pytest.raises(OSError):
            socket.create_connection((ip, int(head.state["DASHBOARD_PORT"])), timeout=3).close()

    status = _run(["bash", HEAD_SCRIPT, "status", "--state-dir", Path(token_path).parent], head.env, timeout=60)
    assert status.returncode == 0 and status.stdout.startswith("running:"), status.stdout + status.stderr
    assert "iptables" in status.stdout, "status shows how to keep the all-interface ports private"


def test_debug_pipeline_runs_as_a_job_from_the_cli_and_from_the_python_client(head, tmp_path):
    storage = tmp_path / "runs"
    job_id = f"cascade-e2e-{uuid.uuid4().hex[:8]}"
    entry = [
        "python",
        "pipelines/three_stage.py",
        "--config",
        "pipelines/configs/debug.yaml",
        f"storage_path={storage}",
    ]

    # 1. the ray CLI, exactly as the README says (it waits and exits 1 if the job fails)
    cli = _run(
        [BIN / "ray", "job", "submit", "--submission-id", job_id, "--working-dir", ".", "--", *entry],
        head.env,
        timeout=420,
    )
    assert cli.returncode == 0, (cli.stdout + cli.stderr)[-4000:]
    status = _run([BIN / "ray", "job", "status", job_id], head.env, timeout=60)
    assert re.search(rf"Job '{job_id}' succeeded", re.sub(r"\x1b\[[0-9;]*m", "", status.stdout + status.stderr))
    logs = _run([BIN / "ray", "job", "logs", job_id], head.env, timeout=60).stdout
    accuracy = re.search(r"^test_accuracy=(\d\.\d{4}) summary=", logs, re.M)
    assert accuracy, logs[-3000:]
    summary = json.loads((storage / "debug" / "summary.json").read_text())
    assert f"{summary['test_accuracy']:.4f}" == accuracy.group(1)
    for stage in ("features", "encoder", "classifier"):
        assert (storage / "debug" / "stages" / stage / "weights.safetensors").is_file()
        assert (storage / "debug" / "stages" / stage / "manifest.json").is_file()

    # what reached the cluster: the working dir without .venv, runs/, tests, caches
    unpacked = Path(head.state["TEMP_DIR"]) / "session_latest" / "runtime_resources" / "working_dir_files"
    packages = [p for p in unpacked.glob("_ray_pkg_*") if p.is_dir()]
    assert len(packages) == 1, list(unpacked.iterdir())
    files = [p for p in packages[0].rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    assert size < MAX_UPLOAD_BYTES, f"working_dir upload is {size / 2**20:.1f} MiB; check .rayignore"
    names = {str(p.relative_to(packages[0])) for p in files}
    assert {"cascade_ray/storage.py", "cascade_ray/data/source.py", "pipelines/three_stage.py"} <= names
    # the symlinked checkout paths arrive as files (Ray's zip follows symlinks), next to the package data
    assert {
        "pipelines/configs/debug.yaml",
        "tune_spaces/encoder.yaml",
        "cascade_ray/shipped/configs/debug.yaml",
    } <= names
    assert not any(
        n.split("/")[0] in (".venv", ".git", "tests", "runs", ".pytest_cache") or "__pycache__" in n for n in names
    )

    # 2. `cascade-ray submit` (JobSubmissionClient): the same pipeline, storage as a file:// URI
    #    through pyarrow.fs, --resume: every stage is reused from the first job's artifacts
    sub = _run(
        [
            sys.executable,
            "-m",
            "cascade_ray.cli",
            "submit",
            "pipelines/configs/debug.yaml",
            f"storage_path=file://{storage}",
            "--resume",
        ],
        head.env,
        timeout=300,
    )
    out = sub.stdout + sub.stderr
    assert sub.returncode == 0, out[-4000:]
    assert re.search(r"^job \S+: SUCCEEDED$", out, re.M)
    assert out.count(" reused: ") == 3, out[-3000:]
    assert f"test_accuracy={accuracy.group(1)} summary=file://{storage}/debug/summary.json" in out


def test_submit_checks_the_config_before_contacting_a_cluster(head, tmp_path):
    sub = _run(
        [
            sys.executable,
            "-m",
            "cascade_ray.cli",
            "submit",
            "pipelines/configs/debug.yaml",
            "storage_path=relative/runs",
            "stages[0].solver.type=Adamw",
        ],
        head.env,
        timeout=120,
    )
    assert sub.returncode == 2
    assert "stages[0].solver.type" in sub.stderr and "AdamW" in sub.stderr
    sub = _run(
        [
            sys.executable,
            "-m",
            "cascade_ray.cli",
            "submit",
            "pipelines/configs/debug.yaml",
            "storage_path=relative/runs",
        ],
        head.env,
        timeout=120,
    )
    assert sub.returncode == 2 and "storage_path: relative path 'relative/runs'" in sub.stderr
    assert "submitted" not in sub.stdout
