"""``cascade-ray serve`` as a user runs it: the command in its own process with its own embedded Ray
(token auth on, as Ray starts a cluster), and the reload line it prints run as printed from another
process. Also what goes wrong there most often: a port already taken, and a client that does not
send the cluster's token."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow_server import free_port
from procs import process_tree, signal_all

pytest.importorskip("ray.serve")  # the `serve` extra; CI installs it with `test`
pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "cascade_ray.cli"]
START_TIMEOUT_S = 180


def _env(home: Path, ray_tmp: Path) -> dict[str, str]:
    """A user's shell on this host: no cluster address, Ray's default auth (token on, token file under HOME)."""
    env = {**os.environ, "HOME": str(home), "RAY_TMPDIR": str(ray_tmp)}
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(key, None)
    return env


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def _healthz(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as response:
        return json.loads(response.read().decode())


def test_the_printed_reload_line_reloads_the_app_and_a_taken_port_is_refused(trained_run, tmp_path):
    home, ray_tmp = tmp_path / "home", Path(tempfile.mkdtemp(prefix="cr-", dir="/tmp"))  # Ray's sockets: short paths
    home.mkdir()
    env, port = _env(home, ray_tmp), free_port()
    second = tmp_path / "v2" / "debug"  # another run of the same pipeline to reload to
    shutil.copytree(trained_run, second)
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [*CLI, "serve", str(trained_run), "--port", str(port)],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "  reload: " not in log_path.read_text():
            assert proc.poll() is None, f"serve ended: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"serve did not start: {log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        printed = next(line for line in log_path.read_text().splitlines() if line.startswith("  reload: "))
        shown = log_path.read_text().splitlines()
        assert not [line for line in shown if line.startswith("INFO ")], shown[:20]  # Serve's INFO lines: debug only
        command = printed.split("reload: ", 1)[1]
        assert command.startswith("RAY_AUTH_MODE=token cascade-ray serve --reload NEW_RUN --name cascade"), command
        assert _healthz(port)["run"] == str(trained_run)

        # a second server on the same port: refused before Ray or the run are touched
        taken = subprocess.run(
            [*CLI, "serve", str(second), "--port", str(port)], env=env, capture_output=True, text=True, timeout=120
        )
        assert taken.returncode == 2, taken.stderr[-3000:]
        assert f"--port: 127.0.0.1:{port} cannot be listened on" in taken.stderr and "Traceback" not in taken.stderr

        run_it = [sys.executable, "-m", "cascade_ray.cli"]  # `cascade-ray` of the printed line, from this venv
        line = command.replace("NEW_RUN", shlex.quote(str(second))).replace("cascade-ray", shlex.join(run_it))
        # without the token mode Ray's client sends no token: the join is refused, with the fix
        bare = subprocess.run(
            ["bash", "-c", line.replace("RAY_AUTH_MODE=token ", "")],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert bare.returncode == 2, bare.stderr[-3000:]
        assert "no Ray cluster could be joined" in bare.stderr and "set RAY_AUTH_MODE=token" in bare.stderr
        assert _healthz(port)["run"] == str(trained_run)

        # no --address: this process starts a Ray of its own, which holds no app; the error says what to pass
        lost = subprocess.run(
            [*CLI, "serve", "--reload", str(second)], env=env, capture_output=True, text=True, timeout=180
        )
        assert lost.returncode == 2, lost.stderr[-3000:]
        assert "--address: no app 'cascade' on this cluster" in lost.stderr and "'reload:' line" in lost.stderr

        # as printed: reloaded in place
        reloaded = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=300)
        assert reloaded.returncode == 0, reloaded.stdout[-2000:] + reloaded.stderr[-3000:]
        assert f"reloaded cascade: {second}" in reloaded.stdout
        assert _healthz(port)["run"] == str(second)
    finally:
        tree = process_tree(proc.pid)
        # SIGTERM, as systemd, docker and Kubernetes stop a service: handled as Ctrl-C (the app removed,
        # the embedded Ray shut down)
        signal_all({proc.pid}, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            signal_all({proc.pid}, signal.SIGKILL)
            proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while (left := (tree & process_tree(proc.pid)) - {proc.pid}) and time.monotonic() < deadline:
            time.sleep(0.5)  # Ray's processes wind down after the driver
        lingering = {pid: _cmdline(pid) for pid in left}
        # whatever of its Ray is left, by PID: in its tree before and after (a PID reused meanwhile is in one only)
        signal_all(left, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0 and "stopping" in log_path.read_text(), log_path.read_text()[-3000:]
    assert not left, f"processes of the stopped server still ran: {lingering}"
