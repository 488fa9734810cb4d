"""A real MLflow tracking server on loopback for the tests, started and stopped by PID.

``start_mlflow(folder)`` runs ``mlflow server`` (the one next to this Python) with a sqlite
backend and a local artifact folder on a free 127.0.0.1 port, one worker, and waits (bounded)
for ``/health``. :meth:`MlflowServer.get` / :meth:`post` call its REST API.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MLFLOW = Path(sys.executable).parent / "mlflow"
START_TIMEOUT_S = 240.0  # first start migrates the sqlite store; slow on a busy 2-core machine


@dataclass
class MlflowServer:
    uri: str
    proc: subprocess.Popen
    log: Path

    def get(self, endpoint: str, **query: Any) -> dict[str, Any]:
        url = f"{self.uri}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return json.loads(reply.read())

    def post(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.uri}/api/2.0/mlflow/{endpoint}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())

    def runs(self, experiment: str) -> list[dict[str, Any]]:
        """Every run of `experiment` (by name)."""
        found = self.get("experiments/get-by-name", experiment_name=experiment)["experiment"]
        return self.post("runs/search", {"experiment_ids": [found["experiment_id"]], "max_results": 1000}).get(
            "runs", []
        )

    def stop(self) -> None:
        """Stop the server and its workers (its own process group, started by us)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow(folder: Path) -> MlflowServer:
    """``mlflow server`` with its store in `folder`, on a free loopback port."""
    if not MLFLOW.exists():
        raise RuntimeError(f"{MLFLOW} is missing: pip install mlflow (the test extra has it)")
    port, log = free_port(), folder / "mlflow.log"
    proc = subprocess.Popen(
        [
            str(MLFLOW),
            "server",
            "--backend-store-uri",
            f"sqlite:///{folder / 'mlflow.db'}",
            "--artifacts-destination",
            str(folder / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        cwd=folder,
        start_new_session=True,  # its own process group: stop() ends the workers it forks too
    )
    server = MlflowServer(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{server.uri}/health", timeout=2) as reply:
                if reply.status == 200:
                    return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"mlflow server did not answer on {server.uri} within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.3)
